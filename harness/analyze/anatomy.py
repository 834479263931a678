"""The anatomy of a step: where a run's measured step goes, part by part, alike for every stack.

Derived here, from the raw per-rank series, and nowhere else (harness.analyze.metrics.summarize calls it):

- forward, backward, optimizer: timed between device synchronisations in the anatomy steps
  (backends.loop.Trainer.timed_part), in the launch that measures the step without communication: the
  ranks with their sync off (no_sync method), the isolated workers (isolated method), or a 1-rank run;
- exposed communication: the measured step less t_compute (the step without gradient synchronisation);
- other: what is left, the measured step less the four: framework work outside the three timed calls
  (zero_grad, the loss read-back, an engine's bookkeeping) and whatever the parts miss.

Each part's value is a median (the slowest process's, as t_compute is taken) with a 95% bootstrap interval
(scipy.stats.bootstrap). A difference whose interval lies wholly below zero, or that is negative with no
interval (a series of one value), is *unresolved*: its sign and size are kept, it is never clamped to zero,
and nothing may be concluded from it.
"""

from __future__ import annotations

import numpy as np

PARTS = ("forward", "backward", "optimizer", "exposed_comm", "other")
TIMED = {"forward": "forward_times", "backward": "backward_times", "optimizer": "optimizer_step_times"}
# Beyond this share of the step, "other" says the parts do not account for the step.
OTHER_SHARE_LIMIT = 0.15
CONFIDENCE = 0.95
RESAMPLES = 999


def slowest_process_series(series: list[list[float]]) -> list[float] | None:
    """The series of the process with the largest median, None unless every process has one: the part on
    the critical path, as t_compute takes the slowest process (harness.analyze.metrics uses it too)."""
    if not series or not all(series):
        return None
    return max(series, key=lambda s: float(np.median(s)))


def slowest_series(processes: list[dict], key: str) -> list[float] | None:
    """slowest_process_series of each process's series `key`."""
    return slowest_process_series([p.get(key) or [] for p in processes])


def sharded_optimizer_cut(optimizer_times: list[float], world: int) -> float:
    """What an isolated worker of a stack that shards its optimizer steps beyond a rank: it steps all P
    parameters where a rank steps P/N, so (N−1)/N of its median optimizer step."""
    return (world - 1) / world * float(np.median(optimizer_times))


def slowest_less_sharded_optimizer(processes: list[dict], key: str, world: int) -> list[float] | None:
    """The slowest process's series `key`, each process's less its own sharded_optimizer_cut, None unless
    every process has both series: t_compute from the isolated workers' steps (harness.analyze.metrics),
    and the anatomy steps it is compared with."""
    per_process = []
    for p in processes:
        series, opt = p.get(key) or [], p.get("optimizer_step_times") or []
        if not series or not opt:
            return None
        cut = sharded_optimizer_cut(opt, world)
        per_process.append([t - cut for t in series])
    return slowest_process_series(per_process)


def anatomy_step_series(processes: list[dict], discount_world: int) -> list[float] | None:
    """The slowest process's anatomy steps, comparable with t_compute: for the isolated workers of a stack
    that shards its optimizer (discount_world N > 1), each less the cut t_compute takes off its steps."""
    if discount_world <= 1:
        return slowest_series(processes, "anatomy_step_times")
    return slowest_less_sharded_optimizer(processes, "anatomy_step_times", discount_world)


def median_difference(first: list[float], others: list[list[float]]) -> tuple[float, list[float] | None]:
    """median(first) − Σ median(other), with a percentile bootstrap interval over independent resamples of
    every series (None where a series has fewer than two values)."""
    value = float(np.median(first)) - sum(float(np.median(o)) for o in others)
    samples = [np.asarray(first, float), *(np.asarray(o, float) for o in others)]
    if any(len(s) < 2 for s in samples):
        return value, None

    def statistic(*resampled, axis=-1):
        return np.median(resampled[0], axis=axis) - sum(np.median(r, axis=axis) for r in resampled[1:])

    if all(np.ptp(s) == 0 for s in samples):
        return value, [value, value]
    from scipy import stats  # here: `harness run` starts without the analysis libraries

    result = stats.bootstrap(
        samples,
        statistic,
        n_resamples=RESAMPLES,
        confidence_level=CONFIDENCE,
        method="percentile",
        vectorized=True,
        paired=False,
        random_state=np.random.default_rng(0),
    )
    low, high = result.confidence_interval
    return value, [float(low), float(high)]


def part(value: float, interval: list[float] | None, method: str, step_s: float, derived: bool) -> dict:
    # without an interval (a series of one value) a negative difference cannot be told from noise either
    unresolved = derived and (interval[1] < 0 if interval is not None else value < 0)
    return {
        "s": value,
        "ci": interval,
        "share": value / step_s if step_s else None,
        "status": "unresolved" if unresolved else ("derived" if derived else "measured"),
        "method": method,
    }


def missing(reason: str) -> dict:
    return {"s": None, "ci": None, "share": None, "status": "n/a", "method": reason}


def parts_source(record: dict, ranks: list[dict], method: str, world: int) -> tuple[list[dict], str]:
    """The processes whose anatomy steps ran free of communication, and what they are."""
    if world == 1:
        return ranks, "the run's one rank"
    if method == "no_sync":
        return ranks, "the run's ranks, gradient sync off"
    if method == "isolated":
        return [w for w in record.get("isolated_ranks") or [] if w.get("status", "ok") == "ok"], (
            "the isolated workers (one process per rank, no peer)"
        )
    return [], "no launch measured the step without communication"


def step_anatomy(
    record: dict,
    ranks: list[dict],
    step_series: list[float],
    compute: tuple[float | None, list[float] | None],
    method: str,
    discount_optimizer: bool,
    world: int,
) -> dict | None:
    """The anatomy of the run's step (module docstring). `step_series`: the measured steps (slowest rank
    per step); `compute`: t_compute and the series it is the median of (None where not measured);
    `discount_optimizer`: isolated workers of a stack that shards its optimizer stepped it over all P
    parameters, a rank over P/N. None where there is no measured step."""
    if not step_series:
        return None
    step_s = float(np.median(step_series))
    processes, source = parts_source(record, ranks, method, world)
    methods = next((p.get("anatomy_methods") for p in processes if p.get("anatomy_methods")), None) or {}
    parts: dict[str, dict] = {}
    series: dict[str, list[float]] = {}
    for name, key in TIMED.items():
        found = slowest_series(processes, key)
        if found is None:
            said = methods.get(name, "")
            parts[name] = missing(said if said.startswith("not split") else f"not timed in {source}")
            continue
        scale = 1 / world if (name == "optimizer" and discount_optimizer) else 1.0
        series[name] = [t * scale for t in found]
        low_high = median_difference(series[name], [])[1]
        method_text = methods.get(name, "timed between device synchronisations")
        if scale != 1.0:
            method_text += f"; 1/{world} of the isolated worker's, which steps all parameters"
        parts[name] = part(float(np.median(series[name])), low_high, method_text, step_s, derived=False)

    t_compute, compute_series = compute
    if world == 1:
        parts["exposed_comm"] = part(0.0, [0.0, 0.0], "none: one rank", step_s, derived=True)
        compute_series, t_compute = step_series, step_s
    elif t_compute is None or compute_series is None:
        parts["exposed_comm"] = missing("t_compute not measured")
    else:
        value, interval = median_difference(step_series, [compute_series])
        parts["exposed_comm"] = part(value, interval, "measured step less t_compute", step_s, derived=True)

    if compute_series is not None and len(series) == len(TIMED):
        value, interval = median_difference(compute_series, list(series.values()))
        parts["other"] = part(
            value, interval, "t_compute less forward, backward and optimizer", step_s, derived=True
        )
    else:
        parts["other"] = missing("a part is not measured, so the rest is not known")
    other = parts["other"]
    anatomy_steps = anatomy_step_series(processes, world if discount_optimizer else 1)
    return {
        "step_s": step_s,
        "source": source,
        "sync": methods.get("sync"),
        "parts": {name: parts[name] for name in PARTS},
        "accounts_for_step": None
        if other["s"] is None or other["status"] == "unresolved"
        else abs(other["s"]) <= OTHER_SHARE_LIMIT * step_s,
        "instrument_cost_s": float(np.median(anatomy_steps)) - t_compute
        if anatomy_steps and t_compute is not None
        else None,
    }


def resolved(anatomy: dict | None, name: str) -> float | None:
    """A part's seconds where it may be concluded from: measured, or derived and not unresolved."""
    if not anatomy:
        return None
    p = anatomy["parts"].get(name) or {}
    return p.get("s") if p.get("status") in ("measured", "derived") else None


LABELS = {
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "exposed_comm": "exposed comm",
    "other": "other",
}


def part_text(p: dict) -> str:
    """One part in a line: its milliseconds and share, or why it is not a figure."""
    if p["s"] is None:
        return f"n/a ({p['method']})"
    ms = f"{p['s'] * 1e3:.1f} ms"
    if p["status"] == "unresolved" and p["ci"] is None:
        return f"unresolved: {ms}, negative, one value (no interval)"
    if p["status"] == "unresolved":
        low, high = (x * 1e3 for x in p["ci"])
        return f"unresolved: {ms} [{low:.1f}, {high:.1f}], negative beyond its noise"
    return f"{ms} ({p['share']:.0%})" if p.get("share") is not None else ms


def anatomy_text(anatomy: dict | None) -> str:
    """The anatomy in one cell of the run summary."""
    if not anatomy:
        return "n/a (no measured step)"
    parts = " · ".join(f"{LABELS[k]} {part_text(p)}" for k, p in anatomy["parts"].items())
    verdict = {
        True: "the parts account for the step",
        False: f"other above {OTHER_SHARE_LIMIT:.0%}: the parts do not account for the step",
        None: "whether the parts account for the step is not known",
    }[anatomy["accounts_for_step"]]
    return f"{parts}; from {anatomy['source']}; {verdict}"
