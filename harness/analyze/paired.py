"""The figures of `harness gate`'s pairs, computed from the runs' records: the per-run statistic whose paired
log-ratio is tested, the exact metrics (any change is one), and the CPU-time companion. The decision on the
log-ratios is harness.analyze.sequential's."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy.stats import trim_mean

from harness.analyze.sequential import Design, estimate

# The per-run statistic whose paired log-ratios are tested. The median is the default until the spread of
# the candidates has been measured on a quiet machine; min is steadier under contention but blind to
# slowdowns that hit only some steps (harness.analyze.compare says why).
STATISTICS: dict[str, Callable] = {
    "median": np.median,
    "min": np.min,
    "mean": np.mean,
    "trimmed-mean": lambda v: trim_mean(v, 0.1),  # 10% cut at each end
}
# Exact metrics: (label, path in a record's summary). Deterministic for one configuration, so a change is
# a change; growth fails the gate.
EXACT_METRICS = (
    ("comm bytes per step", ("comm_bytes_per_rank_per_step",)),
    ("measured comm bytes per step", ("comm_measured", "bytes_per_rank_per_step")),
    ("model-state bytes per rank", ("model_state_bytes_per_rank",)),
)


def per_run(record: dict, statistic: str) -> float:
    return float(STATISTICS[statistic](record["step_times_s"]))


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
