"""The worker side every backend shares: the `Trainer` interface and THE timed training loop.

Runs inside a worker process, which imports its one framework in its backend's worker module; nothing here
imports a framework.
"""

from __future__ import annotations

import os
import platform
import resource
import signal
import socket
import sys
import time
import traceback
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import psutil

from backends import get_backend
from core.config import RunConfig
from core.process import seen_process_settings
from core.records import write_json_atomic
from workloads.data import Shard, make_source, micro_batches

# Environment variables through which the launchers tell a process its rank, in the order we trust them.
RANK_VARS = ("DISTBENCH_RANK", "RANK", "HOROVOD_RANK", "PADDLE_TRAINER_ID", "OMPI_COMM_WORLD_RANK")


class Trainer(ABC):
    """One rank's model, optimizer and step, in one framework. The shared loop below times it."""

    framework = ""
    can_skip_grad_sync = False  # True if step(sync_grads=False) really skips gradient synchronisation

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank = rank_from_env()
        self.world_size = cfg.process_group_size
        self.device_name = "cpu"
        # The rank's index among its node's ranks, where the stack picks its device by it (cuda:<local
        # rank> inside the launcher's mask); recorded, so a rank on the wrong device shows.
        self.local_rank: int | None = None
        self.optimizer_times: list[float] = []  # seconds per optimizer step, in the optimizer-timed steps
        self.time_optimizer = False  # set by run_training for its optimizer-timed steps only

    def timed_optimizer_step(self, optimizer_step) -> None:
        """Run `optimizer_step()`; in the optimizer-timed steps also time it between device
        synchronisations. An isolated-counterfactual worker steps the optimizer over all P parameters where
        a rank of a sharded stack steps P/N, and t_compute discounts the difference
        (harness.analyze.metrics); a 1-rank run's optimizer time calibrates `harness predict`. The
        measured steps are never touched: a synchronisation inside them would change what they overlap."""
        if not self.time_optimizer:
            optimizer_step()
            return
        self.synchronize()
        t0 = time.perf_counter()
        optimizer_step()
        self.synchronize()
        self.optimizer_times.append(time.perf_counter() - t0)

    def reset_peak_memory(self) -> None:
        """Reset the framework allocator's peak counters: called after warm-up, so peaks exclude model
        construction (the full model before sharding) and one-off warm-up work."""

    def math_mode(self) -> dict:
        """How this worker runs fp32 matmuls: {"tf32": True/False} where the framework can say (None: not
        applicable, e.g. on CPU). TF32 raises the device's fp32 peak, so MFU must know."""
        return {"tf32": None}

    @abstractmethod
    def step(self, batches: list, sync_grads: bool = True) -> float:
        """One optimizer step over this rank's micro-batches (numpy int64 inputs/targets); returns the mean
        micro-batch loss as a float (which waits for the step's work to finish)."""

    def trace_collectives(self, run_steps) -> dict:
        """Run `run_steps()` (a few full steps after the measured ones; returns their times) under this
        stack's own profiler and return the collectives it saw: {"method", "steps", "step_times",
        "collectives": [backends.comm_trace entries]}; a stack whose instrument cannot see its collectives
        may give "wire" (backends.comm_trace.wire_bytes) instead, with collectives None and a reason. A stack
        without a trace yet runs nothing, says so."""
        return {"method": None, "reason": f"no collective trace for {self.framework} workers yet"}

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
    if kind == "sigstop":  # stopped, not dead: no exit code, no record, deaf to SIGTERM until killed
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "hang":
        time.sleep(1e9)
    if kind == "oom":  # cap the address space, then allocate past it: a real MemoryError from the allocator
        used = psutil.Process().memory_info().vms
        resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
        hog = [bytearray(64 << 20) for _ in range(1 << 12)]
        raise AssertionError(f"allocated {len(hog)} blocks without running out of memory")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process (VmHWM) to its current RSS: Linux's clear_refs "5".
    False where that is unavailable; the peak is then the lifetime maximum (getrusage)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS since reset_peak_rss() (VmHWM), else over the process's life (getrusage)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
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
        return Shard(cfg.isolated_index, cfg.world_size, cfg.micro_batch, cfg.grad_accum)
    return Shard(rank, cfg.world_size, cfg.micro_batch, cfg.grad_accum)


def optimizer_timed_steps(cfg: RunConfig) -> int:
    """How many steps a process with no peer runs after its measured ones to time its optimizer step
    (each between device synchronisations): as many as the measured steps, at most 5; none for an
    isolated worker of a stack that does not shard its optimizer, whose optimizer time nothing uses, and
    none for a stack whose worker cannot time its optimizer apart (tf-mwms)."""
    backend = get_backend(cfg.backend)
    if not backend.times_optimizer or (cfg.isolated_index is not None and backend.sharding(cfg) == "none"):
        return 0
    return min(cfg.steps, 5)


# What a rank's measured record says of its trace until the trace is done: a rank that dies while tracing
# (an instrument's crash as it stops, a peer gone) is kept with this, its measured steps being complete.
TRACE_LOST = "lost: the rank ended while its collective trace ran or stopped, after its measured steps"


def run_training(trainer: Trainer, cfg: RunConfig, weights_path: Path | None = None, checkpoint=None) -> dict:
    """The timing rules every backend shares; returns the raw rank record.

    A step is timed from a device-synchronised boundary to the next: taking this rank's micro-batches
    (recorded separately as data wait), the framework's step, and the loss read-back. The micro-batches are
    prepared before the step's clock starts, as a prefetching data loader would have them ready (their
    preparation time is recorded as data_prep). Warm-up steps are run and dropped; allocator peaks and the
    peak RSS are reset after them. Then, if the trainer can switch gradient sync off, `compute_steps` more
    steps run with sync off (after the measured ones, since they let replicas drift); the first of those is
    dropped too, as the switch can itself trigger one-off work. `weights_path`: where to save the final
    weights of the measured steps (before the sync-off steps move them). A process with no peer instead runs
    `optimizer_timed_steps` more, each timing its optimizer step between device synchronisations
    (Trainer.timed_optimizer_step), so no synchronisation enters the measured steps. Last, after memory is
    read, `trace_steps` more run under the stack's profiler for the collective trace
    (Trainer.trace_collectives); their times are recorded apart, as profiling slows them. Before them the
    record of everything measured goes to `checkpoint` (with its trace TRACE_LOST), so a rank that dies
    while tracing still has its measurements on file, and after them the record with its trace; after
    compute-only steps one synced step re-aligns the ranks first.
    """
    source = make_source(cfg.spec.vocab_size, cfg.spec.seq_len, cfg.global_batch, cfg.seed, cfg.data_path)
    shard = data_shard(cfg, trainer.rank)

    def timed_step(step: int, sync_grads: bool) -> tuple[float, float, float, float]:
        t_prep = time.perf_counter()
        prepared = micro_batches(source, shard, step)
        t_prep = time.perf_counter() - t_prep
        trainer.synchronize()
        t0 = time.perf_counter()
        batches = prepared
        t_data = time.perf_counter() - t0
        loss = trainer.step(batches, sync_grads=sync_grads)
        if cfg.step_delay_s:
            time.sleep(cfg.step_delay_s)
        trainer.synchronize()
        return time.perf_counter() - t0, t_data, loss, t_prep

    step_times, data_wait, data_prep, losses, warmup_losses = [], [], [], [], []
    peak_rss_scope = "process lifetime"
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            trainer.reset_peak_memory()
            peak_rss_scope = "after warm-up" if reset_peak_rss() else "process lifetime"
            faults_at_start = minor_page_faults()
        inject_fault(cfg, trainer.rank, step)
        t, t_data, loss, t_prep = timed_step(step, True)
        if step < cfg.warmup:
            warmup_losses.append(loss)
        else:
            step_times.append(t)
            data_wait.append(t_data)
            data_prep.append(t_prep)
            losses.append(loss)
        if trainer.rank == 0:
            print(
                f"step {step:4d} loss {loss:.4f} time {t * 1e3:8.1f} ms"
                f"{' (warm-up)' if step < cfg.warmup else ''}",
                flush=True,
            )
    minor_faults_per_step = (minor_page_faults() - faults_at_start) / cfg.steps
    model_state = trainer.model_state_bytes()  # after a full step, so gradients and moments exist
    model_state["total"] = sum(model_state.values())
    weights = trainer.final_weights() if weights_path else None  # collective for sharded models: all ranks
    if weights is not None and weights_path is not None and trainer.rank == 0:
        np.savez(weights_path, **weights)

    first = cfg.warmup + cfg.steps
    optimizer_timed_times = []  # the whole steps, to set beside the measured ones (their synchronisations)
    if cfg.process_group_size == 1:  # no peer: a 1-rank run or an isolated-counterfactual worker
        timed_steps = optimizer_timed_steps(cfg)
        trainer.time_optimizer = True
        for step in range(first, first + timed_steps):
            t, _, loss, _ = timed_step(step, True)
            optimizer_timed_times.append(t)
            if trainer.rank == 0:
                print(f"step {step:4d} loss {loss:.4f} time {t * 1e3:8.1f} ms (optimizer-timed)", flush=True)
        trainer.time_optimizer = False
        first += timed_steps

    compute_times = []
    if (
        trainer.can_skip_grad_sync
        and cfg.compute_method == "no_sync"
        and cfg.process_group_size > 1
        and cfg.compute_steps
    ):
        for step in range(first, first + cfg.compute_steps + 1):
            t, _, loss, _ = timed_step(step, False)
            if step > first:
                compute_times.append(t)
            if trainer.rank == 0:
                print(f"step {step:4d} loss {loss:.4f} time {t * 1e3:8.1f} ms (compute-only)", flush=True)
        first += cfg.compute_steps + 1

    memory = {"peak_rss": peak_rss_bytes(), "peak_rss_scope": peak_rss_scope, **trainer.memory()}
    record = {
        "rank": trainer.rank,
        "host": socket.gethostname(),
        "device": trainer.device_name,
        "local_rank": trainer.local_rank,
        "pid": os.getpid(),
        "status": "ok",
        "step_times": step_times,
        "data_wait": data_wait,
        "data_prep": data_prep,
        "losses": losses,
        "warmup_losses": warmup_losses,
        "compute_only_step_times": compute_times,
        "optimizer_step_times": list(trainer.optimizer_times),
        "optimizer_timed_step_times": optimizer_timed_times,
        "comm_trace": None,
        "math_mode": trainer.math_mode(),
        "memory": memory,
        "model_state_bytes": model_state,
        "minor_faults_per_step": minor_faults_per_step,
        "versions": {"python": platform.python_version(), **trainer.versions()},
        "interpreter": sys.executable,  # the environment this rank ran in (RunConfig.python)
        "threads": cfg.threads_per_worker,
        "process_settings": seen_process_settings(),
    }
    if cfg.trace_comm and cfg.trace_steps and cfg.process_group_size > 1:
        if checkpoint:
            checkpoint({**record, "comm_trace": {"method": None, "reason": TRACE_LOST}})
        if compute_times:  # steps without a collective let the ranks drift apart: one synced step, untimed,
            timed_step(first, True)  # so the first traced call does not take up that skew as its time
            first += 1
        traced = range(first, first + cfg.trace_steps)

        def traced_steps() -> list[float]:
            times = []
            for step in traced:
                inject_fault(cfg, trainer.rank, step)
                t, _, loss, _ = timed_step(step, True)
                times.append(t)
                if trainer.rank == 0:
                    print(f"step {step:4d} loss {loss:.4f} time {t * 1e3:8.1f} ms (traced)", flush=True)
            return times

        record["comm_trace"] = trainer.trace_collectives(traced_steps)
        if checkpoint:  # again with the trace, should the teardown that follows fail (a peer gone)
            checkpoint(record)
    return record


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


def record_failure(path: Path, exc: BaseException) -> None:
    """Write the record of a rank that raised, deaf to SIGTERM while it writes: a rank that failed because
    a peer died is sent SIGTERM by its launcher moments later, and a Terminated raised while this record is
    written would leave no record at all, so the rank would be taken for the one that died. A SIGTERM that
    lands before the handler is switched off raises Terminated once (the handler then ignores the next),
    so the record is written again. Afterwards SIGTERM ends the process, so a rank stuck on its way out
    is still ended by its launcher."""
    try:
        write_failure_record(path, exc)
    except Terminated:
        write_failure_record(path, exc)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_failure_record(path: Path, exc: BaseException) -> None:
    """record_failure's one attempt: SIGTERM off, then the record."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record = failure_record(exc)
    print(record["traceback"], file=sys.stderr, flush=True)
    write_json_atomic(path, record)


def failure_record(exc: BaseException) -> dict:
    """The rank record of a rank that raised: 'oom' for out-of-memory errors, else 'failed';
    `terminated` marks a rank stopped from outside (see Terminated)."""
    name = type(exc).__name__
    oom = isinstance(exc, MemoryError) or "OutOfMemory" in name or "out of memory" in str(exc).lower()
    return {
        "rank": rank_from_env(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "status": "oom" if oom else "failed",
        "error": f"{name}: {exc}",
        "failed_at": time.time(),
        "terminated": isinstance(exc, Terminated),
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
        "memory": {"peak_rss": peak_rss_bytes()},
    }
