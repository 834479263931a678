"""What a comparison compares: the runs of the two sides matched by their configuration
(core.records.ConfigKey), and the one value each run gives, its per-run statistic of the step times, with
beside it the run's value of each part of its step (run_parts). One definition, shared by `harness compare`
(harness.analyze.compare_command) and `harness gate`'s paired figures (harness.analyze.paired)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.stats import trim_mean

from core.records import ConfigKey, config_key, device_name
from harness.analyze.anatomy import PARTS
from harness.analyze.baseline import InputError

# The per-run statistics of the step times: compare's samples and the gate's paired log-ratios
# (harness.analyze.paired) are both taken with per_run. min is steadier under contention (which only adds
# time) but blind to slowdowns that hit only some steps (stragglers, periodic stalls). Each verb has its own
# default: compare's is the median, the yardstick's t_step; the gate's is min, the least noisy of the four
# in the A/A spread measured for it (docs/ci-gate.md, "Which statistic"). compare offers the median and min
# (COMPARE_STATISTICS), the two its documentation describes.
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {
    "median": np.median,
    "min": np.min,
    "mean": np.mean,
    "trimmed-mean": lambda v: trim_mean(v, 0.1),  # 10% cut at each end
}
COMPARE_STATISTICS = ("median", "min")


def per_run(record: dict, statistic: str) -> float:
    """One run's `statistic` (a key of STATISTICS) of its step times, the slowest rank's per step (a
    trimmed record's step_times_s, harness.analyze.baseline.trim)."""
    return float(STATISTICS[statistic](record["step_times_s"]))


def run_parts(record: dict) -> dict:
    """One run's value of each part of its step (harness.analyze.anatomy, in its summary): {"step_s": the
    anatomy's step, "parts": {part: {"s": seconds where the part may be concluded from (measured, or derived
    and not unresolved), else None; "status": the anatomy's}}}. A record without an anatomy (one from before
    it, or without a measured step) has every part n/a."""
    anatomy = (record.get("summary") or {}).get("anatomy") or {}
    parts = anatomy.get("parts") or {}

    def one(name: str) -> dict:
        p = parts.get(name) or {}
        status = p.get("status", "n/a")
        return {"s": p.get("s") if status in ("measured", "derived") else None, "status": status}

    return {"step_s": anatomy.get("step_s"), "parts": {name: one(name) for name in PARTS}}


def run_samples(
    base_runs: list[dict], cand_runs: list[dict], statistic: str
) -> tuple[list[float], list[float]]:
    """One step-time sample per run that measured steps: its per_run statistic."""

    def samples(runs):
        return [per_run(r, statistic) for r in runs if r["step_times_s"]]

    return samples(base_runs), samples(cand_runs)


# ---- matching -----------------------------------------------------------------------------------------


def run_key(run: dict, device: str | None = None) -> ConfigKey:
    """The match key; `device` overrides the run's own ("*" to match across devices)."""
    return config_key(run, device)


def group(base: list[dict], cand: list[dict], any_device: bool) -> tuple[dict, dict]:
    """Both sides' runs by match key. A run that failed before any rank named its device has no device
    kind; it joins its configuration's runs when those ran on a single device kind, so a candidate that
    crashes where the baseline ran is still matched (and reported as newly failing)."""
    kinds: dict[ConfigKey, set] = {}
    for r in base + cand:
        if device_name(r):
            kinds.setdefault(run_key(r, "*"), set()).add(device_name(r))

    def key(r):
        if any_device:
            return run_key(r, "*")
        known = kinds.get(run_key(r, "*"), set())
        return run_key(r, None if device_name(r) or len(known) != 1 else next(iter(known)))

    def by_key(runs):
        out: dict[ConfigKey, list[dict]] = {}
        for r in runs:
            out.setdefault(key(r), []).append(r)
        return out

    return by_key(base), by_key(cand)


def check_devices(base: list[dict], cand: list[dict]) -> None:
    """Timings from different device kinds are not a regression signal: refuse unless --force."""
    b, c = group(base, cand, any_device=True)
    for key in sorted(b.keys() & c.keys()):
        kinds_b = {d for r in b[key] if (d := device_name(r)) is not None}
        kinds_c = {d for r in c[key] if (d := device_name(r)) is not None}
        if kinds_b and kinds_c and not kinds_b & kinds_c:
            raise InputError(
                f"{key.text()}: baseline ran on {', '.join(sorted(kinds_b))} but candidate on "
                f"{', '.join(sorted(kinds_c))}; timings from different devices are not comparable "
                f"(pass --force to compare anyway)"
            )
