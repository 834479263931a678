"""The comparison behind `harness compare` (its rules are the command's help, in
harness.analyze.compare_command): per matched configuration, the tests of step time, memory and commbench
ops and their verdicts, and the change of each part of the step (its anatomy) that says which part moved,
as one JSON-able dict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t

from core.records import run_config
from harness.analyze.anatomy import CONFIDENCE, PARTS, median_difference
from harness.analyze.baseline import InputError
from harness.analyze.collectives import largest_busbw, op_time_index
from harness.analyze.samples import check_devices, group, run_parts, run_samples
from harness.analyze.summary import fmt_bytes

DEFAULT_THRESHOLD = 0.03
DEFAULT_ALPHA = 0.05
DEFAULT_MEMORY_THRESHOLD = 0.05
# Settings and versions that, when they differ between the sides, are named next to the result: either the
# environment changed (the comparison may be measuring it) or the work itself did.
ENV_FIELDS = ("device_kind", "python", "cpu_count", "threads_per_worker")
CONFIG_FIELDS = (
    "micro_batch",
    "grad_accum",
    "spec",
    "activation_checkpointing",
    "backend_options",
    "compute_method",
    "commbench",
)
# Test hooks (core.hooks) a run ran with: a side slowed or faulted on purpose is named, never taken for code.
HOOK_DEFAULTS = {"step_delay_s": 0.0, "part_delays": None, "fault": None}


def hook_value(run: dict, name: str):
    """A run's test hook `name`, from its top-level test_hooks (core.records.migrate moved those of a record
    from before they left the configuration)."""
    hooks = run.get("test_hooks") or {}
    return hooks.get(name, HOOK_DEFAULTS[name])


# ---- statistics ---------------------------------------------------------------------------------------


@dataclass
class Significance:
    test: str  # "welch-t (log per-run values)" | "threshold only"
    p_value: float | None
    significant: bool
    change: float  # candidate / baseline - 1, of the geometric means of the per-run values
    ci: tuple[float, float] | None = None  # (1 - alpha) confidence interval of `change`
    mdc: float | None = None  # minimum detectable change (80% power at alpha), relative

    def describe(self) -> str:
        if self.p_value is None or self.ci is None:  # both or neither
            return "1 run on a side: launch-to-launch spread unknown, threshold only"
        lo, hi = self.ci
        return (
            f"Welch p={self.p_value:.2g}, CI [{lo:+.1%}, {hi:+.1%}], MDC {self.mdc:.1%}"
            if self.mdc is not None
            else f"Welch p={self.p_value:.2g}"
        )


def significance(base: list[float], cand: list[float], alpha: float, power: float = 0.8) -> Significance:
    """Welch's t-test on the logarithms of per-run values: is the candidate's geometric mean different?
    Also the confidence interval of the relative change and the minimum detectable change (MDC: at this
    spread and these run counts, the change the test would find with probability `power`)."""
    x, y = np.log(np.asarray(base, float)), np.log(np.asarray(cand, float))
    change = float(np.exp(y.mean() - x.mean()) - 1)
    if min(len(x), len(y)) < 2:
        return Significance("threshold only", None, True, change)
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = float(np.sqrt(vx + vy))
    d = float(y.mean() - x.mean())
    if se == 0.0:
        return Significance(
            "welch-t (log per-run values)", 0.0 if d else 1.0, d != 0.0, change, (change, change), 0.0
        )
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    p = float(2 * student_t.sf(abs(d) / se, df))
    q = float(student_t.ppf(1 - alpha / 2, df))
    ci = (float(np.exp(d - q * se) - 1), float(np.exp(d + q * se) - 1))
    mdc = float(np.exp((q + student_t.ppf(power, df)) * se) - 1)
    return Significance("welch-t (log per-run values)", p, p < alpha, change, ci, mdc)


def verdict(
    change: float | None, limit: float, significant: bool = True, higher_is_better: bool = False
) -> str:
    if change is None:
        return "n/a"
    worse = -change if higher_is_better else change
    if worse > limit and significant:
        return "regression"
    if -worse > limit and significant:
        return "improvement"
    return "ok"


def relative(base: float | None, cand: float | None) -> float | None:
    return cand / base - 1 if (base and cand is not None) else None


def median_of(runs: list[dict], field: str) -> float | None:
    values = [r["summary"].get(field) for r in runs]
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def memory_field(runs: list[dict]) -> tuple[str, str]:
    """Per-rank peak memory: the allocator's peak on a GPU, the process RSS on a CPU."""
    if (
        all(run_config(r).topology.device == "cuda" for r in runs)
        and median_of(runs, "peak_allocated_bytes") is not None
    ):
        return "peak_allocated_bytes", "peak allocated / rank"
    return "peak_rss_bytes", "peak RSS / rank"


def compare_throughput(base_runs, cand_runs, threshold, alpha, statistic) -> dict:
    b, c = run_samples(base_runs, cand_runs, statistic)
    if not b or not c:
        return {
            "metric": "throughput_tokens_per_s",
            "label": "throughput",
            "unit": "tokens/s",
            "baseline": None,
            "candidate": None,
            "change": None,
            "detail": "no step samples",
            "verdict": "n/a",
        }
    sig = significance(b, c, alpha)
    # A side's step time: the geometric mean of its per-run values (what the test compares).
    t_b, t_c = float(np.exp(np.log(b).mean())), float(np.exp(np.log(c).mean()))
    tp_b = base_runs[0]["summary"]["tokens_per_step"] / t_b
    tp_c = cand_runs[0]["summary"]["tokens_per_step"] / t_c
    change = relative(tp_b, tp_c)
    return {
        "metric": "throughput_tokens_per_s",
        "label": "throughput",
        "unit": "tokens/s",
        "baseline": tp_b,
        "candidate": tp_c,
        "change": change,
        "baseline_step_time_s": t_b,
        "candidate_step_time_s": t_c,
        "step_time_change": sig.change,
        "step_time_change_ci": sig.ci,
        "minimum_detectable_change": sig.mdc,
        "samples": f"per-run {statistic}",
        "n_baseline": len(b),
        "n_candidate": len(c),
        "baseline_samples": b,
        "candidate_samples": c,
        "test": sig.test,
        "p_value": sig.p_value,
        "significant": sig.significant,
        "detail": f"{sig.describe()} ({len(b)} vs {len(c)} runs, per-run {statistic})",
        "verdict": verdict(change, threshold, sig.significant, higher_is_better=True),
    }


def compare_memory(base_runs, cand_runs, field, label, limit) -> dict:
    b, c = median_of(base_runs, field), median_of(cand_runs, field)
    change = relative(b, c)
    return {
        "metric": field,
        "label": label,
        "unit": "bytes",
        "baseline": b,
        "candidate": c,
        "change": change,
        "detail": "threshold only",
        "verdict": verdict(change, limit),
    }


def compare_collectives(base_runs, cand_runs, threshold, alpha) -> list[dict]:
    """commbench runs, gated as training runs are: per op, one value per run (its time index: the geometric
    mean over sizes of the median call time), Welch's t-test on their logarithms, the same threshold."""
    metrics: list[dict] = []
    candidate_ops = run_config(cand_runs[0]).commbench_spec.ops
    ops = [op for op in run_config(base_runs[0]).commbench_spec.ops if op in candidate_ops]
    for op in ops:
        b = [v for v in (op_time_index(r["summary"], op) for r in base_runs) if v]
        c = [v for v in (op_time_index(r["summary"], op) for r in cand_runs) if v]
        metric = {"metric": f"{op}_time_s", "label": f"{op} time", "unit": "s"}
        if not b or not c:
            metrics.append(
                {
                    **metric,
                    "baseline": None,
                    "candidate": None,
                    "change": None,
                    "detail": "no samples",
                    "verdict": "n/a",
                }
            )
            continue
        sig = significance(b, c, alpha)
        end_b, end_c = largest_busbw(base_runs[0]["summary"], op), largest_busbw(cand_runs[0]["summary"], op)
        busbw = ""
        if end_b and end_c and end_b[1] and end_c[1]:
            busbw = f"; busbw at {fmt_bytes(end_b[0])}: {end_b[1] / 1e9:.3g} -> {end_c[1] / 1e9:.3g} GB/s"
        metrics.append(
            {
                **metric,
                "baseline": float(np.exp(np.log(b).mean())),
                "candidate": float(np.exp(np.log(c).mean())),
                "change": sig.change,
                "change_ci": sig.ci,
                "minimum_detectable_change": sig.mdc,
                "n_baseline": len(b),
                "n_candidate": len(c),
                "test": sig.test,
                "p_value": sig.p_value,
                "significant": sig.significant,
                "detail": f"{sig.describe()} ({len(b)} vs {len(c)} runs, geo-mean over sizes){busbw}",
                "verdict": verdict(sig.change, threshold, sig.significant),
            }
        )
    return metrics


# ---- the step's anatomy: which part moved -------------------------------------------------------------

# Where a part's value comes from on each side, for the JSON: compare's runs are independent draws, a gate's
# pairs are differences.
RUNS_METHOD = (
    f"median of the candidate runs' part time less the baseline runs' median, {CONFIDENCE:.0%} percentile "
    "bootstrap interval over runs (each side resampled on its own)"
)


def part_change(first: list[float], others: list[list[float]], statuses: list[str], base_step_s, unit: str):
    """The change of one part of the step between two sides: median(first) − Σ median(others) with its
    percentile bootstrap interval (harness.analyze.anatomy.median_difference, the anatomy's own statistic);
    `first` alone where it holds the paired differences. `statuses`: the part's anatomy status in every run
    the change rests on; one unresolved run leaves the part unresolved (never concluded from), one run
    that did not measure it leaves it n/a. `moved`: whether the interval excludes zero (None without an
    interval: fewer than two `unit`s)."""
    unresolved = statuses.count("unresolved")
    missing = sum(s not in ("measured", "derived") for s in statuses) - unresolved
    blank = {"s": None, "ci": None, "share": None, "moved": None}
    if not statuses:
        return {**blank, "status": "n/a", "note": "no run to read it from"}
    if unresolved:
        return {
            **blank,
            "status": "unresolved",
            "note": f"unresolved in {unresolved} of {len(statuses)} runs: negative beyond its noise",
        }
    if missing:
        return {**blank, "status": "n/a", "note": f"not measured in {missing} of {len(statuses)} runs"}
    value, interval = median_difference(first, others)
    return {
        "s": value,
        "ci": interval,
        "share": value / base_step_s if base_step_s else None,
        "moved": None if interval is None else bool(interval[0] > 0 or interval[1] < 0),
        "status": "compared",
        "note": None if interval is not None else f"one {unit}: no interval",
    }


def moved_part(parts: dict, direction: int = 0) -> str | None:
    """The part that moved most among those whose change is resolved from zero (its interval excludes
    zero), counting only changes in `direction` where one is given (+1 slower, −1 faster); None where none
    is. An unresolved or unmeasured part is never one (part_change gives it no interval)."""
    found = [
        (abs(p["s"]), name)
        for name, p in parts.items()
        if p["moved"] and (direction == 0 or direction * p["s"] > 0)
    ]
    return max(found)[1] if found else None


def compare_anatomy(base_runs: list[dict], cand_runs: list[dict]) -> dict:
    """Each part's change, candidate against baseline (part_change over the runs' values, samples.run_parts),
    in seconds and as a share of the baseline's step (the median of its runs' anatomy step), and the part
    that moved most."""
    b, c = [run_parts(r) for r in base_runs], [run_parts(r) for r in cand_runs]
    steps = [x["step_s"] for x in b if x["step_s"]]
    base_step = float(np.median(steps)) if steps else None
    parts = {
        name: part_change(
            [x["parts"][name]["s"] for x in c],
            [[x["parts"][name]["s"] for x in b]],
            [x["parts"][name]["status"] for x in b + c],
            base_step,
            "run on a side",
        )
        for name in PARTS
    }
    return {"method": RUNS_METHOD, "baseline_step_s": base_step, "parts": parts, "moved": moved_part(parts)}


def env_differences(base_runs: list[dict], cand_runs: list[dict]) -> list[str]:
    """'name: baseline value(s) -> candidate value(s)' for every environment or work setting that differs."""

    def values(runs, get):
        return ", ".join(sorted({str(get(r)) for r in runs}))

    getters = [(f, lambda r, f=f: r["environment"].get(f)) for f in ENV_FIELDS]
    names = sorted({k for r in base_runs + cand_runs for k in r["environment"].get("versions", {})})
    getters += [
        (n, lambda r, n=n: r["environment"].get("versions", {}).get(n)) for n in names if n != "python"
    ]
    getters += [(f, lambda r, f=f: run_config(r).setting(f)) for f in CONFIG_FIELDS]
    getters += [(h, lambda r, h=h: hook_value(r, h)) for h in HOOK_DEFAULTS]
    out = []
    for name, get in getters:
        vb, vc = values(base_runs, get), values(cand_runs, get)
        if vb != vc:
            out.append(f"{name}: {vb} -> {vc}")
    return out


# ---- the comparison -----------------------------------------------------------------------------------


def side_info(path: Path, runs: list[dict]) -> dict:
    commits = sorted({(r["environment"].get("git") or {}).get("commit") or "unknown" for r in runs})
    return {"path": str(path), "runs": len(runs), "commits": commits}


def compare_runs(
    base: list[dict],
    cand: list[dict],
    threshold: float = DEFAULT_THRESHOLD,
    alpha: float = DEFAULT_ALPHA,
    memory_threshold: float = DEFAULT_MEMORY_THRESHOLD,
    statistic: str = "median",
    force: bool = False,
    sources: tuple = ("baseline", "candidate"),
) -> dict:
    """The whole comparison as a JSON-able dict; raises InputError when there is nothing to compare."""
    if not force:
        check_devices(base, cand)
    gb, gc = group(base, cand, force)
    shared = sorted(gb.keys() & gc.keys())
    if not shared:
        raise InputError(
            f"nothing matched: baseline has {'; '.join(k.text() for k in sorted(gb)) or 'no runs'}, "
            f"candidate has {'; '.join(k.text() for k in sorted(gc)) or 'no runs'}"
        )
    comparisons, not_compared = [], []
    for key in shared:
        ok_b = [r for r in gb[key] if r["status"] == "ok"]
        ok_c = [r for r in gc[key] if r["status"] == "ok"]
        for side, runs in (("baseline", gb[key]), ("candidate", gc[key])):
            for r in runs:
                if r["status"] != "ok":
                    not_compared.append(
                        {
                            "side": side,
                            "key": key.text(),
                            "run_id": r["run_id"],
                            "status": r["status"],
                            "error": (r.get("error") or {}).get("message"),
                            "newly_failing": side == "candidate" and bool(ok_b),
                        }
                    )
        if not (ok_b and ok_c):
            continue
        if ok_b[0].get("kind") == "commbench":
            metrics = compare_collectives(ok_b, ok_c, threshold, alpha)
            anatomy = None
        else:
            field, label = memory_field(ok_b + ok_c)
            anatomy = compare_anatomy(ok_b, ok_c)
            step = compare_throughput(ok_b, ok_c, threshold, alpha, statistic)
            # the part that moved the way the verdict went: slower under a regression, faster under an
            # improvement
            direction = {"regression": 1, "improvement": -1}.get(step["verdict"], 0)
            step["part_that_moved"] = moved_part(anatomy["parts"], direction) if direction else None
            metrics = [
                step,
                compare_memory(ok_b, ok_c, field, label, memory_threshold),
                compare_memory(
                    ok_b, ok_c, "model_state_bytes_per_rank", "model state / rank", memory_threshold
                ),
            ]
        comparisons.append(
            {
                "key": key.text(),
                "match": dataclasses.asdict(key),
                "metrics": metrics,
                "anatomy": anatomy,
                "environment_differences": env_differences(ok_b, ok_c),
                "baseline_runs": [r["run_id"] for r in ok_b],
                "candidate_runs": [r["run_id"] for r in ok_c],
            }
        )
    verdicts = [m["verdict"] for c in comparisons for m in c["metrics"]]
    regressions = verdicts.count("regression")
    newly_failing = sum(n["newly_failing"] for n in not_compared)
    return {
        "result": "regression" if (regressions or newly_failing) else "ok",
        "regressions": regressions,
        "improvements": verdicts.count("improvement"),
        "newly_failing": newly_failing,
        "baseline": side_info(sources[0], base),
        "candidate": side_info(sources[1], cand),
        "settings": {
            "threshold": threshold,
            "alpha": alpha,
            "memory_threshold": memory_threshold,
            "statistic": statistic,
            "force": force,
        },
        "comparisons": comparisons,
        "not_compared": not_compared,
        "only_in_baseline": [k.text() for k in sorted(gb.keys() - gc.keys())],
        "only_in_candidate": [k.text() for k in sorted(gc.keys() - gb.keys())],
    }
