"""The worker side every backend shares: the `Trainer` interface and THE timed training loop.

Runs inside a worker process, which imports its one framework in its backend's worker module; nothing here
imports a framework.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends import get_backend
from backends.faults import inject_fault
from backends.process_stats import minor_page_faults, peak_rss_bytes, rank_from_env, reset_peak_rss, rss_bytes
from core.config import RunConfig
from core.events import MEASURED, PHASE_END, PHASE_START, RESULT, STEP, EventLog, rank_record, read_events
from core.hooks import NO_HOOKS, TestHooks
from core.process import seen_process_settings
from workloads.data import Shard, make_source, micro_batches


class Trainer(ABC):
    """One rank's model, optimizer and step, in one framework. The shared loop below times it."""

    framework = ""
    can_skip_grad_sync = False  # True if step(sync_grads=False) really skips gradient synchronisation
    sync_off_switch = ""  # the framework's own switch step(sync_grads=False) uses, where it has one

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.rank = rank_from_env()
        self.world_size = cfg.process_group_size
        self.device_name = "cpu"
        # The rank's index among its node's ranks, where the stack picks its device by it (cuda:<local
        # rank> inside the launcher's mask); recorded, so a rank on the wrong device shows.
        self.local_rank: int | None = None
        self.part_times: dict[str, float] = {}  # seconds per part of the current anatomy step

    time_parts = False  # set by run_training for its anatomy steps only
    hooks: TestHooks = NO_HOOKS  # the test hooks of the run (run_training sets them)

    # What each part of the step is, in this framework's own calls, for the record (`anatomy_methods`):
    # forward, backward, optimizer -> the call timed. A part this worker cannot time apart is absent, and
    # the record says why in `anatomy_unsplit` (part -> reason).
    anatomy_methods: dict[str, str] = {}
    anatomy_unsplit: dict[str, str] = {}

    def timed_part(self, part: str, run, includes: tuple[str, ...] = ()):
        """Run `run()`, one part of a step ("forward", "backward", "optimizer"), and return its result; in
        the anatomy steps also time it between device synchronisations and add the time to
        `part_times[part]` (a part that runs once per micro-batch adds up over the step). The measured steps
        are never timed inside: a synchronisation there would change what they overlap.

        A test hook's delay of the part (core.hooks.TestHooks.part_delays) is slept here in every step, the
        measured ones too; `includes` names the parts a call holds where a framework cannot call them apart
        (a traced function that runs forward and backward), whose delays it then sleeps."""
        return self.timed_part_seconds(part, run, includes)[0]

    def timed_part_seconds(self, part: str, run, includes: tuple[str, ...] = ()) -> tuple:
        """timed_part, and the call's own seconds in the anatomy steps (None in the others): from the
        synchronised start to its device's finish, without the test's delay, which is slept after it. A
        trainer whose call of one part runs another part again (TensorFlow's gradients' function runs the
        forward) takes the other's own seconds off with it."""
        delay = sum(self.hooks.part_delay(p) for p in includes or (part,))
        if not self.time_parts:
            result = run()
            if delay:
                time.sleep(delay)
            return result, None
        self.synchronize()
        t0 = time.perf_counter()
        result = run()
        self.synchronize()
        own = time.perf_counter() - t0
        if delay:
            time.sleep(delay)
        self.part_times[part] = self.part_times.get(part, 0.0) + time.perf_counter() - t0
        return result, own

    def timed_optimizer_step(self, optimizer_step) -> None:
        """The optimizer part of the step (timed_part): an isolated-counterfactual worker steps the optimizer
        over all P parameters where a rank of a sharded stack steps P/N, and t_compute discounts the
        difference (harness.analyze.metrics); a 1-rank run's optimizer time calibrates `harness predict`."""
        self.timed_part("optimizer", optimizer_step)

    def reset_peak_memory(self) -> None:
        """Reset the framework allocator's peak counters: called after warm-up, so peaks exclude model
        construction (the full model before sharding) and one-off warm-up work."""

    def hold_transient(self, nbytes: int) -> str:
        """Take `nbytes` of memory, touch every page, and free it (the test hook
        core.hooks.TestHooks.warmup_transient_bytes): where the run's peaks are read, "host" RSS here; a
        trainer on a device holds it in the allocator whose peak the record reports, and says "device"."""
        held = np.ones(nbytes, dtype=np.uint8)
        del held
        return "host"

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


def data_shard(cfg: RunConfig, rank: int) -> Shard:
    """The data a rank reads; an isolated-counterfactual worker reads the shard of the rank it stands for."""
    if cfg.role.isolated_index is not None:
        return Shard(
            cfg.role.isolated_index, cfg.topology.world_size, cfg.batch.micro_batch, cfg.batch.grad_accum
        )
    return Shard(rank, cfg.topology.world_size, cfg.batch.micro_batch, cfg.batch.grad_accum)


def anatomy_steps(cfg: RunConfig, can_skip_grad_sync: bool) -> int:
    """How many steps a process runs after its measured ones to time the parts of its step (forward,
    backward, optimizer, each between device synchronisations): --anatomy-steps, in the launch that
    measures the step without communication, so that its parts are free of it. That is a process with no
    peer (a 1-rank run, an isolated worker) or, under the no_sync method, every rank of the run with its
    sync off; a run whose t_compute comes from isolated workers leaves the parts to them. An isolated worker
    of a stack that shards its optimizer times it in at least min(steps, 5) steps whatever the setting,
    since t_compute's discount needs it."""
    m = cfg.measurement
    if cfg.role.trace_launch == "only":
        return 0
    if cfg.process_group_size > 1:
        return m.anatomy_steps if (m.compute_method == "no_sync" and can_skip_grad_sync) else 0
    backend = get_backend(cfg.backend)
    sharded = backend.sharding(cfg) != "none" and backend.times_optimizer
    needed = cfg.role.isolated_index is not None and sharded
    return max(m.anatomy_steps, min(m.steps, 5) if needed else 0)


# The per-step event field each timed part of a step is written to (Trainer.part_times).
PART_FIELDS = {"forward": "forward_s", "backward": "backward_s", "optimizer": "optimizer_step_time_s"}


def anatomy_sync(trainer: Trainer, cfg: RunConfig) -> str:
    """How the anatomy steps of this process ran free of gradient synchronisation, for the record."""
    if cfg.process_group_size == 1:
        return "alone: no peer to synchronise with"
    return f"gradient sync off ({trainer.sync_off_switch})"


# What a rank's measured record says of its trace until the trace is done: a rank that dies while tracing
# (an instrument's crash as it stops, a peer gone) is kept with this, its measured steps being complete.
TRACE_LOST = "lost: the rank ended while its collective trace ran or stopped, after its measured steps"


@dataclass(frozen=True)
class Phase:
    """One stretch of the timed loop, as data. run_training runs every phase alike, step after step, each
    step timed by the same rules; a phase says only how its steps run and what the record keeps of them.
    Announced in the rank's events (core.events.PHASE_START) with this description."""

    name: str
    """warm-up | measured | compute-only | anatomy | traced: the events' `phase`."""
    steps: int
    """Steps it runs, its `settle` steps included; 0 where it does not apply to this rank."""
    sync_grads: bool = True
    """False: gradient synchronisation switched off (Trainer.step's sync_grads), for t_compute."""
    time_parts: bool = False
    """Trainer.timed_part times each part of the step (forward, backward, optimizer) between device
    synchronisations."""
    traced: bool = False
    """Its kept steps run under the stack's profiler (Trainer.trace_collectives), after the record of
    everything measured is on file (core.events.MEASURED): profiling slows steps, so nothing else is taken
    from them but the trace."""
    measured: bool = False
    """The run's measured steps: allocator peaks and peak RSS are reset before them, minor page faults
    counted over them, model state and final weights read after them."""
    settle: int = 0
    """Leading steps run and dropped: the one-off work switching sync off can trigger; before a trace, the
    synced step that re-aligns ranks a sync-off phase let drift, so the first traced call does not take up
    that skew as its time (outside the profiler)."""
    keeps: dict[str, str] = field(default_factory=dict)
    """What the rank record keeps of its kept steps: step event field -> the record's list."""


def training_phases(trainer: Trainer, cfg: RunConfig) -> list[Phase]:
    """The timed loop of this rank, in order. Compute-only and anatomy steps come after the measured ones,
    since sync-off steps let replicas drift and the anatomy's synchronisations would change what the
    measured steps overlap; the collective trace comes last. A launch that only traces
    (RoleConfig.trace_launch "only") runs the warm-up and the traced steps; the launch that measures beside
    it traces nothing."""
    alone = cfg.process_group_size == 1
    only_trace = cfg.role.trace_launch == "only"
    compute = bool(
        trainer.can_skip_grad_sync
        and cfg.measurement.compute_method == "no_sync"
        and not alone
        and cfg.measurement.compute_steps
        and not only_trace
    )
    anatomy = anatomy_steps(cfg, trainer.can_skip_grad_sync)
    trace = bool(
        cfg.measurement.trace_comm
        and cfg.measurement.trace_steps
        and not alone
        and cfg.role.trace_launch != "untraced"
    )
    phases = [
        Phase(
            "warm-up",
            cfg.measurement.warmup,
            keeps={"loss": "warmup_losses", "step_time_s": "warmup_step_times"},
        ),
        Phase(
            "measured",
            cfg.measurement.steps,
            measured=True,
            keeps={
                "step_time_s": "step_times",
                "loss": "losses",
                "data_prep_s": "data_prep",
                "cpu_time_s": "step_cpu_times",
            },
        ),
        Phase(
            "compute-only",
            cfg.measurement.compute_steps + 1 if compute else 0,
            sync_grads=False,
            settle=1 if compute else 0,
            keeps={"step_time_s": "compute_only_step_times"},
        ),
        Phase(
            "anatomy",
            anatomy + (1 if anatomy and not alone and not compute else 0),
            sync_grads=alone,  # alone there is nothing to sync; with peers, the sync is switched off
            time_parts=True,
            settle=1 if anatomy and not alone and not compute else 0,
            keeps={
                "step_time_s": "anatomy_step_times",
                "forward_s": "forward_times",
                "backward_s": "backward_times",
                "optimizer_step_time_s": "optimizer_step_times",
            },
        ),
        Phase(
            "traced",
            cfg.measurement.trace_steps + (compute or bool(anatomy and not alone)) if trace else 0,
            traced=True,
            settle=int((compute or bool(anatomy and not alone)) and trace),
        ),
    ]
    return [p for p in phases if p.name in ("warm-up", "traced")] if only_trace else phases


def run_training(
    trainer: Trainer,
    cfg: RunConfig,
    events: EventLog,
    hooks: TestHooks = NO_HOOKS,
    weights_path: Path | None = None,
) -> dict:
    """The timing rules every backend shares: runs training_phases and returns the rank's result record,
    without its per-step series, which its step events carry (core.events.rank_record joins them).

    A step is timed from a device-synchronised boundary to the next: the framework's step and the loss
    read-back, nothing else. Its micro-batches are prepared before its clock starts, as a prefetching data
    loader would have them ready (the preparation's time is kept as data_prep), and its event is written
    after its clock has stopped. Warm-up steps are run and dropped (their losses kept). `weights_path`:
    where to save the final weights of the measured steps (before later phases move them). The memory
    figures are read after the last untraced phase; before a traced phase the record of everything measured
    goes to the events (its trace TRACE_LOST), so a rank that dies while tracing still has its
    measurements on file, and again after it with its trace, should the teardown that follows fail.
    """
    source = make_source(
        cfg.model.spec.vocab_size,
        cfg.model.spec.seq_len,
        cfg.global_batch,
        cfg.model.seed,
        cfg.batch.data_path,
    )
    shard = data_shard(cfg, trainer.rank)
    # the tokens this process's group steps over: the run's, or an isolated worker's one rank's share
    group_tokens = cfg.tokens_per_step * cfg.process_group_size / cfg.topology.world_size
    next_step = 0
    measured: dict = {"peak_rss_scope": "process lifetime"}
    trainer.hooks = hooks
    if hooks.warmup_transient_bytes:  # before the first warm-up step, so only a reset peak excludes it
        measured["warmup_transient"] = trainer.hold_transient(hooks.warmup_transient_bytes)

    def timed_step(step: int, sync_grads: bool) -> tuple[float, float, float, float]:
        """(step time, loss, batch preparation time, process CPU time) of one step. The CPU time (every
        thread of this process, read just outside the clock's two readings) is blind to waiting: a
        companion of the step time for a regression gate, never a replacement."""
        t_prep = time.perf_counter()
        batches = micro_batches(source, shard, step)
        t_prep = time.perf_counter() - t_prep
        trainer.synchronize()
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = trainer.step(batches, sync_grads=sync_grads)
        if hooks.step_delay_s:
            time.sleep(hooks.step_delay_s)
        if sync_grads and trainer.world_size > 1 and hooks.part_delay("comm"):
            time.sleep(hooks.part_delay("comm"))  # a slower gradient synchronisation: synced steps only
        trainer.synchronize()
        t = time.perf_counter() - t0
        return t, loss, t_prep, time.process_time() - c0

    def run_steps(phase: Phase, count: int, kept: bool) -> list[float]:
        nonlocal next_step
        times = []
        for step in range(next_step, next_step + count):
            inject_fault(hooks, trainer.rank, step)
            trainer.part_times = {}
            t, loss, t_prep, cpu = timed_step(step, phase.sync_grads)
            next_step = step + 1
            step_event = {
                "phase": phase.name,
                "step": step,
                "loss": loss,
                "step_time_s": t,
                "tokens_per_s": group_tokens / t if t > 0 else None,
                "data_prep_s": t_prep,
                "cpu_time_s": cpu,
                "rss_bytes": rss_bytes(),
                "kept": kept,
            }
            for part, key in PART_FIELDS.items():
                if part in trainer.part_times:
                    step_event[key] = trainer.part_times[part]
            events.emit(STEP, **step_event)
            times.append(t)
        return times

    def result() -> dict:
        """Everything measured but the per-step series, once every untraced phase has run."""
        return {
            "rank": trainer.rank,
            "host": socket.gethostname(),
            "device": trainer.device_name,
            "local_rank": trainer.local_rank,
            "pid": os.getpid(),
            "status": "ok",
            "comm_trace": None,
            "math_mode": trainer.math_mode(),
            "memory": {
                "peak_rss": peak_rss_bytes(),
                "peak_rss_scope": measured["peak_rss_scope"],
                **trainer.memory(),
                **{k: measured[k] for k in ("warmup_transient",) if k in measured},
            },
            "model_state_bytes": measured.get("model_state"),  # None where nothing was measured
            "minor_faults_per_step": measured.get("minor_faults_per_step"),
            "versions": {"python": platform.python_version(), **trainer.versions()},
            "interpreter": sys.executable,  # the environment this rank ran in (RunConfig.python)
            "threads": cfg.topology.threads_per_worker,
            "process_settings": seen_process_settings(),
            "anatomy_methods": {
                "sync": anatomy_sync(trainer, cfg),
                **trainer.anatomy_methods,
                **{part: f"not split: {why}" for part, why in trainer.anatomy_unsplit.items()},
            },
        }

    record: dict | None = None
    for phase in training_phases(trainer, cfg):
        if phase.traced and phase.steps:
            record = result()
            events.emit(MEASURED, record={**record, "comm_trace": {"method": None, "reason": TRACE_LOST}})
        events.emit(PHASE_START, phase=phase.name, first_step=next_step, **phase_fields(phase))
        started, first = time.perf_counter(), next_step
        if phase.measured:
            trainer.reset_peak_memory()
            measured["peak_rss_scope"] = "after warm-up" if reset_peak_rss() else "process lifetime"
            faults_at_start = minor_page_faults()
        trainer.time_parts = phase.time_parts
        run_steps(phase, phase.settle, kept=False)
        if phase.traced and phase.steps and record is not None:
            record["comm_trace"] = trainer.trace_collectives(
                lambda phase=phase: run_steps(phase, phase.steps - phase.settle, kept=True)
            )
            record["comm_trace"]["launch"] = "own" if cfg.role.trace_launch == "only" else "inline"
            events.emit(MEASURED, record=record)
        else:
            run_steps(phase, phase.steps - phase.settle, kept=True)
        trainer.time_parts = False
        if phase.measured:
            measured["minor_faults_per_step"] = (minor_page_faults() - faults_at_start) / phase.steps
            state = trainer.model_state_bytes()  # after a full step, so gradients and moments exist
            measured["model_state"] = {**state, "total": sum(state.values())}
            weights = trainer.final_weights() if weights_path else None  # collective when sharded: all ranks
            if weights is not None and weights_path is not None and trainer.rank == 0:
                np.savez(weights_path, **weights)
        events.emit(
            PHASE_END,
            phase=phase.name,
            steps=next_step - first,
            elapsed_s=time.perf_counter() - started,
            memory={"rss_bytes": rss_bytes(), **trainer.memory()},
        )
    return record if record is not None else result()


def run_to_record(trainer: Trainer, cfg: RunConfig, path: Path, hooks: TestHooks = NO_HOOKS) -> dict:
    """run_training in this process, into the event stream at `path`, ended with its result as a worker
    ends it; returns the rank record the harness folds from that stream. For probes and tests that run
    the loop without a worker process."""
    events = EventLog(path, trainer.rank)
    try:
        events.emit(RESULT, record=run_training(trainer, cfg, events, hooks))
    finally:
        events.close()
    record = rank_record(read_events(path))
    if record is None:  # the result was just written
        raise RuntimeError(f"{path}: no result in the stream just written")
    return record


def phase_fields(phase: Phase) -> dict:
    """A phase's description but its name, for its PHASE_START event."""
    fields = dataclasses.asdict(phase)
    del fields["name"]
    return fields
