"""`--micro-batch max`: the largest micro-batch that fits the device, so that a stack is measured with its
GPU full, as its experts run it, not at a micro-batch that leaves the device mostly idle.

Two steps, both before the run: the memory model (harness.predict.memory, the one `harness select` prices
with) names the largest micro-batch of MICRO_BATCHES whose predicted peak fits the device less the
allocator's margin; then a short probe run (a few steps, nothing traced) at that micro-batch confirms it,
and on out-of-memory backs off to the next smaller one until a probe completes. The record says what was
chosen and how (`micro_batch_choice`): predicted, probed, each probe's outcome.

Only on GPUs: on a CPU memory is not what bounds the micro-batch (the host's memory is shared with
everything else and swaps rather than failing), so `max` is refused there with one line, and a number is
asked for instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.config import RunConfig
from harness.arguments.request import FILL_ON_CPU
from harness.predict.memory import MICRO_BATCHES, largest_fitting
from harness.run.devices import query_gpus
from harness.usage import UsageError

PROBE_STEPS = 3  # one warm-up step and two measured: the allocator's peak is reached in the first step


@dataclass(frozen=True)
class Probe:
    micro_batch: int
    status: str  # the probe run's status: "ok", "oom", "failed", "timeout"
    detail: str = ""


def device_memory_bytes() -> float | None:
    """Total memory of the first visible GPU, from nvidia-smi (MiB), None where none answers."""
    rows = query_gpus(("memory.total",))
    try:
        return float(rows[0]["memory.total"]) * 2**20 if rows else None
    except (KeyError, ValueError):
        return None


def candidates(start: int) -> list[int]:
    """The micro-batches to probe, from `start` down (MICRO_BATCHES, then the halvings below it)."""
    below = [m for m in sorted(MICRO_BATCHES, reverse=True) if m < start]
    return [start, *below]


def choose(
    cfg: RunConfig,
    probe: Callable[[RunConfig], Probe],
    capacity: float | None = None,
) -> tuple[RunConfig, dict]:
    """`cfg` at the largest micro-batch that fits (module docstring) and the record of the choice.
    `probe(cfg)` runs a short run of `cfg` and says how it ended; `capacity`: the device's bytes (default:
    nvidia-smi's). A UsageError where none fits or the device's memory is unknown."""
    if cfg.topology.device != "cuda":
        raise UsageError(FILL_ON_CPU)
    capacity = capacity if capacity is not None else device_memory_bytes()
    if not capacity:
        raise UsageError("--micro-batch max needs the GPU's memory, and nvidia-smi reported none")
    share = max(MICRO_BATCHES) * cfg.batch.grad_accum  # any micro-batch of MICRO_BATCHES divides it
    fitted, terms, why = largest_fitting(cfg.evolve(grad_accum=1), share, capacity)
    predicted = fitted.batch.micro_batch if fitted is not None else min(MICRO_BATCHES)
    probes: list[Probe] = []
    for micro in candidates(predicted):
        trial = cfg.evolve(micro_batch=micro)
        outcome = probe(trial)
        probes.append(outcome)
        if outcome.status == "ok":
            return trial, {
                "requested": "max",
                "chosen": micro,
                "predicted": predicted if fitted is not None else None,
                "predicted_peak_bytes": terms.get("total") if fitted is not None else None,
                "capacity_bytes": capacity,
                "method": "memory model (harness.predict.memory), confirmed by a probe run that backs off "
                "on out-of-memory",
                "probes": [vars(p) for p in probes],
                **({"model_refused": why} if fitted is None else {}),
            }
        if outcome.status != "oom":  # not a question of memory: backing off would not help
            ended = f"ended {outcome.status}: {outcome.detail}"
            raise UsageError(f"--micro-batch max: the probe at micro-batch {micro} {ended}")
    tried = ", ".join(str(p.micro_batch) for p in probes)
    raise UsageError(f"--micro-batch max: out of memory at every micro-batch tried ({tried})")


def probe_run(cfg: RunConfig, timeout_s: float) -> Probe:
    """A short `harness run` of `cfg` (PROBE_STEPS steps, no trace, no t_compute, no anatomy) in a
    temporary folder, and how it ended."""
    import tempfile
    from pathlib import Path

    from harness.arguments.argv import run_argv
    from harness.run.child import run_child

    short = cfg.evolve(
        steps=PROBE_STEPS - 1, warmup=1, trace_comm=False, compute_method="none", anatomy_steps=0
    )
    with tempfile.TemporaryDirectory(prefix="distbench-fill-") as folder:
        done = run_child(["run", *run_argv(short), "--quiet"], Path(folder), timeout_s=timeout_s)
    return Probe(cfg.batch.micro_batch, "timeout" if done.timed_out else done.status, done.why)
