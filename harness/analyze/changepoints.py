"""Change points in one configuration's metric across commits (`harness history --detect`).

The detector is Apache Otava's (`otava.analysis.compute_change_points`, the E-divisive method of Matteson
and James as Hunter/Otava run it: candidate points from E-divisive in sliding windows, each kept only if a
t-test between the segments either side of it has p below `max_pvalue` and the change is larger than
`min_magnitude`). Its input is history's per-commit series: the median of the metric over each commit's ok
runs, commits ordered by their first run. A dirty tree is not a commit of the timeline and a commit with no
ok run has no value: both are left out of the series (the table still shows them).

Why these defaults:
- `max_pvalue` 0.001 is Otava's own default. A nightly job tests a longer series every night, and each
  test looks at every split of it, so the level of one test must be small for the job to stay quiet on an
  unchanged project (docs/ci-gate.md gives the false-alarm and detection rates measured on generated
  histories).
- `min_magnitude` is `harness compare`'s default threshold: a shift smaller than what the pull-request
  gate calls a regression is not alerted on by the nightly one either.
- `window` 50 is Otava's default: the E-divisive pass looks at 50 commits at a time (a shorter history at
  once), so a change is judged against its neighbourhood, not against the project's whole past.

Otava's package pins numpy and scipy to older releases than this project's, so it is not a declared
dependency: install it without its pins (`pip install --no-deps apache-otava`; the detector needs only
numpy and scipy). It is imported when `--detect` runs, and its absence is one line and exit 2.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from harness.analyze.compare import DEFAULT_THRESHOLD
from harness.usage import UsageError

DEFAULT_MAX_PVALUE = 0.001
DEFAULT_MIN_MAGNITUDE = DEFAULT_THRESHOLD
DEFAULT_WINDOW = 50
# A change point splits the series into two segments that each need two commits for a spread.
MIN_COMMITS = 4
INSTALL = "pip install --no-deps apache-otava==0.8.0"

# Which way is better, for the summary figures that have a direction (history's metric names). They agree
# with harness.analyze.export's customBiggerIsBetter / customSmallerIsBetter lists and with compare
# (throughput higher, step time and memory lower); tests/test_history_detect.py checks the agreement.
HIGHER_IS_BETTER = (
    "throughput_tokens_per_s",
    "throughput_samples_per_s",
    "per_device_tokens_per_s",
    "mfu",
)
LOWER_IS_BETTER = (
    "step_time_s.mean",
    "step_time_s.median",
    "step_time_s.min",
    "step_time_s.max",
    "step_time_s.p10",
    "step_time_s.p90",
    "first_step_s",
    "t_compute_s",
    "data_prep_s",
    "exposed_comm_ratio",
    "peak_rss_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "model_state_bytes_per_rank",
    "comm_bytes_per_rank_per_step",
    "minor_faults_per_step",
)


def higher_is_better(metric: str) -> bool | None:
    """True or False where the metric has a known direction, None where it has none (say `--better`)."""
    if metric in HIGHER_IS_BETTER:
        return True
    if metric in LOWER_IS_BETTER:
        return False
    return None


@dataclass(frozen=True)
class ChangePoint:
    index: int  # position in the series of the first commit after the change
    commit: str  # that commit
    previous: str  # the last commit before it
    before: float  # the metric's mean over the commits from the previous change point (or the start)
    after: float  # ... and up to the next one (or the end)
    pvalue: float
    verdict: str  # regression or improvement

    @property
    def change(self) -> float:
        return self.after / self.before - 1 if self.before else float("inf")


def otava_analysis() -> ModuleType:
    """otava.analysis, imported only when detection runs; its absence is a usage error naming the fix."""
    try:
        return importlib.import_module("otava.analysis")
    except ImportError:
        raise UsageError(f"--detect needs Apache Otava, which is not installed: {INSTALL}") from None


def detect(
    values: list[float],
    *,
    max_pvalue: float = DEFAULT_MAX_PVALUE,
    min_magnitude: float = DEFAULT_MIN_MAGNITUDE,
    window: int = DEFAULT_WINDOW,
) -> list[tuple[int, float, float, float]]:
    """Otava's change points of `values`: (index of the first value after the change, mean before, mean
    after, p-value), in order. The series goes in as a list of floats: Otava slices its sliding windows
    only out of a list (given an array, every window would be the whole series)."""
    analysis = otava_analysis()
    points, _weak = analysis.compute_change_points(
        [float(v) for v in values], window_len=window, max_pvalue=max_pvalue, min_magnitude=min_magnitude
    )
    return [
        (int(p.index), float(p.stats.mean_1), float(p.stats.mean_2), float(p.stats.pvalue)) for p in points
    ]


def series(rows: list[dict]) -> list[dict]:
    """history's rows that form the timeline: clean commits with a value."""
    return [r for r in rows if r["median"] is not None and not r["commit"].endswith("+dirty")]


def change_points(
    rows: list[dict],
    higher_better: bool,
    *,
    max_pvalue: float = DEFAULT_MAX_PVALUE,
    min_magnitude: float = DEFAULT_MIN_MAGNITUDE,
    window: int = DEFAULT_WINDOW,
) -> list[ChangePoint]:
    """The change points of history's rows (already reduced by `series`), each named by its first commit
    and judged by the metric's direction."""
    found = detect(
        [r["median"] for r in rows], max_pvalue=max_pvalue, min_magnitude=min_magnitude, window=window
    )
    return [
        ChangePoint(
            index=i,
            commit=rows[i]["commit"],
            previous=rows[i - 1]["commit"],
            before=before,
            after=after,
            pvalue=p,
            verdict="regression" if (after > before) != higher_better else "improvement",
        )
        for i, before, after, p in found
    ]


def describe(point: ChangePoint, metric: str) -> str:
    num = lambda x: f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"  # noqa: E731
    return (
        f"{point.commit} (first commit after {point.previous}): {point.change:+.1%} {metric}, "
        f"{num(point.before)} -> {num(point.after)}, p {point.pvalue:.2g}: {point.verdict}"
    )
