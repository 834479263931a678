"""The regression gate end to end, on real runs: the same code twice passes, a gross slowdown fails.

Live runs only carry gross claims here (a busy or slow machine must not fail a correct gate): the slowed runs
sleep twice A's median step time in every step (a throughput loss of about two thirds) and the gate's
threshold is 30% on each run's fastest step (`--statistic min`: contention only adds time), two runs a
side. The gate's statistics (power, false positives, the minimum detectable change) are tested on recorded
and generated data in tests/test_compare.py, not on live launches.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from harness.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timing]

RUN_ARGS = (
    "--backend torch-ddp --gpus 1 --workload tiny --steps 8 --warmup 1 --threads-per-worker 1 --timeout 120"
).split()
GATE = ["--statistic", "min", "--threshold", "0.30"]
DELAY_STEPS = 2.0  # the injected sleep, in A's median step times
REPEATS = 2


def side_by_side(*runs: tuple[Path, list[str]]) -> None:
    """`harness run ARGS --out OUT` for each (OUT, ARGS) at once, each 1-thread run on its own core."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "harness", "run", *args, "--out", str(out)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for out, args in runs
    ]
    for proc in procs:
        shown, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, shown


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Path, Path, Path, float]:
    """A, B (same code) and S (slowed) runs, two at a time on the two cores: each side runs once beside a
    run of its own speed and once beside a slowed one (A1|B1, A2|S1, B2|S2), so the sides see the same
    neighbours, and a drift of the machine hits every side."""
    root = tmp_path_factory.mktemp("gate")
    a, b, s = (root / side for side in "abs")
    side_by_side((a, RUN_ARGS), (b, RUN_ARGS))
    (first,) = [json.loads(f.read_text()) for f in a.glob("*.json")]
    delay = DELAY_STEPS * statistics.median(first["ranks"][0]["step_times"])
    slowed = [*RUN_ARGS, "--step-delay", f"{delay:.6f}"]
    side_by_side((a, RUN_ARGS), (s, slowed))
    side_by_side((b, RUN_ARGS), (s, slowed))
    return a, b, s, delay


def gate(a: Path, b: Path, out: Path) -> tuple[int, dict]:
    code = main(["compare", str(a), str(b), *GATE, "--json", str(out)])
    return code, json.loads(out.read_text())


def test_same_code_twice_is_no_regression(measured, tmp_path):
    a, b, _, _ = measured
    code, result = gate(a, b, tmp_path / "aa.json")
    throughput = result["comparisons"][0]["metrics"][0]
    assert (throughput["n_baseline"], throughput["n_candidate"]) == (REPEATS, REPEATS)
    assert code == 0, f"A/A flagged: {result['comparisons'][0]['metrics']}"
    assert result["result"] == "ok"


def test_injected_slowdown_is_a_regression(measured, tmp_path):
    a, b, s, delay = measured
    # The A and B runs (same code) together are the baseline: 4 runs vs 2.
    assert main(["baseline", "save", "aa", str(a), str(b), "--dir", str(tmp_path)]) == 0
    code, result = gate(tmp_path / "aa", s, tmp_path / "slow.json")
    throughput = result["comparisons"][0]["metrics"][0]
    assert (throughput["n_baseline"], throughput["n_candidate"], throughput["test"]) == (
        2 * REPEATS,
        REPEATS,
        "welch-t (log per-run values)",
    )
    assert code == 1 and throughput["verdict"] == "regression", throughput
    assert throughput["candidate_step_time_s"] - throughput["baseline_step_time_s"] > 0.5 * delay
    # The slowed runs say they were slowed: a test hook can never pass for the code's own speed.
    assert any("delay" in d for d in result["comparisons"][0]["environment_differences"])
