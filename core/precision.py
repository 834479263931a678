"""What `--precision` and `--tf32` mean on every stack, decided from the RunConfig alone (no framework).

Stacks left alone run different maths under the same flag: PyTorch leaves TF32 off for fp32 matmuls where
TensorFlow and Paddle turn it on, and "bf16" was autocast over fp32 parameters on one stack, a bf16 model
with fp32 master weights on another, bf16 parameters with bf16 gradient reduction on a third. A comparison
is only fair when every stack runs the same numerics, or the record says where it does not. So:

- fp32 is IEEE fp32: TF32 off in every framework's cuBLAS matmuls and cuDNN convolutions, unless the run
  opts in with --tf32 (fp32 runs only), which turns it on in every framework alike.
- bf16 / fp16 (the definition, torchtitan's default): matmuls and attention in bf16/fp16; fp32 master
  weights and fp32 AdamW state; gradients reduced across ranks in fp32; fp16 adds dynamic loss scaling.
  Which other ops run in low precision (LayerNorm, the residual stream between blocks) is the stack's
  choice: recorded, not prescribed.

Each adapter states its numerics for a configuration (Backend.numerics, a `Numerics`); what departs from
the definition is listed with the reason (`deviations`). Each worker applies the TF32 switches named here
(`tf32_switches`) and checks the stated numerics against what it observes in its framework (`mismatches`),
so a record cannot claim numerics the run did not have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from core.config import RunConfig

LOW_PRECISIONS = ("bf16", "fp16")
# The definition in one sentence, for reports.
DEFINITION_TEXT = (
    "bf16/fp16: matmuls and attention in bf16/fp16, fp32 master weights and fp32 AdamW state, gradients "
    "reduced across ranks in fp32 (fp16 with dynamic loss scaling); fp32: IEEE fp32, TF32 only with --tf32"
)

# Per framework, the switches that decide whether fp32 matmuls and convolutions may run as TF32 on a GPU
# (compute capability 8.0+), and the value each takes for (IEEE, TF32), set in this order. torch >= 2.9 has
# two APIs over one state: the legacy flags (matmul.allow_tf32, i.e. float32_matmul_precision high/highest,
# and cudnn.allow_tf32) and the fp32_precision ones (cuBLAS, cuDNN's convolutions and RNNs apart; cuDNN's
# conv default is "tf32"). Its getters raise once the two disagree ("mix of the legacy and new APIs"):
# setting only the new API to "tf32" leaves the legacy one at "highest", and any library that reads the
# legacy getter (torch.get_float32_matmul_precision) then fails; so both are set, legacy first.
# TensorFlow: one switch for cuBLAS and cuDNN. Paddle: phi's allow_tf32_cublas and allow_tf32_cudnn (both on
# by default in CUDA builds).
TF32_SWITCHES: dict[str, dict[str, tuple[object, object]]] = {
    "torch": {
        "torch.backends.cuda.matmul.allow_tf32": (False, True),
        "torch.backends.cudnn.allow_tf32": (False, True),
        "torch.backends.cuda.matmul.fp32_precision": ("ieee", "tf32"),
        "torch.backends.cudnn.conv.fp32_precision": ("ieee", "tf32"),
        "torch.backends.cudnn.rnn.fp32_precision": ("ieee", "tf32"),
    },
    "tensorflow": {"tf.config.experimental.enable_tensor_float_32_execution": (False, True)},
    "paddle": {
        "paddle.base.core.set_cublas_switch": (False, True),
        "paddle.base.core.set_cudnn_switch": (False, True),
    },
}


def tf32_allowed(cfg: RunConfig) -> bool:
    """Whether fp32 matmuls may run as TF32: only an fp32 run that asked for it. A bf16/fp16 run keeps
    whatever it computes in fp32 in IEEE fp32 (the CLI refuses --tf32 there)."""
    return cfg.model.precision == "fp32" and cfg.model.tf32


def tf32_switches(framework: str, cfg: RunConfig) -> dict[str, object]:
    """The switches a worker of `framework` sets for this run, with their values. Set on every device: on a
    CPU they change nothing, but the worker still runs the calls, so the suite exercises them."""
    allow = tf32_allowed(cfg)
    return {name: values[allow] for name, values in TF32_SWITCHES[framework].items()}


def dtype_name(dtype) -> str:
    """A framework dtype (torch.bfloat16, tf.float32, paddle.float16, 'float32', ...) by our short names."""
    text = str(getattr(dtype, "name", None) or dtype).rsplit(".", 1)[-1].lower()
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(text, text)


@dataclass(frozen=True)
class Numerics:
    """The numerics of one configuration: what runs in which dtype.

    compute: the matmuls and attention. forward_params: the parameter tensors as forward holds them, before
    any per-op cast (autocast and Keras's mixed policy cast inside each op, so theirs stay fp32; FSDP2's
    param_dtype and a low-precision module hold bf16 tensors). activations: the residual stream between
    blocks. grad_reduce: the gradients' reduction across ranks (what travels and is summed). master_weights:
    "fp32" when the weights the optimizer updates are fp32 and forward computes with a low-precision copy of
    them (a cast or a separate tensor); "none" when forward uses the updated weights themselves (fp32 runs).
    optimizer_state: AdamW's moments. loss_scaling: "dynamic" or "none". tf32: whether this run allows
    TF32 for its fp32 matmuls. mechanism: how the stack does it, in its own terms. why: for a field that
    departs from the definition, the reason (a user's option, or what the stack cannot do)."""

    compute: str
    forward_params: str
    activations: str
    grad_reduce: str
    master_weights: str
    optimizer_state: str = "fp32"
    loss_scaling: str = "none"
    tf32: bool = False
    mechanism: str = ""
    why: dict = field(default_factory=dict)

    def deviations(self, cfg: RunConfig) -> list[str]:
        """Every field the definition fixes that this configuration does otherwise, with the reason."""
        out = []
        for name, expected in definition(cfg).items():
            actual = getattr(self, name)
            if actual != expected:
                reason = self.why.get(name)
                out.append(f"{name} {actual} (definition: {expected})" + (f": {reason}" if reason else ""))
        return out

    def record(self, cfg: RunConfig) -> dict:
        """The record's form: the fields, and the deviations from the definition."""
        d = dataclasses.asdict(self)
        d.pop("why")
        return {**d, "deviations": self.deviations(cfg)}


def definition(cfg: RunConfig) -> dict:
    """What the definition fixes for this run's precision (see the module docstring)."""
    low = cfg.model.precision in LOW_PRECISIONS
    return {
        "compute": cfg.model.precision,
        "grad_reduce": "fp32",
        "master_weights": "fp32" if low else "none",
        "optimizer_state": "fp32",
        "loss_scaling": "dynamic" if cfg.model.precision == "fp16" else "none",
        "tf32": tf32_allowed(cfg),
    }


def autocast_numerics(cfg: RunConfig, mechanism: str = "torch.autocast over fp32 parameters", **changes):
    """The definition as autocast gives it: fp32 parameters, each matmul's inputs cast to the low precision,
    elementwise sums of fp32 and low-precision tensors promoted to fp32 (so the residual stream stays fp32),
    fp32 gradients reduced as they are. `changes`: fields a configuration sets otherwise."""
    low = cfg.model.precision in LOW_PRECISIONS
    facts = Numerics(
        compute=cfg.model.precision,
        forward_params="fp32",
        activations="fp32",
        grad_reduce="fp32",
        master_weights="fp32" if low else "none",
        loss_scaling="dynamic" if cfg.model.precision == "fp16" else "none",
        tf32=tf32_allowed(cfg),
        mechanism=mechanism if low else "fp32 throughout",
    )
    return dataclasses.replace(facts, **changes)


def low_precision_module_numerics(cfg: RunConfig, mechanism: str, reason: str) -> Numerics:
    """A stack that casts the module itself to the low precision (DeepSpeed's native bf16/fp16 section,
    Paddle's O2): parameters in forward, the residual stream and the reduced gradients are all low
    precision, the fp32 master weights live in the optimizer. `reason`: the option that chose it, which
    the record names as the deviation from the definition (gradients not reduced in fp32)."""
    low = cfg.model.precision
    return autocast_numerics(
        cfg, mechanism, forward_params=low, activations=low, grad_reduce=low, why={"grad_reduce": reason}
    )


def master_weights(precision: str, updated_dtype: str) -> str:
    """The master_weights fact from the dtype of the tensors the optimizer updates: in a low-precision run
    forward computes with a low-precision copy of them, so they are the master weights; in an fp32 run
    forward uses them directly ("none")."""
    return updated_dtype if precision in LOW_PRECISIONS else "none"


def mismatches(stated: dict, observed: dict) -> list[str]:
    """The observed facts (None: not observable here) that differ from the stated ones."""
    return [
        f"{name}: stated {stated.get(name)}, observed {value}"
        for name, value in observed.items()
        if value is not None and value != stated.get(name)
    ]


def checked(stated: dict, observed: dict, who: str) -> dict:
    """The numerics a worker records: the stated ones, with what it observed; raises when they disagree,
    so no record claims numerics the run did not have."""
    wrong = mismatches(stated, observed)
    if wrong:
        raise RuntimeError(f"{who} ran other numerics than its adapter states: " + "; ".join(wrong))
    return {**stated, "observed": {k: v for k, v in observed.items() if v is not None}}
