"""deepspeed adapter: a DeepSpeed engine with ZeRO stage 0-3, launched by DeepSpeed's own launcher.

Launcher: the `deepspeed` CLI (`python -m deepspeed.launcher.runner`), the way DeepSpeed documents
launching, rather than torchrun: it starts deepspeed.launcher.launch, which starts one worker per device.
For several nodes the harness starts each node's launcher itself, so it passes --no_ssh and --node_rank
with a hostfile in the run directory instead of letting the runner reach the others over pdsh.

Devices: the runner drops CUDA_VISIBLE_DEVICES as soon as --include/--num_gpus or a hostfile is given and
sets the workers' mask from the slots it selects, which are physical ids. So on GPU the physical ids go in
`--include=host:ids` (a hostfile's slots then must reach the highest id); on CPU, --num_gpus or the
hostfile's slots give the number of workers.

The engine's configuration is built here (`ds_config`), from the RunConfig alone, so the same run always
gets the same configuration. This package is not called `deepspeed` because the worker script's directory
(backends/) is on sys.path, where that name would shadow the real library.
"""

import argparse
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from backends import interpreter
from backends.base import (
    TORCH_DISTRIBUTED_PEER_LOST,
    WORKER_SCRIPT,
    Backend,
    Check,
    LaunchPlan,
    Options,
    Tuned,
    option,
    parameter_numels,
    switch,
    worker_python,
)
from backends.deepspeed_zero.comm import (
    MAX_LIVE_PARAMETERS,
    MAX_REUSE_DISTANCE,
    PERSISTENCE_THRESHOLD,
    PREFETCH_BUCKET_ELEMENTS,
    REDUCE_BUCKET_ELEMENTS,
    Stage3,
    hidden_size_rule,
    partitioned,
)
from backends.deepspeed_zero.schedule import zero_schedule
from core.config import InvalidConfig
from core.precision import LOW_PRECISIONS, autocast_numerics, low_precision_module_numerics
from core.process import Process

STAGES = (0, 1, 2, 3)
EXTENSIONS_SUBDIR = Path("distbench") / "torch_extensions"  # setup.sh builds DeepSpeed's CPU op there


def shm_segments(port: int) -> str:
    """The shared-memory buffers (tens of MB per rank) of DeepSpeed's CPU all-reduce op for the run whose
    master port is `port`: `deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`, created by
    each rank when its process group starts and never unlinked, so every run would leave them in RAM."""
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"


def extensions_dir(python: str | None = None) -> Path | None:
    """Where DeepSpeed's JIT-built ops live: the user's TORCH_EXTENSIONS_DIR if set, else a folder inside
    the virtual environment of the workers' interpreter `python` (None: the harness's; None outside a
    venv: torch's default). Per environment, because torch keys the
    build on the folder alone: environments sharing ~/.cache rebuild each other's op on every switch, and a
    build killed there leaves a `lock` file on which every later run waits for ever."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    prefix = interpreter.venv_prefix(python)
    return prefix / EXTENSIONS_SUBDIR if prefix else None


def jit_arch_list(archs: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT op builder can read it. torch takes arch-specific entries
    such as "9.0a" or "10.0a" (CUDA's sm_90a), but DeepSpeed's builder sorts the entries by int() of each
    part (op_builder/builder.py, compute_capability_args) and raises on the letter, so a run that builds an
    op (a tuned run's FusedAdam) dies before its first step. The letter is dropped: the ops DeepSpeed
    builds for these runs use no arch-specific instruction, and "+PTX" is kept."""
    entries = [entry for entry in re.split(r"[;\s]+", archs) if entry]
    return ";".join(re.sub(r"^(\d+\.\d+)[A-Za-z]+", r"\1", entry) for entry in entries)


STALE_LOCK_S = 15 * 60  # no JIT build of one op takes this long here; a lock this old is a killed build's


def extensions_lock_check(root: Path | None, required: bool, now: float) -> Check:
    """torch's JIT build guards each op's folder with a `lock` file and waits, with no limit, while one is
    there; a build that was killed leaves it, and every DeepSpeed run then hangs until its timeout."""
    root = root or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_extensions"
    stale = sorted(
        lock for lock in root.glob("**/lock") if lock.is_file() and now - lock.stat().st_mtime > STALE_LOCK_S
    )
    got = f"{len(stale)} stale, remove with: rm {shlex.join(map(str, stale))}" if stale else "none"
    return Check(
        "DeepSpeed op build locks",
        f"find {root} -name lock",
        f"no lock older than {STALE_LOCK_S // 60} min (a killed build's)",
        got,
        "ok" if not stale else ("FAIL" if required else "warn"),
    )


def element_count(text: str) -> int:
    """A count of elements as DeepSpeed's docs write one: 5e7 or 50000000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count of elements such as 5e7, got '{text}'") from None
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole count of elements, at least 1, got '{text}'")
    return int(value)


SHARDING = {0: "none", 1: "optimizer", 2: "gradients", 3: "parameters"}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
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


DS_INIT_DISTRIBUTED = "deepspeed.init_distributed(timeout)"
DS_WORLD_GROUP = "ZeRO's world group: torch.distributed.new_group(timeout)"


class DeepSpeed(Backend[DeepSpeedOptions]):
    """t_compute: engine.no_sync() refuses stages 2 and 3, and at stage 1 the step needs the reduced gradient
    partitions and all-gathers the updated ones; so, for every stage alike, the isolated counterfactual.
    Mixed precision: torch autocast over fp32 parameters (ds_config), or DeepSpeed's native bf16/fp16
    module with fp32 master weights (--ds-mixed-precision native)."""

    name, framework, launcher, also_requires = "deepspeed", "torch", "deepspeed", ("deepspeed",)
    extra = "deepspeed"
    collective_api = "deepspeed.comm"
    compute_methods = ("isolated",)
    kubeflow_job = "PyTorchJob"  # its launcher takes the master and node rank as torchrun's does
    trace_reader = "backends.torch_trace"
    peer_lost_texts = TORCH_DISTRIBUTED_PEER_LOST
    Options = DeepSpeedOptions

    def stage(self, cfg) -> int:
        return self.options(cfg).zero_stage

    def doctor_checks(self, python, required):
        """No stale lock of a killed JIT build of DeepSpeed's ops in the workers' environment."""
        return [extensions_lock_check(extensions_dir(python), required, time.time())]

    def tuned(self, cfg):
        """DeepSpeed's own AdamW (FusedAdam on a GPU, the one its engine builds from an "optimizer"
        section; DeepSpeedCPUAdam on a CPU, its ZeRO-Offload kernel) and overlap_comm on at every ZeRO
        stage, as the ZeRO-2 and ZeRO-3 examples of DeepSpeed's and Hugging Face's docs set it. At ZeRO-3,
        the settings that follow the model's size (stage3_tuning), and in bf16 the module in bf16 with
        gradients reduced in fp32 (bf16_tuning)."""
        optimizer = "FusedAdam" if cfg.topology.device == "cuda" else "DeepSpeedCPUAdam"
        tuned = {
            "optimizer": Tuned(
                "deepspeed",
                f"deepspeed/runtime/engine.py _configure_basic_optimizer ({optimizer}); deepspeed.ai/"
                "tutorials/zero-offload (DeepSpeedCPUAdam)",
                numerics=True,
            ),
            "overlap_comm": Tuned(
                True,
                f"{DS_DOCS}; huggingface/transformers docs/source/en/deepspeed.md (ZeRO-2 and ZeRO-3 "
                "examples: overlap_comm true)",
            ),
        }
        if self.stage(cfg) == 3:
            tuned.update(stage3_tuning(cfg))
        if cfg.model.precision == "bf16":
            tuned.update(bf16_tuning())
        return tuned

    def stack_label(self, cfg):
        return (
            f"deepspeed-zero{self.stage(cfg)}"
            + ("-offload" if self.options(cfg).offload_optimizer else "")
            + ("-native" if native_low_precision(cfg) else "")
            + ("-fp32reduce" if fp32_reduced_module(cfg) else "")
        )

    def precision_scheme(self, cfg):
        """Native bf16/fp16: a low-precision module and the optimizer's fp32 master. Otherwise the module
        stays fp32, and ZeRO's optimizer (stages 1-3) still keeps its own fp32 copy of its partition
        (stage 1/2's single_partition_of_fp32_groups, stage 3's fp32_partitioned_groups_flat), measured
        in tests/test_torch_family.py; stage 0 steps the torch optimizer over the module's parameters."""
        if native_low_precision(cfg):
            return "master"
        return "fp32-master" if self.stage(cfg) else "autocast"

    def numerics(self, cfg):
        """Autocast's numerics (ds_config's torch_autocast section); native: the module itself in
        bf16/fp16, every op and the residual stream included, gradients reduced in it (the engine's
        communication_data_type follows the module's dtype) unless --ds-fp32-reduce sets it to fp32, fp32
        master weights in the ZeRO optimizer."""
        if not native_low_precision(cfg):
            return autocast_numerics(cfg, "DeepSpeed torch_autocast section over fp32 parameters")
        low = cfg.model.precision
        if fp32_reduced_module(cfg):
            return autocast_numerics(
                cfg,
                f"DeepSpeed {low} section: {low} module, gradients reduced in fp32 "
                "(communication_data_type), fp32 master weights in the optimizer (initialised from the "
                f"{low} module)",
                forward_params=low,
                activations=low,
            )
        return low_precision_module_numerics(
            cfg,
            f"DeepSpeed {low} section: {low} module, fp32 master weights in the optimizer",
            "--ds-mixed-precision native: DeepSpeed reduces the module's gradients",
        )

    def sharding(self, cfg):
        return SHARDING[self.stage(cfg)]

    def model_state_bytes(self, cfg):
        """The spec's rule plus what ZeRO-3 keeps whole: a tensor of at most
        stage3_param_persistence_threshold elements persists on every rank beside its partition (ds_tensor;
        its gradient and optimizer state stay partitioned), which on a small model is most of the
        parameters and on a large one next to nothing."""
        state = super().model_state_bytes(cfg)
        world = cfg.topology.world_size
        if self.stage(cfg) != 3 or world == 1:
            return state
        numels = parameter_numels(cfg)
        threshold = self.options(cfg).stage3().persistence_threshold
        persistent = sum(numels.values()) - sum(partitioned(numels, threshold).values())
        element = 2 if native_low_precision(cfg) else 4  # the module's dtype: bf16/fp16 native, else fp32
        params = state["params"] + persistent * element
        return {**state, "params": params, "total": state["total"] - state["params"] + params}

    def validate(self, cfg):
        opts = self.options(cfg)
        gathers = "gathers no parameters"
        given = {  # flag: (value, DeepSpeed's key, why it cannot apply below stage 3)
            "--prefetch-bucket": (opts.prefetch_bucket, "stage3_prefetch_bucket_size", "prefetches nothing"),
            "--persistence-threshold": (
                opts.persistence_threshold,
                "stage3_param_persistence_threshold",
                "partitions no parameters",
            ),
            "--max-live-parameters": (opts.max_live_parameters, "stage3_max_live_parameters", gathers),
            "--max-reuse-distance": (opts.max_reuse_distance, "stage3_max_reuse_distance", gathers),
            "--reduce-bucket": (
                opts.reduce_bucket,
                "reduce_bucket_size",
                "runs with DeepSpeed's default buckets here (its schedule prices those)",
            ),
        }
        for flag, (value, key, why) in given.items():
            if value is None:
                continue
            if value < 1:
                raise InvalidConfig(
                    f"{flag} {value}: ZeRO-3's {key} is a count of parameter elements, at least 1 "
                    f"(DeepSpeed's default: {Stage3().config()[key]})"
                )
            if self.stage(cfg) != 3:
                raise InvalidConfig(
                    f"{flag} is ZeRO-3's ({key}); --zero-stage {self.stage(cfg)} {why}: use --zero-stage 3 "
                    "or leave it out"
                )
        if opts.fp32_reduce is False and not native_low_precision(cfg):
            raise InvalidConfig(
                "--ds-fp32-reduce off reduces a native bf16/fp16 module's gradients in its own dtype: it "
                "needs --ds-mixed-precision native and --precision bf16/fp16 (under torch_autocast the "
                "gradients are fp32 and reduced in fp32)"
            )

    def features(self):
        return {
            **super().features(),
            "sharding": [SHARDING[s] for s in STAGES],
            "mixed_precision": "autocast; master (--ds-mixed-precision native)",
        }

    def schedule(self, cfg):
        """Parameters are gathered in the module's dtype (fp32 under autocast, bf16/fp16 for a native
        low-precision module), gradients reduced in the engine's communication dtype (the module's, or fp32
        with --ds-fp32-reduce); the calls per stage: schedule.py, with ZeRO-3's settings as run."""
        gather = ELEMENT_BYTES[module_precision(cfg)]
        reduce = 4 if fp32_reduced_module(cfg) else gather
        opts = self.options(cfg)
        overlap = True if opts.overlap_comm is None else opts.overlap_comm
        return zero_schedule(
            cfg, self.stage(cfg), reduce, module_precision(cfg), overlap, opts.stage3(), gather
        )

    def settings(self, cfg):
        """The engine's configuration, as handed to deepspeed.initialize (gradient_clipping included)."""
        return ds_config(cfg)

    def timeouts(self, cfg):
        """The process group deepspeed.init_distributed makes (torch's: its collectives and its store), and
        the clone of the world group ZeRO's collectives run on, which DeepSpeed makes with dist.new_group()
        and so torch's default (30 min), not init_distributed's: the worker makes that clone itself with
        this one. DeepSpeed's launcher has no rendezvous of its own (it starts the ranks; they meet in
        torch)."""
        return {DS_INIT_DISTRIBUTED: cfg.collective_timeout, DS_WORLD_GROUP: cfg.collective_timeout}

    def worker_env(self, cfg):
        env = super().worker_env(cfg)
        if cfg.topology.device == "cpu":
            env["DS_ACCELERATOR"] = "cpu"
        elif archs := os.environ.get("TORCH_CUDA_ARCH_LIST"):
            env["TORCH_CUDA_ARCH_LIST"] = jit_arch_list(archs)
        if extensions := extensions_dir(worker_python(cfg)):
            env["TORCH_EXTENSIONS_DIR"] = str(extensions)
        return env

    def launch(self, cfg, run_dir, port, devices):
        argv = [
            worker_python(cfg),
            "-u",
            "-m",
            "deepspeed.launcher.runner",
            "--no_local_rank",
            f"--master_port={port}",
        ]
        files = {}
        if cfg.topology.nodes > 1 and cfg.role.isolated_index is None:
            hostfile = run_dir / "hostfile"
            hosts = cfg.topology.hosts or [f"node{i}" for i in range(cfg.topology.nodes)]
            slots = max(map(int, devices)) + 1 if devices else cfg.local_procs
            files[hostfile] = "".join(f"{h} slots={slots}\n" for h in hosts)
            argv += [
                f"--hostfile={hostfile}",
                "--no_ssh",
                f"--node_rank={cfg.topology.node_rank}",
                f"--master_addr={cfg.topology.master_addr}",
            ]
            if devices:  # every node is given the same physical ids
                argv.append("--include=" + "@".join(f"{h}:{','.join(devices)}" for h in hosts))
        elif devices:
            argv.append(f"--include=localhost:{','.join(devices)}")
        else:
            argv.append(f"--num_gpus={cfg.local_procs}")
        return LaunchPlan(
            [Process(argv + [str(WORKER_SCRIPT), str(run_dir)], self.worker_env(cfg))],
            files,
            leftovers=[shm_segments(port)],
        )
