"""What every backend shares: the adapter interface (harness side) and the timed training loop (worker side).

Nothing here imports a deep-learning framework, so the harness can load adapters, and each worker imports
only its own framework inside its backend's worker module.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import resource
import signal
import socket
import sys
import time
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from harness.config import RunConfig
from workloads.data import Shard, make_source, micro_batches

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_SCRIPT = REPO_ROOT / "backends" / "worker.py"

# Environment variables through which the launchers tell a process its rank, in the order we trust them.
RANK_VARS = ("DISTBENCH_RANK", "RANK", "HOROVOD_RANK", "PADDLE_TRAINER_ID", "OMPI_COMM_WORLD_RANK")


# ----------------------------------------------------------------------------------------------- harness side
@dataclass
class Process:
    """One command the harness starts (a launcher, or a worker where the framework has no launcher)."""
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CommPattern:
    """How gradients/parameters cross the network each step, for the analytic volume in harness.metrics.

    kind "allreduce": 2(N-1)/N x gradient bytes; "sharded": 3(N-1)/N x parameter bytes (two all-gathers
    of parameters and one reduce-scatter of gradients). `dtype_bytes` is the communicated element size.
    A sharded wrapper may reduce gradients in a wider dtype than it gathers parameters in
    (`reduce_dtype_bytes`, 0 = the same), or keep parameters gathered from forward to backward
    (`param_gathers` 1 instead of 2).
    """
    kind: str
    dtype_bytes: int
    reduce_dtype_bytes: int = 0
    param_gathers: int = 2


class Backend(ABC):
    """An adapter: how one distributed-training stack is launched and what it does to the model state."""
    name: str = ""
    framework: str = ""                       # "torch" | "tensorflow" | "paddle"
    launcher: str = ""                        # human-readable, for `harness list` and reports
    requires: tuple[str, ...] = ()            # importable modules needed (checked without importing)
    worker_module: str = ""                   # defines `make_trainer(cfg) -> Trainer`
    compute_methods: tuple[str, ...] = ("isolated",)   # first = default for compute_method "auto"
    multi_node: bool = True
    mixed_precision: str = "autocast"         # how bf16/fp16 is implemented: "autocast" | "master"

    def availability(self) -> tuple[bool, str]:
        """(usable here, reason if not), decided without importing the framework."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        return (False, f"not installed: {', '.join(missing)}") if missing else (True, "")

    def add_arguments(self, parser) -> None:
        """Backend-specific CLI options (all default to None so other backends can ignore them)."""

    def options(self, args) -> dict:
        """The backend options from parsed CLI args, stored in RunConfig.backend_options."""
        return {}

    def label(self, cfg: RunConfig) -> str:
        """Name shown in tables: distinguishes variants such as ZeRO stages."""
        return self.name

    def sharding(self, cfg: RunConfig) -> str:
        """What this configuration shards across ranks: none | optimizer | gradients | parameters."""
        return "none"

    def comm_pattern(self, cfg: RunConfig) -> CommPattern:
        return CommPattern("allreduce", 4)

    def precision_scheme(self, cfg: RunConfig) -> str:
        return self.mixed_precision

    def compute_methods_for(self, options: dict) -> tuple[str, ...]:
        """The compute-only methods a configuration supports, preferred first. An option can rule one
        out: a sharded optimizer that synchronises inside its step has no sync-off switch (no_sync)."""
        return self.compute_methods

    def features(self) -> dict:
        """What this adapter supports, for the report's feature table. `sharding` lists the sharding of
        every configuration it offers; the default asks sharding() about a 2-rank run with default
        options, so an adapter whose options change the sharding (ZeRO stages) overrides this."""
        import argparse
        from workloads.spec import PRESETS
        parser = argparse.ArgumentParser()
        self.add_arguments(parser)
        probe = RunConfig(backend=self.name, workload="tiny", spec=PRESETS["tiny"], gpus=2, device="cpu",
                          backend_options=self.options(parser.parse_args([])))
        return {"framework": self.framework, "launcher": self.launcher, "multi_node": self.multi_node,
                "mixed_precision": self.mixed_precision, "compute_methods": list(self.compute_methods),
                "sharding": [self.sharding(probe)]}

    @abstractmethod
    def launch(self, cfg: RunConfig, run_dir: Path, port: int) -> list[Process]:
        """The command(s) that start THIS node's cfg.procs_per_node workers with the framework's own
        launcher (cfg.nodes / node_rank / master_addr for multi-node; `port` is the master's port). An
        isolated-counterfactual config (cfg.isolated_index set) is always a single local process."""

    def worker_env(self, cfg: RunConfig) -> dict[str, str]:
        """Environment every worker process gets: import path, unbuffered output, and the process
        settings every backend shares (see process_settings)."""
        return {"PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "PYTHONUNBUFFERED": "1", **process_settings(cfg.threads_per_worker)}


# glibc malloc's defaults hand large freed blocks back to the kernel and fault them in again on the next
# step. On CPU that is thousands of page faults per step, their count set by incidental allocation order:
# measured 3,000-7,000 minor faults per tiny torch-ddp step and +-5% step time between identical launches,
# 0-600 per step with these values. So every backend's workers keep freed memory (the same advice as
# PyTorch's CPU tuning guide, which preloads jemalloc/tcmalloc for it); a value already set in the
# environment wins, and the run record says which were used.
ALLOCATOR_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def process_settings(threads_per_worker: int) -> dict[str, str]:
    """The environment that fixes how a worker process runs, the same for every backend: its thread count
    (set before the framework starts) and the C allocator's settings. Each rank records what reached it."""
    allocator = {k: os.environ.get(k, v) for k, v in ALLOCATOR_SETTINGS.items()}
    return {**{k: str(threads_per_worker) for k in THREAD_SETTINGS}, **allocator}


def seen_process_settings() -> dict[str, str | None]:
    """The process settings as this worker got them through its framework's launcher."""
    return {k: os.environ.get(k) for k in (*THREAD_SETTINGS, *ALLOCATOR_SETTINGS)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ worker side
class Trainer(ABC):
    """One rank's model, optimizer and step, in one framework. The shared loop below times it."""
    framework = ""
    compute_only = False   # True if step(sync_grads=False) really skips gradient synchronisation

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank = rank_from_env()
        self.world_size = cfg.world_size
        self.device_name = "cpu"

    @abstractmethod
    def step(self, batches: list, sync_grads: bool = True) -> float:
        """One optimizer step over this rank's micro-batches (numpy int64 inputs/targets); returns the mean
        micro-batch loss as a float (which waits for the step's work to finish)."""

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on CPU, where ops run synchronously)."""

    @abstractmethod
    def memory(self) -> dict:
        """Framework allocator peaks in bytes (empty on CPU); peak RSS is added by the loop."""

    @abstractmethod
    def model_state_bytes(self) -> dict:
        """Bytes of params, grads and optimizer state this rank actually holds, counted from its tensors:
        {"params": .., "grads": .., "optimizer": ..}; the loop adds the total."""

    def final_weights(self) -> dict:
        """Full (unsharded) final weights as numpy arrays by neutral name, for equivalence tests."""
        raise NotImplementedError(f"{type(self).__name__} cannot dump weights")

    @abstractmethod
    def versions(self) -> dict:
        """Framework and library versions."""

    def close(self) -> None:
        """Tear down process groups so the launcher sees a clean exit."""


def rank_from_env() -> int:
    for var in RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


FAULT_KINDS = ("raise", "exit", "sigkill", "hang", "oom")


def inject_fault(cfg: RunConfig, rank: int, step: int) -> None:
    """Test-only: make one rank fail in a chosen way at a chosen step, so failure handling is testable."""
    fault = cfg.fault
    if not fault or fault["rank"] != rank or fault["step"] != step:
        return
    kind = fault["kind"]
    print(f"injecting fault '{kind}' at step {step} (unix time {time.time():.3f})", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    if kind == "exit":
        os._exit(3)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        time.sleep(1e9)
    if kind == "oom":  # cap the address space, then allocate past it: a real MemoryError from the allocator
        used = psutil.Process().memory_info().vms
        resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
        hog = [bytearray(64 << 20) for _ in range(1 << 12)]
        raise AssertionError(f"allocated {len(hog)} blocks without running out of memory")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def minor_page_faults() -> int:
    """Page faults of this process served without I/O so far. Re-faulting memory the allocator gave back
    costs step time on CPU, so the loop records them per measured step."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_name() -> str:
    """The CPU model, so CPU records from different machines are not mistaken for each other."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def data_shard(cfg: RunConfig, rank: int) -> Shard:
    """The data a rank reads; an isolated-counterfactual worker reads the shard of the rank it stands for."""
    if cfg.isolated_index is not None:
        return Shard(cfg.isolated_index, cfg.gpus, cfg.micro_batch, cfg.grad_accum)
    return Shard(rank, cfg.gpus, cfg.micro_batch, cfg.grad_accum)


def run_training(trainer: Trainer, cfg: RunConfig, weights_path: Path | None = None) -> dict:
    """The timing rules every backend shares; returns the raw rank record.

    A step is timed from a device-synchronised boundary to the next: fetching this rank's micro-batches
    (recorded separately as data wait), the framework's step, and the loss read-back. Warm-up steps are
    run and dropped. Then, if the trainer can switch gradient sync off, `compute_steps` more steps run with
    sync off (after the measured ones, since they let replicas drift); the first of those is dropped too,
    as the switch can itself trigger one-off work. `weights_path`: where to save the final weights of the
    measured steps (before the sync-off steps move them).
    """
    source = make_source(cfg.spec.vocab_size, cfg.spec.seq_len, cfg.global_batch, cfg.seed, cfg.data_path)
    shard = data_shard(cfg, trainer.rank)

    def timed_step(step: int, sync_grads: bool) -> tuple[float, float, float]:
        trainer.synchronize()
        t0 = time.perf_counter()
        batches = micro_batches(source, shard, step)
        t_data = time.perf_counter() - t0
        loss = trainer.step(batches, sync_grads=sync_grads)
        if cfg.step_delay_s:
            time.sleep(cfg.step_delay_s)
        trainer.synchronize()
        return time.perf_counter() - t0, t_data, loss

    step_times, data_wait, losses, warmup_losses = [], [], [], []
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            faults_at_start = minor_page_faults()
        inject_fault(cfg, trainer.rank, step)
        t, t_data, loss = timed_step(step, True)
        if step < cfg.warmup:
            warmup_losses.append(loss)
        else:
            step_times.append(t); data_wait.append(t_data); losses.append(loss)
        if trainer.rank == 0:
            print(f"step {step:4d} loss {loss:.4f} time {t * 1e3:8.1f} ms"
                  f"{' (warm-up)' if step < cfg.warmup else ''}", flush=True)
    minor_faults_per_step = (minor_page_faults() - faults_at_start) / cfg.steps
    model_state = trainer.model_state_bytes()  # after a full step, so gradients and moments exist
    model_state["total"] = sum(model_state.values())
    weights = trainer.final_weights() if weights_path else None  # collective for sharded models: all ranks
    if weights is not None and trainer.rank == 0:
        np.savez(weights_path, **weights)

    compute_times = []
    if trainer.compute_only and cfg.compute_method == "no_sync" and cfg.world_size > 1 and cfg.compute_steps:
        first = cfg.warmup + cfg.steps
        for step in range(first, first + cfg.compute_steps + 1):
            t, _, _ = timed_step(step, False)
            if step > first:
                compute_times.append(t)

    memory = {"peak_rss": peak_rss_bytes(), **trainer.memory()}
    return {
        "rank": trainer.rank, "host": socket.gethostname(), "device": trainer.device_name, "pid": os.getpid(),
        "status": "ok", "step_times": step_times, "data_wait": data_wait, "losses": losses,
        "warmup_losses": warmup_losses, "compute_only_step_times": compute_times,
        "memory": memory, "model_state_bytes": model_state, "minor_faults_per_step": minor_faults_per_step,
        "versions": {"python": platform.python_version(), **trainer.versions()},
        "threads": cfg.threads_per_worker, "process_settings": seen_process_settings(),
    }


class Terminated(BaseException):
    """SIGTERM reached this rank: a launcher tearing its workers down after another rank failed, or the
    harness at a timeout. Recorded as such, so a rank stopped from outside is never taken for the cause."""


def record_termination() -> None:
    """Turn SIGTERM into Terminated, so the rank still writes its record (where it was, and that it was
    stopped) instead of vanishing. Only the first: a second SIGTERM (launcher and harness both send one)
    must not interrupt the writing of that record; SIGKILL still ends a rank that does not finish."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated("stopped by SIGTERM (from its launcher or the harness)")
    signal.signal(signal.SIGTERM, handler)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, so a harness or launcher killed with
    SIGKILL leaves no launcher or worker running on (a no-op where prctl is unavailable)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def failure_record(exc: BaseException) -> dict:
    """The rank record of a rank that raised: 'oom' for out-of-memory errors, else 'failed';
    `terminated` marks a rank stopped from outside (see Terminated)."""
    name = type(exc).__name__
    oom = isinstance(exc, MemoryError) or "OutOfMemory" in name or "out of memory" in str(exc).lower()
    return {"rank": rank_from_env(), "host": socket.gethostname(), "pid": os.getpid(),
            "status": "oom" if oom else "failed", "error": f"{name}: {exc}", "failed_at": time.time(),
            "terminated": isinstance(exc, Terminated),
            "traceback": "".join(traceback.format_exception(exc))[-4000:],
            "memory": {"peak_rss": peak_rss_bytes()}}



def torchrun(backend: Backend, cfg: RunConfig, run_dir: Path, port: int) -> Process:
    """torchrun (torch.distributed.run) for this node: one worker per device, static rendezvous at the
    master on `port` (an isolated-counterfactual worker is a 1-node, 1-process run on localhost)."""
    nodes, node_rank, master = (1, 0, "127.0.0.1") if cfg.isolated_index is not None else \
        (cfg.nodes, cfg.node_rank, cfg.master_addr)
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.procs_per_node}",
            f"--nnodes={nodes}", f"--node-rank={node_rank}", f"--master-addr={master}",
            f"--master-port={port}", "--max-restarts=0", str(WORKER_SCRIPT), str(run_dir)]
    return Process(argv, backend.worker_env(cfg))
