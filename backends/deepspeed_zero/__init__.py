"""deepspeed adapter: a DeepSpeed engine with ZeRO stage 0-3, launched by DeepSpeed's own launcher.

Launcher: the `deepspeed` CLI (`python -m deepspeed.launcher.runner`), the way DeepSpeed documents
launching, rather than torchrun: it starts deepspeed.launcher.launch, which starts one worker per device.
For several nodes the harness starts each node's launcher itself, so it passes --no_ssh and --node_rank
with a hostfile in the run directory instead of letting the runner reach the others over pdsh.

Devices: the runner drops CUDA_VISIBLE_DEVICES as soon as --include/--num_gpus or a hostfile is given and
sets the workers' mask from the slots it selects, which are physical ids. So on GPU the physical ids go in
`--include=host:ids` (a hostfile's slots then must reach the highest id); on CPU, --num_gpus or the
hostfile's slots give the number of workers.

The engine's configuration is built in ds_config.py (`ds_config`), from the RunConfig alone, so the same
run always gets the same configuration. This package is not called `deepspeed` because the worker script's
directory (backends/) is on sys.path, where that name would shadow the real library.
"""

import os
import re
import shlex
import time
from pathlib import Path

from backends import interpreter
from backends.base import (
    TORCH_DISTRIBUTED_PEER_LOST,
    WORKER_SCRIPT,
    Backend,
    Check,
    LaunchPlan,
    Tuned,
    parameter_numels,
    worker_python,
)
from backends.deepspeed_zero.comm import Stage3, partitioned
from backends.deepspeed_zero.ds_config import (
    DS_DOCS,
    STAGES,
    DeepSpeedOptions,
    bf16_tuning,
    ds_config,
    fp32_reduced_module,
    module_precision,
    native_low_precision,
    stage3_tuning,
)
from backends.deepspeed_zero.schedule import zero_schedule
from core.config import InvalidConfig
from core.precision import autocast_numerics, low_precision_module_numerics
from core.process import Process

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


SHARDING = {0: "none", 1: "optimizer", 2: "gradients", 3: "parameters"}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
