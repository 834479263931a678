"""horovod adapter: horovod.torch's DistributedOptimizer, launched by `horovodrun --gloo`.

The gloo controller coordinates the ranks (horovodrun's own rendezvous server, on a port it picks); the
collectives run on gloo on CPU and on NCCL where Horovod was built with it. Only horovod.torch is used:
Horovod's TensorFlow binding does not work with Keras 3.

Horovod is built from source by scripts/install_horovod.sh; when that fails, setup.sh leaves the reason in
<venv>/distbench/horovod-unavailable, and the backend reports it instead of failing at launch.
"""

import math
import sys
from pathlib import Path

from backends.base import (
    WORKER_SCRIPT,
    Backend,
    LaunchPlan,
    device_mask,
    worker_python,
)
from backends.horovod_torch.options import HorovodOptions
from backends.horovod_torch.schedule import horovod_schedule
from backends.schedule import MiB
from backends.torch_tuning import TORCHTITAN, torch_tuned
from core.precision import autocast_numerics
from core.process import Process


def local_rank(environ) -> str:
    """The local rank horovodrun gave this worker (HOROVOD_LOCAL_RANK), which picks its GPU (cuda:<local
    rank> inside the mask). It wins over a LOCAL_RANK inherited from the harness's own environment (a
    torchrun, Slurm or Kubernetes parent), which horovodrun passes on to every worker unchanged and which
    would put every rank of this node on that one GPU."""
    return environ.get("HOROVOD_LOCAL_RANK", "0")


# horovodrun's own waits (Horovod.timeouts): its gloo context, for the rendezvous and every collective (30 s
# by default), and its start-up checks and the workers' registration with its driver (30 s by default)
HOROVOD_GLOO_TIMEOUT = "horovodrun --gloo-timeout-seconds"
HOROVOD_START_TIMEOUT = "horovodrun --start-timeout"


class Horovod(Backend[HorovodOptions]):
    """t_compute: Horovod has no switch that turns the all-reduce off (its gradient hooks submit every
    all-reduce during backward; skip_synchronize() only skips waiting for them), so the isolated
    counterfactual. Node 0's horovodrun starts every node's workers."""

    name, framework, launcher, also_requires = "horovod", "torch", "horovodrun", ("horovod",)
    extra = "horovod"  # then scripts/install_horovod.sh builds Horovod itself
    collective_api = "horovod.torch"
    compute_methods = ("isolated",)
    starts_remote_ranks = True
    # HOROVOD_TIMELINE, read once at hvd.init, starts the coordinator's timeline writer thread, which loops
    # on std::this_thread::yield() whether or not a timeline is being recorded (horovod/common/timeline.cc,
    # TimelineWriter::WriterLoop): a core kept busy for the whole job, measured steps included.
    traces_in_own_launch = True
    kubeflow_job = "MPIJob"  # its launcher pod's horovodrun starts the worker pods' ranks over ssh
    peer_lost_texts = ("horovod has been shut down",)
    Options = HorovodOptions

    def available_in(self, where):
        """Installed with its PyTorch extension and horovodrun, in the interpreter `where` describes, and
        not marked as a failed build by setup.sh in that interpreter's environment."""
        ok, reason = super().available_in(where)
        if not ok:
            return ok, reason
        marker = Path(where.prefix) / "distbench" / "horovod-unavailable"
        if marker.exists():
            lines = marker.read_text(errors="replace").strip().splitlines()
            return False, "build failed: " + (
                lines[-1] if lines else "see the install log next to " + str(marker)
            )
        package = Path(where.modules["horovod"]).parent
        if not list((package / "torch").glob("mpi_lib_v2*.so")):
            return False, f"horovod is installed without its PyTorch extension ({package / 'torch'})"
        if not self.horovodrun(where.executable).exists():
            return False, f"{self.horovodrun(where.executable)} not found"
        return True, ""

    @staticmethod
    def horovodrun(python: str | None = None) -> Path:
        """horovodrun beside the workers' interpreter (None: the harness's)."""
        return Path(python or sys.executable).parent / "horovodrun"

    def stack_label(self, cfg):
        return self.name + ("-fp16comp" if self.options(cfg).compression == "fp16" else "")

    def tuned(self, cfg):
        """The torch family's compile (each block, as torch-ddp's) and fused AdamW. DistributedOptimizer
        submits a gradient from a hook on its accumulator, which fires only when the compiled region that
        computes it ends: compiled whole, the model's backward is one region and every gradient was
        submitted after it (traced at 2 ranks on CPU: one or two fused all-reduces a step, at the end, for
        the default's twelve spread over backward); per block the hooks fire between blocks as
        horovod_schedule prices them. Tensor fusion stays at Horovod's defaults: Horovod's
        docs/tensor-fusion.rst gives no value for a transformer and leaves it to the autotuner
        (`--hvd-autotune`), which is not in the set because it explores with slow steps inside a short
        timed run; fp16 compression changes the numerics and stays a choice by hand (--hvd-compression)."""
        return torch_tuned(f"{TORCHTITAN}: each TransformerBlock compiled before Horovod's gradient hooks")

    def schedule(self, cfg):
        """Gradients are fp32 (autocast keeps fp32 parameters), unless compressed to fp16 for the wire;
        fused and all-reduced during backward: schedule.py."""
        return horovod_schedule(cfg, 2 if self.options(cfg).compression == "fp16" else 4)

    def numerics(self, cfg):
        """torch.autocast as DDP; --hvd-compression fp16 casts the fp32 gradients to fp16 for the
        all-reduce (Horovod's Compression.fp16), which the definition does not do."""
        if self.options(cfg).compression == "fp16":
            return autocast_numerics(cfg, grad_reduce="fp16", why={"grad_reduce": "--hvd-compression fp16"})
        return autocast_numerics(cfg)

    def worker_env(self, cfg):
        """Tensor fusion as the options set it (stated, not inherited, so the record and the schedule say
        what ran). HOROVOD_TIMELINE=DYNAMIC lets the worker start and stop Horovod's timeline around the
        traced steps (hvd.start_timeline refuses otherwise), and only in the launch that traces
        (traces_in_own_launch)."""
        env = super().worker_env(cfg)
        opts = self.options(cfg)
        env["HOROVOD_FUSION_THRESHOLD"] = str(opts.fusion_threshold_mb * MiB)
        env["HOROVOD_CYCLE_TIME"] = str(opts.cycle_time_ms)
        if opts.autotune:
            env["HOROVOD_AUTOTUNE"] = "1"
        if cfg.measurement.trace_comm and cfg.role.trace_launch == "only":
            env["HOROVOD_TIMELINE"] = "DYNAMIC"
        return env

    def timeouts(self, cfg):
        """horovodrun's gloo timeout (HOROVOD_GLOO_TIMEOUT_SECONDS in the workers: the rendezvous with its
        server and every gloo collective) and its start timeout (the hosts' checks and the task services'
        registration with the driver, before any worker starts), both 30 s by default: on a busy node or
        many hosts a start or a slow peer would end the run well inside its own timeout."""
        return {HOROVOD_GLOO_TIMEOUT: cfg.collective_timeout, HOROVOD_START_TIMEOUT: cfg.collective_timeout}

    def launch(self, cfg, run_dir, port, devices):
        """horovodrun is Horovod's multi-node launcher too: on node 0 it starts every node's workers
        (`-H h1:G,h2:G`; over ssh for remote hosts, directly for this machine's own addresses), so the
        other nodes' harnesses start nothing and only wait. `port` is unused: horovodrun's rendezvous
        server binds a free port itself. Devices: horovodrun passes its environment to every worker, and
        local rank i takes cuda:i inside the mask (every node is given the same physical ids). With
        `launcher_only` (an MPIJob's launcher pod) every rank is on the hosts, even on one node."""
        multi = (cfg.topology.nodes > 1 or cfg.topology.launcher_only) and cfg.role.isolated_index is None
        if multi and cfg.topology.node_rank != 0:
            return LaunchPlan([])
        n = cfg.local_procs
        timeouts = self.timeouts(cfg)
        hosts = ",".join(f"{h}:{n}" for h in cfg.topology.hosts) if multi else f"localhost:{n}"
        argv = [
            str(self.horovodrun(worker_python(cfg))),
            "-np",
            str(n * (cfg.topology.nodes if multi else 1)),
            "-H",
            hosts,
            "--start-timeout",
            str(math.ceil(timeouts[HOROVOD_START_TIMEOUT])),
            "--gloo",
            "--gloo-timeout-seconds",
            str(math.ceil(timeouts[HOROVOD_GLOO_TIMEOUT])),
            worker_python(cfg),
            str(WORKER_SCRIPT),
            str(run_dir),
        ]
        return LaunchPlan([Process(argv, {**self.worker_env(cfg), **device_mask(devices)})])
