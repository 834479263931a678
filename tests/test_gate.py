"""`harness gate`: its sequential decision on generated paired data with a known shift, and the gate around
it with the runs faked (records written by hand), so nothing here launches a training run.

The error rates are counted over 2,000 simulated sequences per case, each looked at after every pair as the
gate looks, and held to the design's nominal levels with a one-sided binomial test (scipy.stats.binomtest,
at 1%): a rate significantly above alpha (or a detection rate significantly below 1 - beta) fails. The
counter-example is the rule the design replaces: a fixed 95% interval re-checked after every pair.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import record_factory as factory
from scipy.stats import binomtest, ttest_1samp
from scipy.stats import t as student_t

from core.records import write_json_atomic
from harness.analyze import paired, sequential
from harness.analyze.baseline import load_all
from harness.analyze.sequential import (
    CODE_CONTINUE,
    CODE_NO_REGRESSION,
    CODE_REGRESSION,
    INCONCLUSIVE,
    NO_REGRESSION,
    REGRESSION,
    Design,
    decide,
)
from harness.cli import main
from harness.gate import command, launching, trees
from harness.gate import pairs as gate_pairs
from harness.gate import verdict as gate_verdict
from harness.gate.pairs import CONFIG_FILE, FAILURES_FILE, PAIRS_FILE, Settings, order_of, run_gate
from harness.gate.verdict import VERDICT_FILE, VERDICT_MARKDOWN
from harness.usage import UsageError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

DESIGN = Design(threshold=0.05, max_pairs=40)
SLOWDOWN = math.log(1.05)  # the threshold as a mean log-ratio
SEQUENCES = 2000
TOLERANCE = 0.01  # a binomial p-value below this fails a rate


def sequences(shift: float, sd: float, seed: int, rows: int = SEQUENCES) -> np.ndarray:
    """Paired log-ratios with a known mean shift: one row per simulated gate, max_pairs columns."""
    return np.random.default_rng(seed).normal(shift, sd, (rows, DESIGN.max_pairs))


def count(rule, shift: float, sd: float, seed: int, code: int) -> tuple[int, int]:
    verdicts, _ = rule(sequences(shift, sd, seed), DESIGN)
    return int(np.sum(verdicts == code)), len(verdicts)


def check_false_alarms(sd: float, seed: int, shift: float = 0.0) -> None:
    """The gate's rule (looked up at call time, as the gate looks it up) on sequences without a slowdown:
    its REGRESSION rate must not be significantly above alpha."""
    k, n = count(sequential.decide_all, shift, sd, seed, CODE_REGRESSION)
    p = binomtest(k, n, DESIGN.alpha, alternative="greater").pvalue
    assert p > TOLERANCE, (
        f"false alarms {k}/{n} = {k / n:.3f} above alpha {DESIGN.alpha} (binomial p={p:.2g})"
    )


def fixed_interval_rule(x: np.ndarray, design: Design) -> tuple[np.ndarray, np.ndarray]:
    """The counter-example: a fixed 95% interval of the mean log-ratio, re-checked after every pair from
    the second on (tachometer's and cbdr's stopping rule): REGRESSION when it excludes 0, NO REGRESSION when
    it lies below the threshold (first, as in the design)."""
    rows, length = x.shape
    verdict, stop = np.full(rows, CODE_CONTINUE), np.full(rows, length)
    for n in range(2, length + 1):
        open_ = verdict == CODE_CONTINUE
        interval = ttest_1samp(x[:, :n], 0.0, axis=1).confidence_interval(0.95)
        no_regression = open_ & (interval.high < design.delta)
        regression = open_ & ~no_regression & (interval.low > 0)
        verdict[no_regression], verdict[regression] = CODE_NO_REGRESSION, CODE_REGRESSION
        stop[no_regression | regression] = n
    return verdict, stop


# ---- the sequential decision ----------------------------------------------------------------------------


@pytest.mark.parametrize("sd", [0.02, 0.05, 0.08, 0.15])
def test_false_alarms_within_alpha_with_a_look_after_every_pair(sd):
    """No slowdown, spreads from a quiet machine's to a noisy one's: REGRESSION at most alpha of the time,
    although every sequence is looked at after every pair up to the budget."""
    check_false_alarms(sd, seed=int(sd * 1000))


def test_false_alarms_within_alpha_when_the_head_is_faster():
    """H0 is "no slowdown", δ <= 0, not only δ = 0: a faster head is no more often a regression."""
    check_false_alarms(0.08, seed=7, shift=-0.02)


@pytest.mark.parametrize("sd", [0.02, 0.05])
def test_detects_a_slowdown_of_the_threshold(sd):
    """A 5% slowdown, at spreads the budget of 40 pairs can resolve: REGRESSION at least 1 - beta of the
    time."""
    k, n = count(sequential.decide_all, SLOWDOWN, sd, seed=11, code=CODE_REGRESSION)
    p = binomtest(k, n, 1 - DESIGN.beta, alternative="less").pvalue
    assert p > TOLERANCE, f"detected {k}/{n} = {k / n:.3f}, below 1 - beta (binomial p={p:.2g})"


def test_misses_at_most_beta_whatever_the_spread():
    """At a spread the budget cannot resolve, a 5% slowdown may end INCONCLUSIVE, but it is passed as NO
    REGRESSION at most beta of the time (the design's guarantee does not depend on the spread)."""
    verdicts, _ = sequential.decide_all(sequences(SLOWDOWN, 0.15, seed=13), DESIGN)
    k, n = int(np.sum(verdicts == CODE_NO_REGRESSION)), len(verdicts)
    assert binomtest(k, n, DESIGN.beta, alternative="greater").pvalue > TOLERANCE, f"{k}/{n} missed"
    assert np.mean(verdicts == CODE_CONTINUE) > 0.2  # the budget ran out: INCONCLUSIVE, not a pass


def test_a_fixed_interval_rechecked_after_every_pair_fails_the_false_alarm_check(monkeypatch):
    """The counter-example: re-checking a fixed 95% interval after every pair raises false alarms well
    above alpha, and the false-alarm check above fails when the gate's rule is replaced by it."""
    k, n = count(fixed_interval_rule, 0.0, 0.15, seed=150, code=CODE_REGRESSION)
    assert binomtest(k, n, DESIGN.alpha, alternative="greater").pvalue < 1e-6, f"{k}/{n}"
    monkeypatch.setattr(sequential, "decide_all", fixed_interval_rule)
    assert decide([0.02, 0.021], DESIGN).pairs == 2  # the gate now decides on the fixed interval
    with pytest.raises(AssertionError, match="above alpha"):
        check_false_alarms(0.15, seed=150)


def test_the_gates_decision_is_the_vectorised_one():
    """decide (one gate's pairs so far) reaches the verdict, at the pair, that decide_all reaches for the
    same sequence looked at pair by pair."""
    x = sequences(0.03, 0.05, seed=3, rows=20)
    codes, stops = sequential.decide_all(x, DESIGN)
    names = {CODE_REGRESSION: REGRESSION, CODE_NO_REGRESSION: NO_REGRESSION, CODE_CONTINUE: INCONCLUSIVE}
    for row, code, stop in zip(x, codes, stops):
        decision = decide(row, DESIGN)
        assert (decision.verdict, decision.pairs) == (names[int(code)], int(stop))
        if stop > DESIGN.min_pairs:  # fed pair by pair, it goes on until that pair
            assert decide(row[: stop - 1], DESIGN).verdict == "continue"


def test_interval_and_smallest_detectable_slowdown():
    """The repeated interval and, when the budget runs out, the smallest slowdown the pairs could have
    detected: (c_alpha(n) + t.isf(beta, n - 1)) s / sqrt(n), as a relative change."""
    x = 0.025 + 0.2 * (-1.0) ** np.arange(DESIGN.max_pairs)  # mean 2.5%, spread 0.2: never decides
    d = decide(x, DESIGN)
    assert d.verdict == INCONCLUSIVE and d.pairs == DESIGN.max_pairs
    n, se = len(x), np.std(x, ddof=1) / math.sqrt(len(x))
    p_alpha, p_beta = DESIGN.levels
    expected = math.expm1((student_t.isf(p_alpha, n - 1) + student_t.isf(DESIGN.beta, n - 1)) * se)
    assert d.detectable == pytest.approx(expected) and d.detectable > DESIGN.threshold
    low, high = d.interval
    assert low == pytest.approx(math.expm1(x.mean() - student_t.isf(p_alpha, n - 1) * se))
    assert high == pytest.approx(math.expm1(x.mean() + student_t.isf(p_beta, n - 1) * se))
    assert decide(x[:5], DESIGN, exhausted=True).verdict == INCONCLUSIVE
    assert decide(x[:2], DESIGN).verdict == "continue"  # before the first look nothing is decided


def test_nominal_level_is_below_alpha_and_deterministic():
    p_alpha, p_beta = DESIGN.levels
    assert 0 < p_alpha < DESIGN.alpha / 3 and p_alpha == p_beta  # alpha == beta: one level
    # one look: no peeking to pay for, the level is alpha itself (up to the simulation's error)
    assert Design(max_pairs=3).levels[0] == pytest.approx(DESIGN.alpha, abs=0.005)


# Designs with alpha != beta: with the two levels swapped anywhere in the code (calibration, decision,
# interval), the rate or bound of the smaller one fails below.
RARE_FALSE_ALARMS = Design(threshold=0.05, max_pairs=40, alpha=0.01, beta=0.10)
RARE_MISSES = Design(threshold=0.05, max_pairs=40, alpha=0.10, beta=0.01)


def rate(design: Design, shift: float, sd: float, seed: int, code: int) -> tuple[int, int]:
    x = np.random.default_rng(seed).normal(shift, sd, (SEQUENCES, design.max_pairs))
    verdicts, _ = sequential.decide_all(x, design)
    return int(np.sum(verdicts == code)), len(verdicts)


@pytest.mark.parametrize("design", [RARE_FALSE_ALARMS, RARE_MISSES], ids=["alpha<beta", "alpha>beta"])
def test_each_error_rate_holds_at_its_own_level(design):
    """REGRESSION without a slowdown at most alpha of the time, NO REGRESSION at a slowdown of the threshold
    at most beta, each at its own level: at a spread the budget cannot resolve, each rate comes near its
    level, so a swap of the levels puts the smaller one's rate well above it."""
    k, n = rate(design, 0.0, 0.15, seed=21, code=CODE_REGRESSION)
    p = binomtest(k, n, design.alpha, alternative="greater").pvalue
    assert p > TOLERANCE, f"false alarms {k}/{n} above alpha {design.alpha} (binomial p={p:.2g})"
    k, n = rate(design, SLOWDOWN, 0.15, seed=22, code=CODE_NO_REGRESSION)
    p = binomtest(k, n, design.beta, alternative="greater").pvalue
    assert p > TOLERANCE, f"misses {k}/{n} above beta {design.beta} (binomial p={p:.2g})"


def test_with_one_look_the_levels_are_alpha_and_beta_themselves():
    """One look pays nothing for peeking: the REGRESSION test's level is alpha, the NO REGRESSION test's
    beta (up to the calibration's Monte Carlo error)."""
    p_alpha, p_beta = Design(max_pairs=3, alpha=0.01, beta=0.10).levels
    assert p_alpha == pytest.approx(0.01, abs=0.002) and p_beta == pytest.approx(0.10, abs=0.005)


def test_the_interval_and_the_detectable_slowdown_take_each_level_where_it_belongs():
    """The repeated interval's lower end is the REGRESSION test's (alpha's level), its upper end the NO
    REGRESSION test's (beta's): with alpha < beta the lower side is the wider. The detectable slowdown adds
    t.isf(beta) to alpha's critical value: the power 1 - beta of the REGRESSION test."""
    design = RARE_FALSE_ALARMS
    x = 0.025 + 0.2 * (-1.0) ** np.arange(design.max_pairs)  # mean 2.5%, spread 0.2: never decides
    d = decide(x, design)
    assert d.verdict == INCONCLUSIVE and d.coverage == pytest.approx(1 - 0.01 - 0.10)
    n, mean, se = len(x), x.mean(), np.std(x, ddof=1) / math.sqrt(len(x))
    p_alpha, p_beta = design.levels
    low, high = d.interval
    assert low == pytest.approx(math.expm1(mean - student_t.isf(p_alpha, n - 1) * se))
    assert high == pytest.approx(math.expm1(mean + student_t.isf(p_beta, n - 1) * se))
    assert mean - math.log1p(low) > 1.2 * (math.log1p(high) - mean)
    power = student_t.isf(p_alpha, n - 1) + student_t.isf(design.beta, n - 1)
    assert d.detectable == pytest.approx(math.expm1(power * se))


def test_when_both_tests_decide_at_one_look_no_regression_wins():
    """Pairs tightly around +2.4%, between no slowdown and the 5% threshold: at the first look the test of
    "no slowdown" rejects (there is a slowdown) and so does the test of "5% or more" (it is smaller). The
    design gives NO REGRESSION precedence (a real slowdown ruled out to reach the threshold passes, as
    compare's threshold does), at that look, with an interval between 0 and the threshold."""
    x = np.log([1.0240, 1.0245, 1.0236])
    slower, under = sequential.look_pvalues(x[None, :], DESIGN.delta)
    p_alpha, p_beta = DESIGN.levels
    assert slower[0] < p_alpha and under[0] < p_beta  # both tests decide at this look
    codes, stops = sequential.decide_all(x[None, :], DESIGN)
    assert (int(codes[0]), int(stops[0])) == (CODE_NO_REGRESSION, 3)
    d = decide(x, DESIGN)
    assert (d.verdict, d.pairs) == (NO_REGRESSION, 3)
    low, high = d.interval
    assert 0 < low < d.change < high < DESIGN.threshold


# ---- the gate, its runs faked ------------------------------------------------------------------------


class FakeRuns:
    """A runner that writes a record instead of launching: every step of a run takes 100 ms x a lognormal
    factor (spread `sd`), x (1 + slowdown) on the head side; the factor comes from (side, pair), so a
    resumed gate sees the runs an uninterrupted one saw."""

    def __init__(
        self, out: Path, slowdown=0.0, sd=0.01, seed=0, status=None, summary=None, rss=None, stop_at=None,
        tag="",
    ):  # fmt: skip
        self.out, self.slowdown, self.sd, self.seed, self.tag = out, slowdown, sd, seed, tag
        self.status = status or {}
        self.summary = summary or {}  # side -> summary fields to overwrite
        self.rss = rss or {}
        self.stop_at = stop_at
        self.calls: list[tuple[str, int]] = []

    def __call__(self, side: str, k: int) -> launching.RunOutcome:
        if k == self.stop_at:
            raise KeyboardInterrupt
        self.calls.append((side, k))
        factor = math.exp(np.random.default_rng([self.seed, k, side == "head"]).normal(0, self.sd))
        step = 0.1 * factor * (1 + self.slowdown if side == "head" else 1)
        status = self.status.get(side, "ok")
        record = factory.make_record(
            gpus=2,
            step_time=step,
            status=status,
            run_id=f"pair{k}-{side}{self.tag}",
            peak_rss=self.rss.get(side, 400 << 20),
        )
        record["summary"].update(self.summary.get(side, {}))
        path = self.out / side / f"{record['run_id']}.json"
        write_json_atomic(path, record)
        (trimmed,) = load_all([path])
        message = "" if status == "ok" else "RuntimeError: injected fault at step 1"
        return launching.RunOutcome(0 if status == "ok" else 1, trimmed, path, message, 1.0)


def settings(design=DESIGN, run_args=("--backend", "torch-ddp"), order_seed=1234, **kw) -> Settings:
    """The gate's settings, with what identifies the experiment as the command line builds it."""
    match = {"run_args": list(run_args), "design": design.to_dict()}
    return Settings(design=design, order_seed=order_seed, match=match, **kw)


def every_30s():
    return itertools.count(step=30.0).__next__


def test_gate_reports_a_regression_with_its_size_and_interval(tmp_path):
    runs = FakeRuns(tmp_path, slowdown=0.20)
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert outcome.verdict == "REGRESSION" and outcome.exit_code == 1
    assert outcome.line.startswith("REGRESSION: step time +2") and "repeated 90% interval" in outcome.line
    low, high = outcome.decision.interval
    assert 0 < low < 0.20 < high
    pairs = [json.loads(line) for line in (tmp_path / PAIRS_FILE).read_text().splitlines()]
    assert len(pairs) == outcome.decision.pairs and len(runs.calls) == 2 * len(pairs)
    verdict = json.loads((tmp_path / VERDICT_FILE).read_text())
    assert verdict["verdict"] == "REGRESSION" and verdict["step_time"]["pairs"] == len(pairs)
    assert verdict["log_ratio_sd"] == pytest.approx(np.std([p["log_ratio"] for p in pairs], ddof=1))
    assert all((tmp_path / p[side]["record"]).is_file() for p in pairs for side in trees.SIDES)
    comment = (tmp_path / VERDICT_MARKDOWN).read_text()  # what the workflow posts on the pull request
    assert comment.startswith("### distbench gate: REGRESSION\n") and outcome.line in comment
    for shown in (
        gate_verdict.fmt_interval(outcome.decision.interval),
        f"| pairs | {len(pairs)} of at most",
        "detect |",
    ):
        assert shown in comment, shown


def test_gate_passes_the_same_code(tmp_path):
    outcome = run_gate(settings(), tmp_path, FakeRuns(tmp_path), say=lambda _: None)
    assert (outcome.verdict, outcome.exit_code) == ("NO REGRESSION", 0)
    assert "rules out a slowdown of 5% or more" in outcome.line
    lines = [d["line"] for d in outcome.details]
    assert "comm bytes per step: unchanged (4,287,488)" in lines
    assert any(line.startswith("peak RSS / rank:") and line.endswith(": ok") for line in lines)


def test_gate_passes_a_slowdown_below_the_threshold_that_both_tests_see(tmp_path):
    """A head 2.4% slower, every pair alike: at the first look both tests decide (a slowdown is there, and
    it is smaller than 5%); the gate passes it, exit 0, and says how large it is."""
    runs = FakeRuns(tmp_path, slowdown=0.024, sd=0.0002)
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert (outcome.verdict, outcome.exit_code, outcome.decision.pairs) == ("NO REGRESSION", 0, 3)
    assert outcome.line.startswith("NO REGRESSION: step time +2.4% [+2.")
    assert "rules out a slowdown of 5% or more (3 pair(s)" in outcome.line


def test_gate_runs_out_of_minutes_inconclusive_with_what_it_could_detect(tmp_path):
    runs = FakeRuns(tmp_path, slowdown=0.03, sd=0.1)
    s = settings(max_minutes=2.0, inconclusive_exit=7)
    outcome = run_gate(s, tmp_path, runs, say=lambda _: None, clock=every_30s())
    # 30 s a pair: a fifth pair would end past 2 minutes
    assert (outcome.verdict, outcome.exit_code, outcome.decision.pairs) == ("INCONCLUSIVE", 7, 4)
    assert "the budget (--max-minutes) ran out" in outcome.line
    assert f"could have detected a slowdown of {outcome.decision.detectable:.1%} or more" in outcome.line


def test_the_order_within_a_pair_is_seeded_and_varies():
    orders = [order_of(1234, k) for k in range(40)]
    assert orders == [order_of(1234, k) for k in range(40)]
    assert 10 < orders.count(("base", "head")) < 30
    assert orders != [order_of(99, k) for k in range(40)]


def test_a_head_run_failing_where_the_base_ran_is_a_regression(tmp_path):
    runs = FakeRuns(tmp_path, status={"head": "failed"})
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert (outcome.verdict, outcome.exit_code) == ("REGRESSION", 1)
    assert "a head run failed where the base ran: RuntimeError" in outcome.line
    (failure,) = [json.loads(line) for line in (tmp_path / FAILURES_FILE).read_text().splitlines()]
    assert failure["base"]["ok"] and not failure["head"]["ok"]


@pytest.mark.parametrize("failing", [("base",), ("base", "head")])
def test_base_runs_failing_is_bad_input(tmp_path, failing):
    runs = FakeRuns(tmp_path, status={side: "failed" for side in failing})
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert outcome.exit_code == 2 and outcome.line.startswith("harness: error:")
    assert "\n" not in outcome.line


def test_exact_metrics_any_change_is_reported_and_growth_fails(tmp_path):
    """Same speed, but the head sends twice the bytes per step and holds less model state: no statistics,
    the change is named, the growth fails the gate."""
    head = {"comm_bytes_per_rank_per_step": 2 * 4287488.0, "model_state_bytes_per_rank": 17_000_000}
    outcome = run_gate(settings(), tmp_path, FakeRuns(tmp_path, summary={"head": head}), say=lambda _: None)
    assert (outcome.verdict, outcome.exit_code) == ("REGRESSION", 1)
    lines = [d["line"] for d in outcome.details]
    assert "comm bytes per step changed: 4,287,488 -> 8,574,976 (+100.0%)" in lines
    assert "model-state bytes per rank changed: 17,149,952 -> 17,000,000 (-0.9%)" in lines
    assert "comm bytes per step changed" in outcome.line and "model-state" not in outcome.line


def test_peak_memory_keeps_its_threshold(tmp_path):
    runs = FakeRuns(tmp_path, rss={"head": 480 << 20})
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert outcome.exit_code == 1
    assert any(
        d["line"].startswith("peak RSS / rank") and d["verdict"] == "regression" for d in outcome.details
    )


def test_an_interrupted_gate_resumes_from_its_recorded_pairs(tmp_path):
    """Interrupted in its fourth pair, the gate keeps the three recorded; run again it runs from the fourth on
    and reaches the verdict, at the pair, of a gate never interrupted."""
    whole = run_gate(
        settings(), tmp_path / "whole", FakeRuns(tmp_path / "whole", 0.1, 0.05, seed=1), say=print
    )
    assert whole.verdict == "REGRESSION" and whole.decision.pairs > 4
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run_gate(settings(), out, FakeRuns(out, 0.1, 0.05, seed=1, stop_at=3), say=print)
    assert len((out / PAIRS_FILE).read_text().splitlines()) == 3
    said: list[str] = []
    again = FakeRuns(out, 0.1, 0.05, seed=1)
    resumed = run_gate(settings(), out, again, say=said.append)
    assert said[1] == f"resuming from 3 pair(s) recorded in {out}"
    assert min(k for _, k in again.calls) == 3
    assert (resumed.line, resumed.decision.pairs) == (whole.line, whole.decision.pairs)


def test_a_sigterm_stops_the_gate_between_runs_and_drops_the_pair(tmp_path, monkeypatch):
    """A SIGTERM (a scheduler's time limit, a cancelled job) in the middle of a pair: the pair's other run is
    not started, the stopped run is no evidence (not a failing head), the pairs before it stay."""
    runs = FakeRuns(tmp_path)
    monkeypatch.setattr(
        gate_pairs, "stopped", lambda: "SIGTERM from outside" if len(runs.calls) >= 5 else None
    )
    with pytest.raises(KeyboardInterrupt):
        run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert len(runs.calls) == 5
    assert len((tmp_path / PAIRS_FILE).read_text().splitlines()) == 2
    assert not (tmp_path / FAILURES_FILE).exists() and not (tmp_path / VERDICT_FILE).exists()
    # Resumed (each run's record named anew, as real runs are), the stopped pair's finished run is set
    # aside: base/ and head/ hold the gate's pairs and nothing else, for `harness compare` to read.
    (stray_side, _), said = runs.calls[4], []
    monkeypatch.setattr(gate_pairs, "stopped", lambda: None)
    run_gate(settings(), tmp_path, FakeRuns(tmp_path, tag="-again"), say=said.append)
    assert (tmp_path / "dropped" / stray_side / f"pair2-{stray_side}.json").is_file()
    assert "1 record(s) of a pair that did not finish moved to" in "\n".join(said)
    paired = {p[side]["record"] for p in gate_pairs.read_pairs(tmp_path) for side in trees.SIDES}
    assert {f"{side}/{f.name}" for side in trees.SIDES for f in (tmp_path / side).glob("*.json")} == paired


def test_resuming_another_gates_pairs_is_refused(tmp_path):
    run_gate(settings(), tmp_path, FakeRuns(tmp_path), say=lambda _: None)
    other = settings(run_args=["--backend", "torch-fsdp"])
    with pytest.raises(UsageError, match=r"holds the pairs of another gate \(run_args: \["):
        run_gate(other, tmp_path, FakeRuns(tmp_path), say=lambda _: None)
    threshold = settings(design=Design(threshold=0.1, max_pairs=DESIGN.max_pairs))
    with pytest.raises(UsageError, match=r"another gate \(design.threshold: 0.05 there, 0.1 here\)"):
        run_gate(threshold, tmp_path, FakeRuns(tmp_path), say=lambda _: None)
    with pytest.raises(UsageError, match="ordered with --order-seed 1234, not 99"):
        run_gate(settings(order_seed=99), tmp_path, FakeRuns(tmp_path), say=lambda _: None)


def test_cpu_time_is_a_companion_reported_beside_the_verdict_never_gated(tmp_path):
    """Where the head's steps take 30% more CPU time and the same wall time, the companion says +30% and
    the verdict stays NO REGRESSION; pairs without CPU times on both sides are left out of it."""
    pairs = [
        {"base": {"cpu_median_s": 0.1 * f}, "head": {"cpu_median_s": 0.13 * f}}
        for f in (1.0, 1.02, 0.99, 1.01)
    ]
    pairs.append({"base": {"cpu_median_s": None}, "head": {"cpu_median_s": 0.2}})
    cpu = paired.cpu_companion(pairs, DESIGN)
    assert cpu["pairs"] == 4 and cpu["change"] == pytest.approx(0.30, abs=1e-9)
    assert paired.cpu_companion(pairs[-2:], DESIGN) is None  # one usable pair: no spread to read
    runs = FakeRuns(tmp_path)
    real = runs.__call__

    def with_cpu(side, k):
        run = real(side, k)
        run.record["step_cpu_times_s"] = [0.1 * (1.3 if side == "head" else 1.0)] * 5
        return run

    outcome = run_gate(settings(), tmp_path, with_cpu, say=lambda _: None)
    assert outcome.verdict == "NO REGRESSION"
    (line,) = [d["line"] for d in outcome.details if d["metric"] == "CPU time per step"]
    assert line.startswith("CPU time per step (companion, not gated): +30.0%")


# ---- the part of the step that moved ----------------------------------------------------------------

# A one-rank run's parts in seconds: the measured step is their sum unless a test says otherwise.
PARTS = {"forward": 0.030, "backward": 0.050, "optimizer": 0.015, "rest": 0.005}
TIMED = {"forward": "forward_times", "backward": "backward_times", "optimizer": "optimizer_step_times"}


class PartRuns:
    """A runner whose one-rank runs time each part of their step in three anatomy steps: the parts around
    PARTS, `sides[side]` changing some of them (the key "step": the measured step's seconds, the timed parts
    left as they are); every run draws a launch factor and every step and part its own (spread `sd`)."""

    def __init__(self, out: Path, sides: dict, sd=0.01, seed=0):
        self.out, self.sides, self.sd, self.seed = out, sides, sd, seed

    def __call__(self, side: str, k: int) -> launching.RunOutcome:
        rng = np.random.default_rng([self.seed, k, side == "head"])
        parts = {**PARTS, **self.sides.get(side, {})}
        step = parts.pop("step", None) or sum(parts.values())
        launch = rng.lognormal(0, self.sd)
        rank = factory.rank_record(0, step * launch * rng.lognormal(0, self.sd, 20)) | {
            key: list(parts[p] * launch * rng.lognormal(0, self.sd, 3)) for p, key in TIMED.items()
        }
        cfg = factory.config("torch-ddp", 1, steps=20, warmup=1, threads_per_worker=1)
        record = factory.assemble(cfg, f"pair{k}-{side}", [rank], environment=factory.environment())
        path = self.out / side / f"{record['run_id']}.json"
        write_json_atomic(path, record)
        (trimmed,) = load_all([path])
        return launching.RunOutcome(0, trimmed, path, "", 1.0)


@pytest.mark.parametrize("part", ["optimizer", "forward"])
def test_a_regression_names_the_part_that_moved_with_its_change_over_the_pairs(tmp_path, part):
    """The head's `part` takes 30 ms more of a 100 ms step: the REGRESSION names that part, with the
    median of the pairs' changes (+30 ms, inside its interval over the pairs, which excludes zero); the
    figures are in verdict.json, its markdown and what the command prints."""
    runs = PartRuns(tmp_path, {"head": {part: PARTS[part] + 0.030}})
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert outcome.verdict == "REGRESSION"
    moved = outcome.anatomy["parts"][part]
    low, high = moved["ci"]
    assert outcome.anatomy["moved"] == part and 0 < low < 0.030 < high
    assert moved["s"] == pytest.approx(0.030, rel=0.1) and moved["share"] == pytest.approx(0.3, rel=0.1)
    assert all(abs(p["s"]) < 0.005 for name, p in outcome.anatomy["parts"].items() if name != part)
    interval = f"[{low * 1e3:+.1f}, {high * 1e3:+.1f}]"
    said = f"{part} +{moved['s'] * 1e3:.1f} ms ({moved['share']:+.1%} of the step) {interval}"
    assert f"(repeated 90% interval); {said}, the part that moved (" in outcome.line
    verdict = json.loads((tmp_path / VERDICT_FILE).read_text())
    assert verdict["anatomy"]["moved"] == part and verdict["anatomy"]["pairs"] == outcome.decision.pairs
    comment = (tmp_path / VERDICT_MARKDOWN).read_text()
    assert f"| {part}, head against base | {said} |" in comment
    assert f"| which part moved | {said}, the part that moved most |" in comment
    pairs = [json.loads(line) for line in (tmp_path / PAIRS_FILE).read_text().splitlines()]
    assert all(
        p[side]["anatomy"]["parts"][part]["status"] == "measured" for p in pairs for side in trees.SIDES
    )
    # what a gate resumed from those pairs alone (their records gone) reports
    again = paired.part_changes(pairs[: outcome.decision.pairs])
    assert again["parts"][part]["s"] == moved["s"] and gate_verdict.anatomy_text(again).startswith(
        "step anatomy, head against base: forward "
    )


def test_an_unresolved_part_is_never_named(tmp_path):
    """The base's timed parts add up to more than its step (its rest negative beyond the noise: unresolved);
    the head's step is 30 ms longer, its parts timed as the base's. Only the rest changed, and since it is
    unresolved in the base runs it is neither compared nor named: the REGRESSION says no part's slowdown is
    resolved."""
    runs = PartRuns(
        tmp_path, {"base": {"step": 0.100, "backward": 0.075}, "head": {"step": 0.130, "backward": 0.075}}
    )
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert outcome.verdict == "REGRESSION" and outcome.anatomy["moved"] is None
    assert "(repeated 90% interval); no part's slowdown is resolved from zero (" in outcome.line
    other = outcome.anatomy["parts"]["other"]
    pairs = outcome.decision.pairs
    assert other["status"] == "unresolved" and other["s"] is None and not other["moved"]
    assert other["note"] == f"unresolved in {pairs} of {2 * pairs} runs: negative beyond its noise"


def test_a_faster_head_names_the_part_that_sped_up_and_old_pairs_have_no_parts(tmp_path):
    runs = PartRuns(tmp_path, {"head": {"backward": 0.020}})
    outcome = run_gate(settings(), tmp_path, runs, say=lambda _: None)
    assert outcome.verdict == "NO REGRESSION" and outcome.anatomy["moved"] == "backward"
    assert "; faster: backward -30." in outcome.line and "the part that moved (" in outcome.line
    # pairs recorded before the gate kept the parts: every part n/a, none named
    old = [{"base": {"statistic": 0.1}, "head": {"statistic": 0.1}}] * 3
    assert {p["status"] for p in paired.part_changes(old)["parts"].values()} == {"n/a"}


# ---- duet: both sides at once, each on its half of the node ------------------------------------------


def test_duet_splits_the_node_in_halves_and_swaps_them_every_pair(monkeypatch):
    monkeypatch.setattr(launching.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    monkeypatch.setattr(launching.shutil, "which", lambda name: f"/usr/bin/{name}")
    duet = launching.plan_duet("cpu", 2, 1, 1)
    assert duet.halves == (("0", "1"), ("2", "3"))  # the odd core left out: the halves are the same size
    assert duet.placement("base", 0).prefix == ["taskset", "--cpu-list", "0,1"]
    assert duet.placement("head", 0).prefix == ["taskset", "--cpu-list", "2,3"]
    assert duet.placement("base", 1).half == ("2", "3") and duet.placement("head", 1).half == ("0", "1")
    with pytest.raises(UsageError, match=r"--duet on a CPU needs 2 x 4 cores \(ranks x threads a side\)"):
        launching.plan_duet("cpu", 2, 2, 1)
    monkeypatch.setattr(launching, "visible_mask", lambda: ["4", "5", "6", "7"])
    duet = launching.plan_duet("cuda", 2, None, 1)
    assert (
        duet.placement("head", 0).env == {"CUDA_VISIBLE_DEVICES": "6,7"}
        and not duet.placement("head", 0).prefix
    )
    with pytest.raises(UsageError, match=r"--duet needs 2 x 3 GPUs \(one half a side\); 4 visible"):
        launching.plan_duet("cuda", 3, None, 1)
    with pytest.raises(UsageError, match="takes no --nodes"):
        launching.plan_duet("cuda", 1, None, 2)


def test_a_duet_gate_runs_both_sides_of_a_pair_at_once_and_records_their_halves(tmp_path):
    """Each fake run waits at a barrier for the other side's: run one after the other, it would break."""
    meet = threading.Barrier(2, timeout=10)
    runs = FakeRuns(tmp_path, slowdown=0.20)

    def together(side, k):
        meet.wait()
        return runs(side, k)

    duet = launching.Duet("cpu", (("0",), ("1",)))
    outcome = run_gate(settings(duet=duet), tmp_path, together, say=lambda _: None)
    assert outcome.verdict == "REGRESSION"
    pairs = [json.loads(line) for line in (tmp_path / PAIRS_FILE).read_text().splitlines()]
    assert [p["duet"] for p in pairs[:2]] == [{"base": ["0"], "head": ["1"]}, {"base": ["1"], "head": ["0"]}]


def test_duet_without_room_for_both_sides_is_one_line_exit_2(capsys, nothing_launches, monkeypatch):
    monkeypatch.setattr(launching.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    code, err = gate_cli(capsys, "--base", "HEAD", "--head", ".", "--device", "cpu", "--duet")
    assert code == 2 and err.count("\n") == 1 and "--duet on a CPU needs 2 x 2 cores" in err, err


# ---- the worktrees of ref sides ------------------------------------------------------------------------

# A gate in the middle of its pairs, as far as its worktree goes: TREE's checked_out holds the worktree of
# commit argv[4] of repository argv[2] (temporary folders under argv[3]) until it is killed.
CHECKED_OUT_UNTIL_KILLED = """
import sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
tempfile.tempdir = sys.argv[3]
from harness.gate.trees import Tree, checked_out
tree = Tree("base", "HEAD", "ref", sys.argv[4])
with checked_out([tree], Path(sys.argv[2])):
    print(tree.path, flush=True)
    time.sleep(120)
"""


def a_repository(tmp_path: Path) -> tuple[Path, str]:
    """A git repository of one commit, and that commit."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("a repository to check out\n")
    for args in (["init", "-q"], ["add", "README"], ["commit", "-q", "-m", "one"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True)
    return repo, trees.git("rev-parse", "HEAD", cwd=repo).stdout.strip()


def registered(repo: Path) -> list[Path]:
    """The worktrees `git worktree list` shows (the repository's own first)."""
    return [Path(p).resolve() for p in trees.worktrees(repo)]


@pytest.mark.subprocess
def test_the_next_gate_removes_the_worktree_a_killed_gate_left(tmp_path, monkeypatch):
    """A gate killed with SIGKILL cannot remove its worktree; the next gate (a resumed one, say) removes it,
    folder and registration, before it checks out its own, and leaves nothing registered when it ends."""
    repo, commit = a_repository(tmp_path)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    argv = [sys.executable, "-c", CHECKED_OUT_UNTIL_KILLED, str(REPO), str(repo), str(temp), commit]
    killed = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None
    left = Path(killed.stdout.readline().strip()).resolve()
    killed.kill()
    killed.wait()
    assert registered(repo) == [repo.resolve(), left] and left.is_dir()  # what the killed gate left
    tree = trees.Tree("head", "HEAD", "ref", commit)
    with trees.checked_out([tree], repo):
        assert registered(repo) == [repo.resolve(), tree.path.resolve()]
    assert registered(repo) == [repo.resolve()]
    assert not left.exists() and not any(temp.iterdir())


@pytest.mark.subprocess  # git
def test_a_dirty_directory_side_is_identified_by_its_uncommitted_changes(tmp_path):
    """`--head .` with uncommitted edits, edited again: another side for gate.json and the default --out,
    so the pairs of the earlier edit are never resumed as this code's; a clean tree has no digest."""
    repo, commit = a_repository(tmp_path)
    (repo / "harness").mkdir()
    (repo / "harness" / "__main__.py").write_text("")
    clean = trees.resolve_tree("head", str(repo), None).describe()
    assert clean == {"kind": "dir", "spec": str(repo), "commit": commit, "path": str(repo.resolve())}
    (repo / "README").write_text("an edit\n")
    first = trees.resolve_tree("head", str(repo), None).describe()
    (repo / "README").write_text("another edit\n")
    second = trees.resolve_tree("head", str(repo), None).describe()
    assert first["changes"] != second["changes"] and first == {**second, "changes": first["changes"]}
    assert trees.resolve_tree("head", str(repo), None).describe() == second  # the same edit: resumable


@pytest.mark.subprocess
def test_a_running_gates_worktree_is_left_alone(tmp_path, monkeypatch):
    """Two gates side by side on one repository: the second leaves the first's worktree be."""
    repo, commit = a_repository(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, second = trees.Tree("base", "HEAD", "ref", commit), trees.Tree("base", "HEAD", "ref", commit)
    with trees.checked_out([first], repo):
        with trees.checked_out([second], repo):
            assert set(registered(repo)) == {repo.resolve(), first.path.resolve(), second.path.resolve()}
        assert registered(repo) == [repo.resolve(), first.path.resolve()] and first.path.is_dir()
    assert registered(repo) == [repo.resolve()]


# ---- the command line: bad input, one line, exit 2, nothing launched ----------------------------------


@pytest.fixture
def nothing_launches(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a run or probe was started")

    monkeypatch.setattr(command, "launch_run", refuse)
    monkeypatch.setattr(command, "probe_tree", refuse)


def gate_cli(capsys, *args) -> tuple[int, str]:
    code = main(["gate", "--backend", "torch-ddp", "--gpus", "2", *args])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--threshold", "7"], "--threshold: expected a value between 0 and 1"),
        (["--threshold", "5 percent"], "--threshold: expected a fraction"),
        (["--max-pairs", "2"], "--max-pairs: expected a number of pairs from 3 (the first look) to 100"),
        (["--max-pairs", "101"], "--max-pairs: expected a number of pairs from 3 (the first look) to 100"),
        (["--max-minutes", "0"], "--max-minutes: expected a number of seconds > 0"),
        (["--inconclusive-exit", "300"], "--inconclusive-exit: expected an exit code 0-125"),
        (["--statistic", "p99"], "invalid choice: 'p99'"),
        (["--run-id", "x"], "unrecognized arguments: --run-id"),
    ],
)
def test_bad_options_one_line_exit_2(capsys, nothing_launches, args, says):
    code, err = gate_cli(capsys, "--base", "HEAD", "--head", ".", *args)
    assert code == 2 and says in err and err.count("\n") == 1, err


@pytest.mark.subprocess
def test_a_ref_that_does_not_exist(capsys, nothing_launches):
    code, err = gate_cli(capsys, "--base", "no-such-ref-anywhere", "--head", ".")
    assert code == 2 and err.count("\n") == 1
    assert "--base no-such-ref-anywhere: not a directory, nor a commit" in err


@pytest.mark.subprocess
def test_a_directory_without_a_harness(capsys, nothing_launches, tmp_path):
    code, err = gate_cli(capsys, "--base", "HEAD", "--head", str(tmp_path))
    assert code == 2 and "a directory without a distbench harness" in err and err.count("\n") == 1


@pytest.mark.subprocess
def test_a_sides_run_is_its_trees_harness_read_back_trimmed(tmp_path):
    """launch_run starts the tree's own `harness run ARGS --out OUT` (harness.run.child), its output in the
    log: an ok record comes back trimmed, as compare reads it; a refusal (exit 2, no record) as its line."""
    template = tmp_path / "record.template"
    write_json_atomic(template, factory.make_record(gpus=2, step_time=0.1, run_id="side-run"))
    folder = tmp_path / "tree"
    (folder / "harness").mkdir(parents=True)
    (folder / "harness" / "__init__.py").write_text("")
    (folder / "harness" / "__main__.py").write_text(
        "import shutil, sys\n"
        "args = sys.argv[1:]\n"
        "if '--refuse' in args:\n"
        "    print(\"harness: error: unknown workload 'huge'\", file=sys.stderr)\n"
        "    sys.exit(2)\n"
        "print('ran', *args)\n"
        f"shutil.copy({str(template)!r}, args[args.index('--out') + 1] + '/side-run.json')\n"
    )
    tree = trees.Tree("base", str(folder), "dir", None, folder)
    out, log = tmp_path / "out" / "base", tmp_path / "out" / "logs" / "pair-000-base.log"
    run = launching.launch_run(tree, ["--backend", "torch-ddp"], out, log)
    assert run.ok and run.path == out / "side-run.json" and run.message == ""
    assert run.record["step_times_s"] == pytest.approx([0.1] * len(run.record["step_times_s"]))
    assert "ranks" not in run.record  # trimmed
    assert log.read_text().startswith(f"ran run --backend torch-ddp --out {out}")
    refused = launching.launch_run(tree, ["--refuse"], out, log)
    assert (refused.returncode, refused.record, refused.message) == (2, None, "unknown workload 'huge'")


def gate_a_fake_tree(capsys, monkeypatch, tmp_path, main_py: str) -> tuple[int, str]:
    """The gate's command line on a tree whose harness/__main__.py is `main_py`, both sides; no run may
    launch."""
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "__init__.py").write_text("")
    (tmp_path / "harness" / "__main__.py").write_text(main_py)
    monkeypatch.setattr(command, "launch_run", lambda *a, **k: pytest.fail("a run was launched"))
    return gate_cli(capsys, "--base", str(tmp_path), "--head", str(tmp_path), "--out", str(tmp_path / "o"))


@pytest.mark.subprocess
def test_a_tree_whose_harness_is_too_old(capsys, monkeypatch, tmp_path):
    """A harness without `plan` whose `run` lacks a flag given: one line naming the flag."""
    code, err = gate_a_fake_tree(
        capsys,
        monkeypatch,
        tmp_path,
        "import sys\n"
        "if sys.argv[1:] == ['run', '--help']:\n"
        "    print('usage: harness run --backend BACKEND [--out OUT]')\n"
        "    sys.exit(0)\n"
        "print(\"harness: error: argument command: invalid choice: 'plan'\", file=sys.stderr)\n"
        "sys.exit(2)\n",
    )
    assert code == 2 and err.count("\n") == 1
    assert "its harness is too old: `harness run` does not take --gpus" in err


@pytest.mark.subprocess
def test_a_tree_that_refuses_the_run_arguments(capsys, monkeypatch, tmp_path):
    """`harness plan ARGS` (the tree's dry run) refusing: its one line, exit 2, nothing launched."""
    code, err = gate_a_fake_tree(
        capsys,
        monkeypatch,
        tmp_path,
        "import sys\n"
        "print(\"harness: error: unknown workload 'huge'; valid: tiny\", file=sys.stderr)\n"
        "sys.exit(2)\n",
    )
    assert code == 2 and err.count("\n") == 1
    assert f"--base {tmp_path}: its harness refuses the run arguments: unknown workload 'huge'" in err


@pytest.mark.subprocess
def test_the_command_line_passes_run_arguments_to_each_side(capsys, monkeypatch, tmp_path):
    """The run arguments reach both sides as given (the gate's own options taken out), --head-args the head
    only; a git ref is checked out as a worktree whose own harness is imported, and removed at the end."""
    seen: dict[str, list[str]] = {}
    probed: list[Path] = []
    real_probe = command.probe_tree

    def probe(tree, args):  # the real probe: the worktree's harness imported, its `harness plan` run
        real_probe(tree, args)
        probed.append(tree.path)

    def launch(tree, args, out, log, place=None):
        seen[tree.side] = args
        return FakeRuns(out.parent, slowdown=0.0)(tree.side, int(log.name.split("-")[1]))

    monkeypatch.setattr(command, "probe_tree", probe)
    monkeypatch.setattr(command, "launch_run", launch)
    out = tmp_path / "gate"
    code = main(
        ["gate", "--base", "HEAD", "--backend", "torch-ddp", "--head", "HEAD", "--workload", "tiny",
         "--threshold", "10%", "--head-args", "--step-delay 0.01", "--gpus", "2", "--out", str(out)]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and printed.splitlines()[-1].startswith("NO REGRESSION"), printed
    assert seen["base"] == ["--backend", "torch-ddp", "--workload", "tiny", "--gpus", "2"]
    assert seen["head"] == seen["base"] + ["--step-delay", "0.01"]
    (worktree,) = set(probed)  # one worktree for both sides of the same commit
    assert not worktree.exists()
    assert json.loads((out / CONFIG_FILE).read_text())["match"]["head_args"] == ["--step-delay", "0.01"]
