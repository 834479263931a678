"""`harness history --detect`: change points across commits (Apache Otava's E-divisive), on generated
records whose every commit's value is drawn from a known distribution, with a step injected at a known
commit or none at all. Seeds are fixed, so each history is the same on every run."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import uuid

import numpy as np
import pytest
import record_factory as factory

from core.records import write_json_atomic
from harness.analyze import changepoints
from harness.analyze.history import metric_names
from harness.cli import main

pytestmark = pytest.mark.unit

needs_otava = pytest.mark.skipif(
    importlib.util.find_spec("otava") is None, reason=f"Apache Otava is not installed: {changepoints.INSTALL}"
)
SPREAD = 0.02  # commit-to-commit spread of a run's step time (log-normal sigma)
COMMITS, STEP_AT = 20, 12
BASE = ["history", "--backend", "torch-ddp", "--workload", "tiny", "--gpus", "1"]


def commit(i: int) -> str:
    return hashlib.sha1(f"commit {i}".encode()).hexdigest()


def record(step_time: float, sha: str, start: str, *, dirty: bool = False) -> dict:
    """One ok run of torch-ddp tiny on 1 rank whose every step took `step_time`, at commit `sha`."""
    cfg = factory.config("torch-ddp", 1, steps=factory.STEPS, threads_per_worker=1)
    ranks = [factory.rank_record(0, [step_time] * factory.STEPS)]
    env = factory.environment(start_time=start, commit=sha)
    env["git"]["dirty"] = dirty
    return factory.assemble(cfg, f"run-{uuid.uuid4().hex[:8]}", ranks, environment=env)


def history(tmp_path, scales, *, seed: int, runs: int = 2, extra=()):
    """Records of one configuration over len(scales) commits, `runs` runs each, one commit a day: step
    times 0.1 s x scale x log-normal noise. Returns the records' directory."""
    rng = np.random.default_rng(seed)
    folder = tmp_path / f"records-{seed}"
    folder.mkdir()
    records = [
        record(0.1 * scale * rng.lognormal(0, SPREAD), commit(i), f"2026-01-{i + 1:02d}T{j:02d}:00:00+00:00")
        for i, scale in enumerate(scales)
        for j in range(runs)
    ]
    for r in [*records, *extra]:
        write_json_atomic(folder / f"{r['run_id']}.json", r)
    return folder


def step(size: float, commits: int = COMMITS, at: int = STEP_AT) -> list[float]:
    """Step-time scales: 1 before commit `at`, 1 + size from it on."""
    return [1.0] * at + [1.0 + size] * (commits - at)


def detect(folder, *args):
    return main([*BASE, str(folder), "--detect", *args])


def change_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("- ")]


# ---- on records ---------------------------------------------------------------------------------------


@needs_otava
def test_a_step_slowdown_is_found_at_its_commit_and_exits_1(tmp_path, capsys):
    # A dirty-tree run far off the line sits among the slowed commits: it is not a commit of the timeline.
    dirty = record(0.5, commit(15), "2026-01-16T12:00:00+00:00", dirty=True)
    code = detect(history(tmp_path, step(0.08), seed=10, extra=[dirty]))
    out = capsys.readouterr().out
    lines = change_lines(out)
    assert code == 1, out
    assert len(lines) == 1, out
    assert lines[0].startswith(f"- {commit(STEP_AT)[:10]} (first commit after {commit(STEP_AT - 1)[:10]}): -")
    assert "throughput_tokens_per_s" in lines[0] and lines[0].endswith(": regression")
    change = float(lines[0].split(": ")[1].split("%")[0]) / 100
    assert change == pytest.approx(1 / 1.08 - 1, abs=0.02)  # step time x1.08: throughput -7.4%
    assert f"REGRESSION: {lines[0].split(': ')[1].split(' ')[0]} throughput_tokens_per_s" in out
    assert "over 20 commits" in out  # the dirty row is left out of the timeline


@needs_otava
def test_newest_device_reads_the_series_of_the_device_the_newest_run_ran_on(tmp_path, capsys):
    """A hosted runner's CPU model changes between nights: two configurations, refused without a device
    kind (exit 2); `--device-kind newest` takes the newer runs' device, whose ten commits are the series."""
    newer = []
    for i in range(COMMITS, COMMITS + 10):
        r = record(0.12, commit(i), f"2026-02-{i - COMMITS + 1:02d}T00:00:00+00:00")
        r["environment"]["device_kind"] = "cpu: another model"
        newer.append(r)
    folder = history(tmp_path, [1.0] * COMMITS, seed=3, extra=newer)
    assert detect(folder) == 2 and "several configurations match" in capsys.readouterr().err
    code = detect(folder, "--device-kind", "newest")
    out = capsys.readouterr().out
    assert code == 0 and "over 10 commits" in out and "another model" in out, out


@needs_otava
def test_a_flat_history_has_no_change_point_and_exits_0(tmp_path, capsys):
    code = detect(history(tmp_path, [1.0] * COMMITS, seed=2))
    out = capsys.readouterr().out
    assert code == 0 and change_lines(out) == [], out
    assert out.rstrip().endswith("no change point")


@needs_otava
def test_a_lower_better_metric_rising_is_a_regression(tmp_path, capsys):
    code = detect(history(tmp_path, step(0.08), seed=3), "--metric", "step_time_s.median")
    out = capsys.readouterr().out
    lines = change_lines(out)
    assert code == 1 and len(lines) == 1, out
    assert lines[0].startswith(f"- {commit(STEP_AT)[:10]} ") and "% step_time_s.median" in lines[0]
    assert ": +" in lines[0] and lines[0].endswith(": regression") and "lower is better" in out


@needs_otava
def test_an_improvement_is_reported_and_exits_0(tmp_path, capsys):
    code = detect(history(tmp_path, step(-0.08), seed=4))
    out = capsys.readouterr().out
    lines = change_lines(out)
    assert code == 0 and len(lines) == 1, out
    assert lines[0].startswith(f"- {commit(STEP_AT)[:10]} ") and lines[0].endswith(": improvement")
    assert "REGRESSION" not in out and out.rstrip().endswith("no regression among the change points")


@needs_otava
def test_recent_limits_which_change_points_set_the_exit_code(tmp_path, capsys):
    folder = history(tmp_path, step(0.08), seed=10)
    assert detect(folder, "--recent", str(COMMITS - STEP_AT - 1)) == 0  # the step is 8 commits back
    out = capsys.readouterr().out
    assert change_lines(out)[0].endswith("regression (not recent)") and "REGRESSION" not in out
    assert detect(folder, "--recent", str(COMMITS - STEP_AT)) == 1
    assert "REGRESSION" in capsys.readouterr().out


@needs_otava
def test_min_magnitude_drops_a_change_below_it(tmp_path, capsys):
    folder = history(tmp_path, step(0.08), seed=10)
    assert detect(folder, "--min-magnitude", "10%") == 0
    out = capsys.readouterr().out
    assert change_lines(out) == [] and "min magnitude 10.0%" in out


def test_too_few_commits_is_one_line_and_exits_0(tmp_path, capsys):
    code = detect(history(tmp_path, [1.0, 1.0, 1.5], seed=5))
    out = capsys.readouterr().out
    assert code == 0
    assert (
        out.splitlines()[-1]
        == "change points: too few commits to detect one (3 with a value, need 4); exit 0"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--detect", "--max-pvalue", "2"], "argument --max-pvalue: expected a value between 0 and 1"),
        (["--detect", "--min-magnitude", "x"], "argument --min-magnitude: expected a fraction"),
        (["--detect", "--window", "2"], "argument --window: expected an integer >= 4"),
        (["--detect", "--better", "up"], "invalid choice: 'up'"),
        (["--max-pvalue", "0.01", "--recent", "3"], "--max-pvalue, --recent only apply with --detect"),
        (["--detect", "--metric", "tokens_per_step"], "metric 'tokens_per_step' has no known direction"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert main([*BASE, str(history(tmp_path, [1.0] * 5, seed=6)), *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_a_missing_otava_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "otava.analysis", None)  # import raises ImportError
    assert detect(history(tmp_path, [1.0] * 5, seed=7)) == 2
    captured = capsys.readouterr()
    assert f"--detect needs Apache Otava, which is not installed: {changepoints.INSTALL}" in captured.err
    assert captured.out == ""


# ---- the detector on generated series -----------------------------------------------------------------


@needs_otava
def test_detector_finds_steps_at_their_index_and_stays_quiet_on_flat_series():
    # Over 100 seeded series each (one value per commit, 2% spread, 20 commits): an 8% step is found at its
    # index, and only there, in most; a flat series is flagged in a few at most. The bounds leave room
    # for the binomial spread around the rates measured on a thousand such series.
    rng = np.random.default_rng(11)
    stepped = np.array(step(0.08))
    found = sum(
        [p[0] for p in changepoints.detect(list(stepped * rng.lognormal(0, SPREAD, COMMITS)))] == [STEP_AT]
        for _ in range(100)
    )
    flagged = sum(bool(changepoints.detect(list(rng.lognormal(0, SPREAD, COMMITS)))) for _ in range(100))
    assert found >= 80 and flagged <= 6, (found, flagged)


# ---- metric directions --------------------------------------------------------------------------------


def test_metric_directions_name_real_metrics_and_agree_with_the_export():
    from harness.analyze import export

    names = set(metric_names(factory.make_record()["summary"]))
    assert set(changepoints.HIGHER_IS_BETTER) | set(changepoints.LOWER_IS_BETTER) <= names
    # summary figure -> the export's column for it (harness.analyze.analysis reads one into the other)
    columns = {
        "throughput_tokens_per_s": "throughput",
        "per_device_tokens_per_s": "per_device_throughput",
        "mfu": "mfu",
        "step_time_s.median": "t_step_s",
        "exposed_comm_ratio": "exposed_comm_ratio",
        "peak_rss_bytes": "peak_memory_bytes",
        "peak_allocated_bytes": "peak_memory_bytes",
    }
    bigger = {column for column, *_ in export.BIGGER_IS_BETTER}
    smaller = {column for column, *_ in export.SMALLER_IS_BETTER}
    for metric, column in columns.items():
        assert column in bigger | smaller
        assert changepoints.higher_is_better(metric) == (column in bigger), metric
    assert changepoints.higher_is_better("tokens_per_step") is None


@needs_otava
@pytest.mark.subprocess  # git, for the page's commit subjects
def test_the_page_and_the_detection_in_one_call(tmp_path, capsys):
    """--html beside a named configuration and --detect: the page of every configuration is written and the
    exit code is still the detection's."""
    page = tmp_path / "page.html"
    code = detect(history(tmp_path, step(0.08), seed=10), "--html", str(page), "--git", str(tmp_path))
    out = capsys.readouterr().out
    assert code == 1 and "REGRESSION" in out and f"history page: {page}" in out
    text = page.read_text()
    assert "Change points, newest first" in text and f"<td>{commit(STEP_AT)[:10]}</td>" in text


def test_without_html_the_configuration_is_named(tmp_path, capsys):
    folder = history(tmp_path, [1.0] * 5, seed=8)
    assert main(["history", str(folder), "--backend", "torch-ddp"]) == 2
    assert "--workload, --gpus required: they name the configuration" in capsys.readouterr().err
