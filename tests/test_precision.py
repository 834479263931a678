"""What --precision and --tf32 mean on every stack (core.precision), held without a GPU.

fp32 is IEEE fp32 in every framework unless --tf32 (fp32 runs only) turns TF32 on in every framework: the
switches each worker sets are decided here from the RunConfig, so the CUDA contract (which switch, which
value, per stack) is checked on a CPU, and each worker's own call of its framework's switches runs on a CPU
build too (no-ops there, read back). bf16/fp16 have one definition (low-precision matmuls, fp32 master
weights and AdamW state, fp32 gradient reduction); each adapter states its numerics, and the communication
it declares must travel in the gradient-reduction dtype it states. The runs that execute bf16/fp16 on a CPU
and compare stacks are in tests/test_equivalence.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO
from record_factory import make_record

from backends import backend_names, get_backend
from core.config import RunConfig
from core.precision import checked, tf32_switches
from core.records import config_key
from harness.analyze.report import build, render_md
from harness.cli import main, make_parser
from harness.run.options import build_config
from workloads.spec import PRESETS

unit = pytest.mark.unit

# The CUDA contract, written out: per framework, every switch a worker sets and its value.
IEEE = {
    "torch": {
        "torch.backends.cuda.matmul.allow_tf32": False,
        "torch.backends.cudnn.allow_tf32": False,
        "torch.backends.cuda.matmul.fp32_precision": "ieee",
        "torch.backends.cudnn.conv.fp32_precision": "ieee",
        "torch.backends.cudnn.rnn.fp32_precision": "ieee",
    },
    "tensorflow": {"tf.config.experimental.enable_tensor_float_32_execution": False},
    "paddle": {"paddle.base.core.set_cublas_switch": False, "paddle.base.core.set_cudnn_switch": False},
}
TF32 = {
    "torch": {
        "torch.backends.cuda.matmul.allow_tf32": True,
        "torch.backends.cudnn.allow_tf32": True,
        "torch.backends.cuda.matmul.fp32_precision": "tf32",
        "torch.backends.cudnn.conv.fp32_precision": "tf32",
        "torch.backends.cudnn.rnn.fp32_precision": "tf32",
    },
    "tensorflow": {"tf.config.experimental.enable_tensor_float_32_execution": True},
    "paddle": {"paddle.base.core.set_cublas_switch": True, "paddle.base.core.set_cudnn_switch": True},
}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def cfg_for(backend: str, precision: str = "fp32", device: str = "cuda", tf32: bool = False, world=8, **opts):
    return RunConfig.build(
        backend=backend,
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=world,
        device=device,
        precision=precision,
        tf32=tf32,
        backend_options=get_backend(backend).Options.from_dict(opts).to_dict(),
    )


@unit
@pytest.mark.parametrize("backend", backend_names())
def test_fp32_is_ieee_on_every_stack_unless_tf32_is_asked(backend):
    """On CUDA, the default fp32 run turns TF32 off in every framework (TensorFlow and Paddle default it
    on, torch's cuDNN convolutions too); --tf32 turns it on everywhere alike; a bf16 run that carried
    tf32=True (a config written by hand: the CLI refuses it) keeps its fp32 leftovers IEEE."""
    framework = get_backend(backend).framework
    ieee, tf32 = cfg_for(backend), cfg_for(backend, tf32=True)
    assert tf32_switches(framework, ieee) == IEEE[framework]
    assert tf32_switches(framework, tf32) == TF32[framework]
    assert tf32_switches(framework, cfg_for(backend, "bf16", tf32=True)) == IEEE[framework]
    adapter = get_backend(backend)
    assert (adapter.numerics(ieee).tf32, adapter.numerics(tf32).tf32) == (False, True)


@unit
def test_tf32_is_refused_outside_fp32_and_keys_its_runs_apart(out, capsys):
    code = main(["run", "--backend", "torch-ddp", "--precision", "bf16", "--tf32", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--tf32 applies to --precision fp32 only" in err[0], err
    assert not out.exists()
    args = make_parser().parse_args(["run", "--backend", "torch-ddp", "--device", "cpu", "--tf32"])
    cfg = build_config(args, "torch-ddp", 1)
    assert cfg.model.tf32 is True
    # a TF32 run is other maths than an IEEE one: never grouped with it as a repeat
    keys = {
        config_key({"config": c.to_dict()}, "*").precision for c in (cfg, cfg_for("torch-ddp", device="cpu"))
    }
    assert keys == {"fp32+tf32", "fp32"}


# (backend, options, device) -> bf16 numerics: matmuls, parameters in forward, residual stream, gradient
# reduction, master weights, and the fields that deviate from the definition.
BF16 = [
    ("torch-ddp", {}, "cpu", ("bf16", "fp32", "fp32", "fp32", "fp32"), []),
    ("horovod", {}, "cpu", ("bf16", "fp32", "fp32", "fp32", "fp32"), []),
    ("horovod", {"compression": "fp16"}, "cpu", ("bf16", "fp32", "fp32", "fp16", "fp32"), ["grad_reduce"]),
    ("torch-fsdp", {}, "cpu", ("bf16", "bf16", "bf16", "fp32", "fp32"), []),
    ("torch-fsdp", {"fp32_reduce": False}, "cpu", ("bf16", "bf16", "bf16", "bf16", "fp32"), ["grad_reduce"]),
    ("deepspeed", {"zero_stage": 2}, "cpu", ("bf16", "fp32", "fp32", "fp32", "fp32"), []),
    ("deepspeed", {"zero_stage": 3}, "cpu", ("bf16", "fp32", "fp32", "fp32", "fp32"), []),
    (
        "deepspeed",
        {"zero_stage": 2, "mixed_precision": "native"},
        "cpu",
        ("bf16", "bf16", "bf16", "bf16", "fp32"),
        ["grad_reduce"],
    ),
    ("tf-mwms", {}, "cpu", ("bf16", "fp32", "bf16", "fp32", "fp32"), []),
    ("paddle-fleet", {}, "cuda", ("bf16", "fp32", "fp32", "fp32", "fp32"), []),
    ("paddle-fleet", {"amp_level": "O2"}, "cuda", ("bf16", "bf16", "bf16", "bf16", "fp32"), ["grad_reduce"]),
]


@unit
@pytest.mark.parametrize("backend, options, device, facts, deviating", BF16)
def test_each_stack_states_its_bf16_numerics_and_where_it_deviates(
    backend, options, device, facts, deviating
):
    cfg = cfg_for(backend, "bf16", device, **options)
    n = get_backend(backend).numerics(cfg)
    assert (n.compute, n.forward_params, n.activations, n.grad_reduce, n.master_weights) == facts
    assert (n.optimizer_state, n.loss_scaling, n.tf32) == ("fp32", "none", False)
    deviations = n.record(cfg)["deviations"]
    assert [d.split()[0] for d in deviations] == deviating
    assert all(": --" in d for d in deviations), deviations  # each names the option that chose it


@unit
@pytest.mark.parametrize("backend", backend_names())
def test_fp32_runs_state_fp32_throughout_and_fp16_adds_loss_scaling(backend):
    fp32 = get_backend(backend).numerics(cfg_for(backend))
    assert {fp32.compute, fp32.forward_params, fp32.activations, fp32.grad_reduce} == {"fp32"}
    assert (fp32.master_weights, fp32.loss_scaling, fp32.record(cfg_for(backend))["deviations"]) == (
        "none",
        "none",
        [],
    )
    assert get_backend(backend).numerics(cfg_for(backend, "fp16")).loss_scaling == "dynamic"


def configurations():
    """Every stack in every precision, with the options that change what it reduces, on CPU and GPU."""
    variants = {
        "horovod": [{}, {"compression": "fp16"}],
        "torch-fsdp": [{}, {"fp32_reduce": False}, {"reshard_after_forward": False}],
        "deepspeed": [
            {"zero_stage": s, "mixed_precision": m} for s in range(4) for m in ("autocast", "native")
        ],
        "paddle-fleet": [{"sharding_stage": s, "amp_level": a} for s in (0, 1) for a in ("O1", "O2")],
    }
    for backend in backend_names():
        for options in variants.get(backend, [{}]):
            for precision in ("fp32", "bf16", "fp16"):
                for device in ("cpu", "cuda"):
                    yield backend, options, precision, device


@unit
def test_the_declared_communication_reduces_gradients_in_the_stated_dtype():
    """The analytic volume (comm_pattern), and with it the prediction's schedule and the traces held to it,
    reduces the gradients in the dtype each adapter's numerics state: a reduction dtype changed in one
    place and not the other fails here."""
    checked_terms = 0
    for backend, options, precision, device in configurations():
        cfg = cfg_for(backend, precision, device, **options)
        adapter = get_backend(backend)
        stated = ELEMENT_BYTES[adapter.numerics(cfg).grad_reduce]
        for term in adapter.comm_pattern(cfg).terms:
            if term.what.startswith("gradients") or term.op == "reduce_scatter":
                assert term.dtype_bytes == stated, (backend, options, precision, device, term)
                checked_terms += 1
    assert checked_terms >= 100


@unit
def test_a_worker_refuses_numerics_it_did_not_observe():
    stated = {"compute": "bf16", "grad_reduce": "fp32", "activations": "fp32"}
    kept = checked(stated, {"compute": "bf16", "grad_reduce": None}, "rank 0")  # None: not observable
    assert kept["observed"] == {"compute": "bf16"} and kept["grad_reduce"] == "fp32"
    with pytest.raises(RuntimeError, match="grad_reduce: stated fp32, observed bf16"):
        checked(stated, {"compute": "bf16", "grad_reduce": "bf16"}, "rank 0")


@unit
def test_the_report_shows_each_run_s_numerics_beside_its_figures():
    """Hand-written numerics in two bf16 records; a third record from before workers recorded them."""
    fsdp, ddp, old = (
        make_record(label, 2, precision="bf16") for label in ("torch-fsdp", "torch-ddp", "horovod")
    )
    numerics = {
        "compute": "bf16",
        "forward_params": "bf16",
        "activations": "bf16",
        "grad_reduce": "bf16",
        "master_weights": "fp32",
        "optimizer_state": "fp32",
        "loss_scaling": "none",
        "tf32": False,
        "mechanism": "FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), no autocast",
        "deviations": ["grad_reduce bf16 (definition: fp32): --fp32-reduce off"],
    }
    for r in fsdp["ranks"]:
        r["math_mode"] = {"tf32": None, "numerics": numerics}
    for r in ddp["ranks"]:
        r["math_mode"] = {"tf32": None, "numerics": {**numerics, "forward_params": "fp32", "deviations": []}}
    shown = render_md(build([fsdp, ddp, old], None, 0.1, with_figures=False))
    assert "gradient reduction" in shown and "master weights" in shown
    assert (
        "| torch-fsdp | bf16 | bf16 | bf16 | bf16 | fp32 | fp32 | off | "
        "FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16), no autocast | "
        "grad_reduce bf16 (definition: fp32): --fp32-reduce off |"
    ) in shown
    assert "| torch-ddp | bf16 | fp32 | bf16 | bf16 | fp32 | fp32 | off |" in shown
    assert "| horovod | not recorded |" in shown


WORKERS = {
    "torch": "backends.torch_common",
    "tensorflow": "backends.tf_mwms.worker",
    "paddle": "backends.paddle_fleet.worker",
}
BACKEND_OF = {"torch": "torch-ddp", "tensorflow": "tf-mwms", "paddle": "paddle-fleet"}


@pytest.mark.parametrize("framework", list(WORKERS))
def test_each_worker_sets_its_framework_s_tf32_switches_on_a_cpu_build(framework):
    """The worker's own apply_tf32_rule, in its framework (one process each), with --tf32 and then
    without: every switch of the contract is set and reads back as set, so the calls a GPU run makes
    exist and work in these builds; on a CPU they change no maths."""
    code = (
        "import json\n"
        "from core.config import RunConfig\n"
        "from workloads.spec import PRESETS\n"
        f"from {WORKERS[framework]} import apply_tf32_rule\n"
        f"backend = {BACKEND_OF[framework]!r}\n"
        "cfgs = [RunConfig.build(backend=backend, workload='tiny', spec=PRESETS['tiny'], world_size=1,"
        " device='cpu', tf32=t) for t in (True, False)]\n"
        "print(json.dumps([apply_tf32_rule(cfg) for cfg in cfgs]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    on, off = json.loads(done.stdout.strip().splitlines()[-1])
    assert (on, off) == (TF32[framework], IEEE[framework])
