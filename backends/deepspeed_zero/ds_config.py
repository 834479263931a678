"""A DeepSpeed run's settings: the adapter's options (DeepSpeedOptions, one per flag of the stack), the
engine's configuration built from them and the RunConfig alone (ds_config, handed to deepspeed.initialize),
and the tuned set's ZeRO-3 and bf16 settings with their sources.

Apart from the adapter (backends.deepspeed_zero), which describes, checks and launches the stack, so that
what reaches the engine is one module's job; the worker reads it from here. Imports no framework.
"""

import argparse
from dataclasses import dataclass

from backends.base import Options, Tuned, option, switch
from backends.deepspeed_zero.comm import (
    MAX_LIVE_PARAMETERS,
    MAX_REUSE_DISTANCE,
    PERSISTENCE_THRESHOLD,
    PREFETCH_BUCKET_ELEMENTS,
    REDUCE_BUCKET_ELEMENTS,
    Stage3,
    hidden_size_rule,
)
from core.precision import LOW_PRECISIONS

STAGES = (0, 1, 2, 3)


def element_count(text: str) -> int:
    """A count of elements as DeepSpeed's docs write one: 5e7 or 50000000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count of elements such as 5e7, got '{text}'") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole count of elements, at least 1, got '{text}'")
    return int(value)


MIXED_PRECISION = ("autocast", "native")
DS_OPTIMIZERS = ("torch", "deepspeed")
DS_DOCS = "deepspeed.ai/docs/config-json (zero_optimization); deepspeed/runtime/zero/config.py defaults"


@dataclass(frozen=True)
class DeepSpeedOptions(Options):
    zero_stage: int = option(
        3,
        "--zero-stage",
        type=int,
        choices=STAGES,
        help="ZeRO stage (0 none, 1 optimizer state, 2 +gradients, 3 +parameters)",
    )
    offload_optimizer: bool = option(
        False, "--offload-optimizer", help="keep the optimizer state and step on the CPU (ZeRO-Offload)"
    )
    mixed_precision: str = option(
        "autocast",
        "--ds-mixed-precision",
        choices=MIXED_PRECISION,
        help="with bf16/fp16: DeepSpeed's torch_autocast section over fp32 parameters, gradients reduced "
        "and parameters gathered in fp32 (autocast: the suite's definition), or its bf16/fp16 section "
        "(native: the module cast to bf16/fp16, which it gathers and reduces in, fp32 master weights)",
    )
    optimizer: str = option(
        "torch",
        "--ds-optimizer",
        choices=DS_OPTIMIZERS,
        help="the AdamW the engine steps: torch's (the same as every torch stack), or DeepSpeed's own "
        "(FusedAdam on a GPU, DeepSpeedCPUAdam on a CPU; both built as C++/CUDA ops on first use)",
    )
    overlap_comm: bool | None = switch(
        None,
        "--overlap-comm",
        help="ZeRO's overlap_comm: reduce gradients on a side stream while backward goes on (DeepSpeed's "
        "default: on at stage 3, off below)",
    )
    fp32_reduce: bool | None = switch(
        None,
        "--ds-fp32-reduce",
        help="with --ds-mixed-precision native: reduce gradients in fp32 (on: communication_data_type fp32, "
        "parameters still gathered in the module's bf16/fp16, as FSDP2's reduce_dtype=fp32) or in the "
        "module's dtype (DeepSpeed's default); under torch_autocast gradients are reduced in fp32 anyway",
    )
    prefetch_bucket: int | None = option(
        None,
        "--prefetch-bucket",
        type=element_count,
        help="ZeRO-3's stage3_prefetch_bucket_size: parameter elements each prefetch gathers ahead in one "
        f"all-gather (default: DeepSpeed's, {PREFETCH_BUCKET_ELEMENTS:.0e}); sets how many gathers a step "
        "issues",
    )
    persistence_threshold: int | None = option(
        None,
        "--persistence-threshold",
        type=element_count,
        help="ZeRO-3's stage3_param_persistence_threshold: tensors of at most this many elements stay whole "
        f"on every rank, never gathered (default: DeepSpeed's, {PERSISTENCE_THRESHOLD:.0e})",
    )
    max_live_parameters: int | None = option(
        None,
        "--max-live-parameters",
        type=element_count,
        help="ZeRO-3's stage3_max_live_parameters: gathered parameter elements above which nothing more is "
        f"prefetched (default: DeepSpeed's, {MAX_LIVE_PARAMETERS:.0e})",
    )
    max_reuse_distance: int | None = option(
        None,
        "--max-reuse-distance",
        type=element_count,
        help="ZeRO-3's stage3_max_reuse_distance: parameters used again within this many fetched elements "
        f"stay gathered, the others are gathered again for backward (default: DeepSpeed's, "
        f"{MAX_REUSE_DISTANCE:.0e})",
    )
    reduce_bucket: int | None = option(
        None,
        "--reduce-bucket",
        type=element_count,
        help="ZeRO-3's reduce_bucket_size: gradient elements reduce-scattered together (default: "
        f"DeepSpeed's, {REDUCE_BUCKET_ELEMENTS:.0e})",
    )

    def stage3(self) -> Stage3:
        """The ZeRO-3 settings the engine runs with: those given, else DeepSpeed's defaults."""
        given = {
            "persistence_threshold": self.persistence_threshold,
            "max_live_parameters": self.max_live_parameters,
            "max_reuse_distance": self.max_reuse_distance,
            "prefetch_bucket": self.prefetch_bucket,
            "reduce_bucket": self.reduce_bucket,
        }
        return Stage3(**{name: value for name, value in given.items() if value is not None})

    def optimizer_kernel(self) -> str:
        """DeepSpeed's FusedAdam is one kernel; torch's AdamW (--ds-optimizer torch) runs its default,
        foreach, over the engine's flat partitions."""
        return "fused" if self.optimizer == "deepspeed" else "foreach"


def native_low_precision(cfg) -> bool:
    """Whether this run uses DeepSpeed's own bf16/fp16 section (a low-precision module)."""
    native = DeepSpeedOptions.from_dict(cfg.backend_options).mixed_precision == "native"
    return native and cfg.model.precision in LOW_PRECISIONS


def fp32_reduced_module(cfg) -> bool:
    """Whether a native bf16/fp16 module has its gradients reduced in fp32 (--ds-fp32-reduce on)."""
    return native_low_precision(cfg) and bool(DeepSpeedOptions.from_dict(cfg.backend_options).fp32_reduce)


def module_precision(cfg) -> str:
    """The dtype of the engine's module: the low precision for a native bf16/fp16 run, else fp32 (under
    torch_autocast the parameters stay fp32)."""
    return cfg.model.precision if native_low_precision(cfg) else "fp32"


def ds_config(cfg) -> dict:
    """The DeepSpeed configuration of a run. AdamW is the client optimizer (workloads.torch_model), so no
    "optimizer" section. No gradient clipping, as for every backend (workloads.spec.OptimizerSpec): that
    must be said, since DeepSpeed 0.19 clips to a global norm of 1.0 when "gradient_clipping" is absent
    (deepspeed/runtime/constants.py GRADIENT_CLIPPING_DEFAULT), at every ZeRO stage; a gradient norm over 1
    then scales the step's gradients down, which AdamW's scale invariance hides for a step or two only.
    bf16/fp16 by default through the torch_autocast section: fp32 parameters, each Linear's matmul under
    torch.autocast, and, with lower_precision_safe_modules empty, every gradient reduced (and every ZeRO-3
    parameter gathered) in its fp32 dtype; DeepSpeed's own default list (Linear) would reduce the Linear
    layers' gradients in bf16, against the suite's definition (core.precision). fp16 then scales the loss
    with torch's GradScaler. --ds-mixed-precision native: the bf16/fp16 section instead, a low-precision
    module and gradients plus fp32 master weights, fp16 with DeepSpeed's dynamic loss scaling, and with
    --ds-fp32-reduce on "communication_data_type": "fp32" (gradients reduced in fp32, parameters still
    gathered in the module's dtype: the tuned bf16, bf16_tuning). At ZeRO-3 every setting of comm.Stage3 is
    written, DeepSpeed's default or the one given, so the record names what ran. The engine's throughput
    timer is off (see below)."""
    opts = DeepSpeedOptions.from_dict(cfg.backend_options)
    zero = {"stage": opts.zero_stage, **(opts.stage3().config() if opts.zero_stage == 3 else {})}
    config = {
        "train_micro_batch_size_per_gpu": cfg.batch.micro_batch,
        "gradient_accumulation_steps": cfg.batch.grad_accum,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        # DeepSpeed's throughput timer is on and synchronized by default: from the engine's third step it
        # calls accelerator.synchronize() in engine.forward and engine.step (deepspeed/utils/timer.py
        # ThroughputTimer), two device syncs per micro-step inside the timed region that no other stack
        # has. The harness times every stack itself, so the engine's own timer is off.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if native_low_precision(cfg):
        config[cfg.model.precision] = {"enabled": True}
        if opts.fp32_reduce:
            config["communication_data_type"] = "fp32"
    elif cfg.model.precision in LOW_PRECISIONS:
        config["torch_autocast"] = {
            "enabled": True,
            "dtype": cfg.model.precision,
            "lower_precision_safe_modules": [],
        }
    if opts.overlap_comm is not None and opts.zero_stage:
        zero["overlap_comm"] = opts.overlap_comm
    if opts.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = (
            False  # keep torch's AdamW: the same optimizer as every backend
        )
    return config


HF_AUTO = (
    "huggingface/transformers src/transformers/integrations/deepspeed.py (HfTrainerDeepSpeedConfig."
    'trainer_config_finalize: ZeRO-3\'s "auto" values) and docs/source/en/deepspeed.md'
)


def stage3_tuning(cfg) -> dict[str, Tuned]:
    """ZeRO-3's settings that follow the model's size. From the hidden size d, Hugging Face's "auto"
    values (comm.hidden_size_rule): reduce_bucket_size d^2, stage3_prefetch_bucket_size 0.9 d^2,
    stage3_param_persistence_threshold 10 d. Against DeepSpeed's defaults at the `1b` shape (d 2048): a
    4.2M-element reduce bucket instead of 5e8 (the gradients reduce-scattered as backward produces them,
    not in two or three buckets), a 3.8M-element prefetch instead of 5e7 (one block's matrix or two ahead),
    and a threshold of 20,480 instead of 1e5 (the LayerNorm tensors and biases persist, every matrix is
    partitioned either way). Where the model has more parameters than DeepSpeed's default
    stage3_max_live_parameters (1e9) or than half its stage3_max_reuse_distance (1e9), each is raised to
    what makes it bind nowhere: DeepSpeed's docs give both as a memory-for-communication trade ("smaller
    values use less memory, but perform more communication"), and Hugging Face's as the limits to lower
    when memory runs out. max_live_parameters, the model's parameter count: the coordinator prefetches
    min(max_live - gathered, bucket), so below the model's size it stops prefetching once the kept blocks
    fill it and the last blocks are fetched on demand. max_reuse_distance, twice the count: between a
    block's forward and its backward the engine fetches every later block twice, so at 1e9 the `1b`
    shape's first 14 blocks are gathered again for backward (comm.regathered_blocks; 704M elements a
    micro-batch). The price is memory: every partitioned parameter stays gathered from its forward to its
    backward, the module's dtype times the parameter count (2.6 GB in bf16 at `1b`)."""
    d, n = cfg.model.spec.d_model, cfg.model.spec.n_params
    rule = hidden_size_rule(d)
    tuned = {
        "reduce_bucket": Tuned(
            rule["reduce_bucket"], f"{HF_AUTO}: reduce_bucket_size = hidden_size^2 = {d}^2"
        ),
        "prefetch_bucket": Tuned(
            rule["prefetch_bucket"],
            f"{HF_AUTO}: stage3_prefetch_bucket_size = 0.9 * hidden_size^2 = 0.9 * {d}^2",
        ),
        "persistence_threshold": Tuned(
            rule["persistence_threshold"],
            f"{HF_AUTO}: stage3_param_persistence_threshold = 10 * hidden_size = 10 * {d}",
        ),
    }
    trade = (
        f"{DS_DOCS} (a memory-for-communication trade: smaller values use less memory, more communication)"
    )
    if n > MAX_LIVE_PARAMETERS:
        tuned["max_live_parameters"] = Tuned(
            n, f"{trade}; the model's {n:,} parameters, so that no prefetch waits on the cap"
        )
    if 2 * n > MAX_REUSE_DISTANCE:
        tuned["max_reuse_distance"] = Tuned(
            2 * n,
            f"{trade}; twice the model's {n:,} parameters (the later blocks are fetched twice between a "
            "block's forward and its backward), so that no block is gathered again for backward",
        )
    return tuned


def bf16_tuning() -> dict[str, Tuned]:
    """bf16 as FSDP2 runs it (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)): DeepSpeed's bf16
    section, a bf16 module whose fp32 master weights and AdamW state live in the ZeRO optimizer, with
    "communication_data_type": "fp32". ZeRO-3 then gathers each parameter in its partition's dtype, bf16
    (partition_parameters.py get_allgather_dtype: the ds_tensor's dtype when torch_autocast is off), half
    the bytes of the default's fp32 gathers, and casts every gradient to fp32 before the reduce-scatter
    (stage3.py __avg_scatter_grads), so the gradients are summed in fp32 as the suite's definition asks
    (core.precision). torch_autocast cannot do it: one per-parameter attribute (comm_dtype, set for the
    classes in lower_precision_safe_modules) gives both the gather dtype and the reduce dtype
    (torch_autocast.py init_autocast_params; stage3.py get_param_comm_dtype), so gathering a Linear's
    weight in bf16 also reduces its gradient in bf16. numerics: the module's LayerNorm and residual stream
    run in bf16 (as FSDP2's), where the default's autocast keeps them fp32; and the fp32 master weights
    start from the bf16 module, the initial weights rounded to bf16 once (stage3.py
    _create_fp32_partitions converts the 16-bit partition), where FSDP2 keeps the fp32 ones. On
    tests/test_equivalence.py's RECORD_SHAPE (2 ranks, 10 steps, an AMD EPYC with AVX-512 BF16) the losses
    are 7.8e-4 off torch-ddp's in bf16, FSDP2's 9.8e-5 (reducing in bf16 instead: 6.7e-4, that file's
    figure; accumulating the reduced gradients in fp32 too, data_types.grad_accum_dtype, changes nothing:
    7.8e-4), within the bf16 bound every stack whose forward runs in bf16 is held to (BF16_LOSS_ATOL,
    1e-3)."""
    source = (
        "deepspeed.ai/docs/config-json (bf16: enabled; communication_data_type: fp32); deepspeed/runtime/"
        "engine.py communication_data_type(); zero/stage3.py __avg_scatter_grads (gradients cast to it)"
    )
    return {
        "mixed_precision": Tuned("native", source, numerics=True),
        "fp32_reduce": Tuned(True, source, numerics=True),
    }
