"""The sequential decision of `harness gate`: is the head slower than the base by the threshold or more?

The data are paired log-ratios, one per pair of runs: x_i = log(stat_head / stat_base). The hypotheses are
H0 "no slowdown" (mean δ <= 0) and H1 "a slowdown of at least the threshold" (δ >= log(1 + threshold)),
tested after every pair, so that the gate stops as soon as the evidence decides.

The design: two one-sided t-tests, each repeated after every pair against one nominal level for all looks
(a Pocock-type group-sequential boundary with a look after every pair), that level calibrated by
simulation so that the error rates hold over all the looks together:

- REGRESSION when the test of "δ <= 0" rejects at look n: `ttest_1samp(x, 0, alternative="greater")`
  has p < p_alpha;
- NO REGRESSION when the test of "δ >= log(1 + threshold)" rejects: `ttest_1samp(x, log(1 + threshold),
  alternative="less")` has p < p_beta (it takes precedence: a slowdown that is real but ruled out to reach
  the threshold passes, as compare's threshold does);
- INCONCLUSIVE when `max_pairs` looks (or the gate's time budget) pass without either.

Why it holds under peeking: the one-sample t statistic of normal data at its null mean has a distribution
that does not depend on the unknown spread (a pivot), and so does the whole sequence of them, look after
look. The chance that any of the looks min_pairs..max_pairs crosses one nominal level p is therefore one
number per (p, looks), whatever the spread, and p_alpha is the alpha-quantile of the smallest p-value over
the looks of simulated standard-normal sequences (likewise p_beta). False alarms at δ <= 0 are then at
most alpha, missed slowdowns of the threshold or more (NO REGRESSION at δ >= the threshold) at most beta,
with every pair looked at. The two stops only cut each other's sequences short, which lowers both rates.

The repeated interval [mean - c_alpha(n) se, mean + c_beta(n) se], c(n) = t.isf(p, n - 1), is the same
rule read as an interval: REGRESSION when it excludes 0, NO REGRESSION when it lies below the threshold;
it covers δ at every look at once with probability at least 1 - alpha - beta.

Everything here is pure (numpy arrays in, verdicts out) and launches nothing: `harness gate` feeds it the
pairs it runs, tests/test_gate.py feeds it generated sequences.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t
from scipy.stats import ttest_1samp

ALPHA = 0.05  # nominal false-alarm rate: REGRESSION when there is no slowdown
BETA = 0.05  # nominal miss rate: NO REGRESSION when the slowdown is the threshold or more
MIN_PAIRS = 3  # the first look: a t-test needs 2, and 2 pairs' spread is a poor guide to the next ones
SIMULATIONS = 40_000  # sequences the nominal levels are calibrated on (the level's Monte Carlo error: ~0.1%)
CALIBRATION_SEED = 0

REGRESSION, NO_REGRESSION, CONTINUE, INCONCLUSIVE = "regression", "no regression", "continue", "inconclusive"
# decide_all's verdict codes
CODE_CONTINUE, CODE_REGRESSION, CODE_NO_REGRESSION = 0, 1, 2


@functools.lru_cache(maxsize=16)
def nominal_levels(
    alpha: float, beta: float, max_pairs: int, min_pairs: int = MIN_PAIRS
) -> tuple[float, float]:
    """(p_alpha, p_beta): the per-look levels at which the chance that any look from min_pairs to
    max_pairs crosses is alpha (beta) for normal log-ratios at the null mean. Deterministic (fixed seed),
    cached: a few seconds for 40 looks."""
    if not 2 <= min_pairs <= max_pairs:
        raise ValueError(f"need 2 <= min_pairs <= max_pairs, got {min_pairs}, {max_pairs}")
    z = np.random.default_rng(CALIBRATION_SEED).standard_normal((SIMULATIONS, max_pairs))
    smallest = np.ones(SIMULATIONS)
    for n in range(min_pairs, max_pairs + 1):
        np.minimum(smallest, ttest_1samp(z[:, :n], 0.0, axis=1, alternative="greater").pvalue, out=smallest)
    return float(np.quantile(smallest, alpha)), float(np.quantile(smallest, beta))


@dataclass(frozen=True)
class Design:
    """The gate's hypotheses and error rates; `levels` calibrates them (nominal_levels)."""

    threshold: float = 0.05  # the slowdown H1 names: stat_head / stat_base >= 1 + threshold
    max_pairs: int = 40
    alpha: float = ALPHA
    beta: float = BETA
    min_pairs: int = MIN_PAIRS

    @property
    def delta(self) -> float:
        """The threshold as a mean log-ratio."""
        return math.log1p(self.threshold)

    @property
    def levels(self) -> tuple[float, float]:
        return nominal_levels(self.alpha, self.beta, self.max_pairs, self.min_pairs)

    def to_dict(self) -> dict:
        p_alpha, p_beta = self.levels
        return {
            "design": "two one-sided t-tests at one nominal level per look, calibrated by simulation",
            "threshold": self.threshold,
            "alpha": self.alpha,
            "beta": self.beta,
            "min_pairs": self.min_pairs,
            "max_pairs": self.max_pairs,
            "nominal_level_regression": p_alpha,
            "nominal_level_no_regression": p_beta,
        }


def look_pvalues(x: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """At one look (rows: sequences, columns: the pairs so far): the p-values of the test of "no slowdown"
    and of the test of "a slowdown of delta or more". A sequence whose pairs are all equal has no spread:
    its t statistic is infinite (p 0 or 1) or undefined (p nan, deciding nothing)."""
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # scipy's "nearly identical" precision warning
        slower = ttest_1samp(x, 0.0, axis=1, alternative="greater").pvalue
        under = ttest_1samp(x, delta, axis=1, alternative="less").pvalue
    return np.asarray(slower, float), np.asarray(under, float)


def decide_all(x: np.ndarray, design: Design) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence (a row of log-ratios) looked at after every pair, from the design's first look to
    its last (or the row's end): each row's verdict code (CODE_*) and the pairs it stopped at (the row's
    length, capped at max_pairs, where it did not stop)."""
    x = np.atleast_2d(np.asarray(x, float))
    rows, length = x.shape
    last = min(length, design.max_pairs)
    p_alpha, p_beta = design.levels
    verdict = np.full(rows, CODE_CONTINUE)
    stop = np.full(rows, last)
    for n in range(design.min_pairs, last + 1):
        open_ = verdict == CODE_CONTINUE
        if not open_.any():
            break
        slower, under = look_pvalues(x[:, :n], design.delta)
        no_regression = open_ & (under < p_beta)
        regression = open_ & ~no_regression & (slower < p_alpha)
        verdict[no_regression] = CODE_NO_REGRESSION
        verdict[regression] = CODE_REGRESSION
        stop[no_regression | regression] = n
    return verdict, stop


@dataclass
class Decision:
    verdict: str  # REGRESSION | NO_REGRESSION | CONTINUE | INCONCLUSIVE
    pairs: int  # the pairs the verdict rests on
    change: float | None  # exp(mean log-ratio) - 1: the head's step time against the base's
    interval: tuple[float, float] | None  # the repeated interval of `change` (1 - alpha - beta)
    detectable: float | None  # the smallest slowdown these pairs detect with probability 1 - beta
    coverage: float  # 1 - alpha - beta

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "pairs": self.pairs,
            "change": self.change,
            "interval": list(self.interval) if self.interval else None,
            "detectable": self.detectable,
            "interval_coverage": self.coverage,
        }


def estimate(x: np.ndarray, design: Design) -> tuple[float | None, tuple | None, float | None]:
    """(change, repeated interval, smallest detectable slowdown) of the pairs `x`, relative (exp - 1).
    The detectable slowdown at n pairs with spread s: (c_alpha(n) + t.isf(beta, n - 1)) s / sqrt(n), the
    mean log-ratio at which this look's REGRESSION test crosses with probability 1 - beta (the earlier
    looks only add to that chance)."""
    n = len(x)
    if n == 0:
        return None, None, None
    mean = float(np.mean(x))
    if n < 2:
        return math.expm1(mean), None, None
    p_alpha, p_beta = design.levels
    se = float(np.std(x, ddof=1)) / math.sqrt(n)
    low = mean - float(student_t.isf(p_alpha, n - 1)) * se
    high = mean + float(student_t.isf(p_beta, n - 1)) * se
    detectable = (float(student_t.isf(p_alpha, n - 1)) + float(student_t.isf(design.beta, n - 1))) * se
    return math.expm1(mean), (math.expm1(low), math.expm1(high)), math.expm1(detectable)


def decide(log_ratios, design: Design, exhausted: bool = False) -> Decision:
    """The verdict on the pairs so far, every earlier look included: the first look that decides decides
    (a gate resumed from recorded pairs reaches the verdict it would have reached running). `exhausted`:
    the budget allows no further pair, so an undecided gate is INCONCLUSIVE (as it is at max_pairs)."""
    x = np.asarray(log_ratios, float)
    verdict, n = CONTINUE, min(len(x), design.max_pairs)
    if len(x) >= design.min_pairs:
        codes, stops = decide_all(x[None, :], design)
        if codes[0] != CODE_CONTINUE:
            verdict = REGRESSION if codes[0] == CODE_REGRESSION else NO_REGRESSION
            n = int(stops[0])
    if verdict == CONTINUE and (exhausted or len(x) >= design.max_pairs):
        verdict = INCONCLUSIVE
    change, interval, detectable = estimate(x[:n], design)
    return Decision(verdict, n, change, interval, detectable, round(1 - design.alpha - design.beta, 9))
