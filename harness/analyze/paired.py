"""The figures of `harness gate`'s pairs, computed from the runs' records: what a pair keeps of each run
(the per-run statistic, samples.py's per_run, the median step's CPU time and each part of the step,
samples.py's run_parts), the paired log-ratio that is tested and its spread, the exact metrics (any change
is one), the CPU-time companion, and each part's change over the pairs, which names the part that moved.
The decision on the log-ratios is harness.analyze.sequential's; peak memory is gated by compare's rule
(compare_memory)."""

from __future__ import annotations

import math

import numpy as np

from harness.analyze.anatomy import CONFIDENCE, PARTS
from harness.analyze.compare import moved_part, part_change
from harness.analyze.samples import per_run, run_parts
from harness.analyze.sequential import Design, estimate

# Exact metrics: (label, path in a record's summary). Deterministic for one configuration, so a change is
# a change; growth fails the gate.
EXACT_METRICS = (
    ("comm bytes per step", ("comm_bytes_per_rank_per_step",)),
    ("measured comm bytes per step", ("comm_measured", "bytes_per_rank_per_step")),
    ("model-state bytes per rank", ("model_state_bytes_per_rank",)),
)


def run_figures(record: dict, statistic: str) -> dict:
    """What a pair keeps of one ok run (a trimmed record): its `statistic` of the step times, the median of
    its steps' process CPU time (None where it did not measure it: the companion), its step count, and its
    value of each part of the step (samples.run_parts)."""
    cpu = record.get("step_cpu_times_s") or []
    return {
        "statistic": per_run(record, statistic),
        "cpu_median_s": float(np.median(cpu)) if cpu else None,
        "steps": len(record["step_times_s"]),
        "anatomy": run_parts(record),
    }


def log_ratio(base: dict, head: dict) -> float:
    """The paired figure the gate tests: log(head / base) of the two runs' statistic (run_figures)."""
    return math.log(head["statistic"] / base["statistic"])


def log_ratio_sd(pairs: list[dict]) -> float | None:
    """The spread of the pairs' log-ratios (sample sd), which sets how many pairs a gate on this machine
    needs; None below two pairs."""
    return float(np.std([p["log_ratio"] for p in pairs], ddof=1)) if len(pairs) > 1 else None


def summary_value(record: dict, path: tuple[str, ...]):
    value = record.get("summary") or {}
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def exact_changes(base: list[dict], head: list[dict]) -> list[dict]:
    """Each exact metric both sides measured: unchanged, changed (grew: a regression) or not deterministic
    within a side (reported, not gated)."""
    out = []
    for label, path in EXACT_METRICS:
        vb = [v for r in base if (v := summary_value(r, path)) is not None]
        vh = [v for r in head if (v := summary_value(r, path)) is not None]
        if not vb or not vh:
            continue
        if len(set(vb)) > 1 or len(set(vh)) > 1:
            spread = "; ".join(
                f"{s}: {', '.join(f'{v:,.0f}' for v in sorted(set(vs)))}"
                for s, vs in (("base", vb), ("head", vh))
            )
            out.append(
                {
                    "metric": label,
                    "verdict": "varies",
                    "line": f"{label} varies within a side ({spread}): not gated",
                }
            )
            continue
        b, h = vb[0], vh[0]
        if b == h:
            out.append(
                {
                    "metric": label,
                    "verdict": "unchanged",
                    "base": b,
                    "head": h,
                    "line": f"{label}: unchanged ({b:,.0f})",
                }
            )
            continue
        change = f" ({h / b - 1:+.1%})" if b else ""
        out.append(
            {
                "metric": label,
                "verdict": "regression" if h > b else "changed",
                "base": b,
                "head": h,
                "line": f"{label} changed: {b:,.0f} -> {h:,.0f}{change}",
            }
        )
    return out


def cpu_companion(pairs: list[dict], design: Design) -> dict | None:
    """The head's process CPU time per step against the base's, over the pairs that measured it on both
    sides: its change and repeated interval, as the step time's are read. Reported, never gated: CPU time
    is blind to waiting (a slower collective or a stall adds step time and no CPU time), but where the
    step time moves and the CPU time does not, the change is in waiting, not in work."""
    x = [
        math.log(p["head"]["cpu_median_s"] / p["base"]["cpu_median_s"])
        for p in pairs
        if (p["head"].get("cpu_median_s") or 0) > 0 and (p["base"].get("cpu_median_s") or 0) > 0
    ]
    if len(x) < 2:
        return None
    change, interval, _ = estimate(np.asarray(x), design)
    return {"change": change, "interval": list(interval) if interval else None, "pairs": len(x)}


PAIRS_METHOD = (
    f"median over the pairs of the head's part time less the base's, {CONFIDENCE:.0%} percentile bootstrap "
    "interval over the pairs"
)


def part_changes(pairs: list[dict]) -> dict:
    """Each part of the step, head against base: in every pair the head run's part time less the base
    run's (both from their records' anatomy, run_figures), their median over the pairs with a bootstrap
    interval over the pairs (compare.part_change), in seconds and as a share of the base's step (the median
    of the base runs' anatomy step); and the part that moved most. A part unresolved in any run of the pairs
    is unresolved, never named; pairs recorded without the anatomy leave every part n/a."""
    sides = [(p["base"].get("anatomy"), p["head"].get("anatomy")) for p in pairs]
    steps = [b["step_s"] for b, _ in sides if b and b.get("step_s")]
    base_step = float(np.median(steps)) if steps else None
    parts = {}
    for name in PARTS:
        statuses = [x["parts"][name]["status"] if x else "n/a" for pair in sides for x in pair]
        differences = [
            h["parts"][name]["s"] - b["parts"][name]["s"]
            for b, h in sides
            if b and h and b["parts"][name]["s"] is not None and h["parts"][name]["s"] is not None
        ]
        parts[name] = part_change(differences, [], statuses, base_step, "pair")
    return {
        "method": PAIRS_METHOD,
        "pairs": len(pairs),
        "base_step_s": base_step,
        "parts": parts,
        "moved": moved_part(parts),
    }
