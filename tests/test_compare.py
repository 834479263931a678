"""`harness compare`, baselines and history on hand-made records (summarised by harness.analyze.metrics), so
every expected verdict follows from samples with a known distribution."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import record_factory as factory
from scipy.stats import ttest_ind

from core.records import write_json_atomic
from harness.analyze.baseline import BASELINE_FILE
from harness.analyze.compare import significance
from harness.cli import main
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit

MiB = 2**20
CPU = "cpu: Test CPU"


def make_record(
    step_times,
    *,
    backend="torch-ddp",
    gpus=1,
    precision="fp32",
    device_kind=CPU,
    status="ok",
    rss=400 * MiB,
    state=17_150_160,
    versions=None,
    commit="a" * 40,
    start="2026-01-01T00:00:00+00:00",
    spec=None,
    series=None,
):
    """A run record as harness.run.record.assemble_record builds it, every rank with the same step-time series
    (`state`: the measured model state per rank, an arbitrary fixed figure; `series`: more of a rank's raw
    series, such as the part times of its anatomy steps)."""
    versions = versions or {"python": "3.11.7", "torch": "2.13.0+cpu"}
    cfg = factory.config(
        backend, gpus, spec=spec, precision=precision, steps=len(step_times), threads_per_worker=1
    )
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    if status == "ok":
        ranks = [
            factory.rank_record(
                r,
                step_times,
                device=device_kind,
                losses=[5.0] * len(step_times),
                peak_rss=rss,
                state_total=state,
                versions=versions,
            )
            | (series or {})
            for r in range(gpus)
        ]
        error = None
    else:
        ranks = [factory.failed_rank(0, status, "RuntimeError: boom")]
        error = {"rank": 0, "message": "RuntimeError: boom", "log_tail": []}
    env = factory.environment(
        device_kind if status == "ok" else None, gpus, start_time=start, versions=versions, commit=commit
    )
    return factory.assemble(cfg, run_id, ranks, status=status, error=error, environment=env)


def write(directory, records):
    for r in records:
        write_json_atomic(directory / f"{r['run_id']}.json", r)
    return directory


def runs(tmp_path, name, scales, *, steps=20, seed=0, **kw):
    """One record per scale: lognormal step times around 100 ms x scale (a known distribution)."""
    rng = np.random.default_rng(seed)
    return write(
        tmp_path / name, [make_record(0.1 * s * rng.lognormal(0, 0.05, steps), **kw) for s in scales]
    )


def compare(tmp_path, base, cand, *args):
    out = tmp_path / f"cmp-{uuid.uuid4().hex[:6]}.json"
    code = main(["compare", str(base), str(cand), "--json", str(out), *args])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def throughput(result, i=0):
    return result["comparisons"][i]["metrics"][0]


# ---- statistics on known distributions ----------------------------------------------------------------


def test_welch_on_log_run_values_known_answer():
    # logs: base ln(1), ln(1.1), ln(1.2); cand ln(1.3), ln(1.4), ln(1.5) (worked out with scipy's Welch test)
    sig = significance([1.0, 1.1, 1.2], [1.3, 1.4, 1.5], 0.05)
    x, y = np.log([1.0, 1.1, 1.2]), np.log([1.3, 1.4, 1.5])
    expected = ttest_ind(y, x, equal_var=False)
    assert sig.test == "welch-t (log per-run values)" and sig.p_value == pytest.approx(expected.pvalue)
    assert sig.change == pytest.approx(np.exp(y.mean() - x.mean()) - 1)
    assert sig.ci[0] < sig.change < sig.ci[1] and sig.significant == (expected.pvalue < 0.05)
    assert not significance([1.0, 1.1, 1.35], [1.3, 1.4, 1.5], 0.05).significant


def test_welch_false_positive_rate_and_power_on_known_distributions():
    # Run-to-run spread 2% (log-normal): under the null about alpha of the pairs differ (4 runs a side), and
    # a 5% shift is found in 9 of 10 with 6 runs a side; the MDC says which change these runs can detect.
    rng = np.random.default_rng(7)
    trials = 2000
    null = [significance(rng.lognormal(0, 0.02, 4), rng.lognormal(0, 0.02, 4), 0.05) for _ in range(trials)]
    shift = [
        significance(rng.lognormal(0, 0.02, 6), 1.05 * rng.lognormal(0, 0.02, 6), 0.05) for _ in range(trials)
    ]
    false_positives = sum(s.significant for s in null) / trials
    assert 0.03 < false_positives < 0.07
    assert sum(s.significant for s in shift) / trials > 0.9
    assert 0.02 < np.median([s.mdc for s in null]) < 0.06


def test_one_run_a_side_is_threshold_only():
    sig = significance([1.0], [1.3], 0.05)
    assert sig.test == "threshold only" and sig.p_value is None and sig.significant
    assert "threshold only" in sig.describe()


# ---- verdicts and exit codes --------------------------------------------------------------------------


def test_same_distribution_is_no_regression(tmp_path, capsys):
    code, result = compare(
        tmp_path, runs(tmp_path, "a", [1, 1, 1], seed=1), runs(tmp_path, "b", [1, 1, 1], seed=2)
    )
    assert code == 0 and result["result"] == "ok" and result["regressions"] == 0
    m = throughput(result)
    assert m["samples"] == "per-run median" and m["n_baseline"] == m["n_candidate"] == 3
    assert abs(m["change"]) < 0.05
    assert "### distbench compare: no regression" in capsys.readouterr().out


def test_thirty_percent_slowdown_is_a_regression(tmp_path, capsys):
    code, result = compare(
        tmp_path, runs(tmp_path, "a", [1, 1, 1, 1, 1]), runs(tmp_path, "b", [1.3] * 5, seed=3)
    )
    assert code == 1 and result["result"] == "regression"
    m = throughput(result)
    assert m["verdict"] == "regression" and m["test"].startswith("welch") and m["p_value"] < 0.05
    assert m["change"] == pytest.approx(1 / 1.3 - 1, abs=0.03)
    assert m["step_time_change"] == pytest.approx(0.3, abs=0.04)
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "**regression**" in out


def test_improvement_is_reported_and_passes(tmp_path):
    code, result = compare(
        tmp_path, runs(tmp_path, "a", [1, 1, 1]), runs(tmp_path, "b", [0.7, 0.7, 0.7], seed=4)
    )
    assert code == 0 and throughput(result)["verdict"] == "improvement" and result["improvements"] == 1


def test_significant_change_below_threshold_is_ok(tmp_path):
    # 2% slower in each of 5 runs a side: the test sees it, the 3% threshold says it does not matter.
    code, result = compare(
        tmp_path, runs(tmp_path, "a", [1] * 5, steps=400), runs(tmp_path, "b", [1.02] * 5, steps=400, seed=5)
    )
    m = throughput(result)
    assert m["samples"] == "per-run median" and m["significant"] and m["verdict"] == "ok" and code == 0
    code, result = compare(tmp_path, tmp_path / "a", tmp_path / "b", "--threshold", "1%")
    assert code == 1 and throughput(result)["verdict"] == "regression"


def test_large_change_without_significance_is_ok(tmp_path):
    # Run medians 100/150/200 vs 120/170/210 ms: +13% in the middle, but the ranges overlap.
    base = write(tmp_path / "a", [make_record([0.1 * s] * 10) for s in (1.0, 1.5, 2.0)])
    cand = write(tmp_path / "b", [make_record([0.1 * s] * 10) for s in (1.2, 1.7, 2.1)])
    code, result = compare(tmp_path, base, cand)
    m = throughput(result)
    assert m["change"] < -0.05 and m["test"].startswith("welch") and not m["significant"]
    assert m["verdict"] == "ok" and code == 0


def test_statistic_min_ignores_contended_steps(tmp_path):
    # Same undisturbed cost (100 ms); the candidate's runs had a noisy neighbour for half their steps.
    base = write(tmp_path / "a", [make_record([0.1 + 0.001 * i for i in range(10)]) for _ in range(3)])
    cand = write(
        tmp_path / "b", [make_record([0.1 + 0.001 * i for i in range(5)] + [0.3] * 5) for _ in range(3)]
    )
    assert compare(tmp_path, base, cand)[0] == 1
    code, result = compare(tmp_path, base, cand, "--statistic", "min")
    assert code == 0 and throughput(result)["samples"] == "per-run min" and throughput(result)["change"] == 0


def test_memory_growth_beyond_threshold_is_a_regression(tmp_path):
    base = runs(tmp_path, "a", [1, 1, 1], rss=400 * MiB)
    cand = runs(tmp_path, "b", [1, 1, 1], seed=1, rss=480 * MiB, state=2 * 17_150_160)
    code, result = compare(tmp_path, base, cand)
    rss, state = result["comparisons"][0]["metrics"][1:]
    assert code == 1 and rss["label"] == "peak RSS / rank" and rss["change"] == pytest.approx(0.2)
    assert rss["verdict"] == state["verdict"] == "regression" and throughput(result)["verdict"] == "ok"
    code, result = compare(tmp_path, base, cand, "--memory-threshold", "1.5")
    assert code == 2  # a fraction, not 150%
    code, result = compare(tmp_path, base, cand, "--memory-threshold", "0.25")
    assert result["comparisons"][0]["metrics"][1]["verdict"] == "ok"
    assert result["comparisons"][0]["metrics"][2]["verdict"] == "regression" and code == 1


# ---- the part of the step that moved -------------------------------------------------------------------

# A one-rank run's parts in seconds, a step being their sum: forward, backward, optimizer and the rest.
PARTS = {"forward": 0.030, "backward": 0.050, "optimizer": 0.015, "rest": 0.005}
TIMED = {"forward": "forward_times", "backward": "backward_times", "optimizer": "optimizer_step_times"}


def timed_runs(tmp_path, name, n=4, *, seed=0, step=None, sd=0.02, **changed):
    """`n` one-rank runs whose anatomy steps time each part around PARTS (with `changed` parts instead),
    a run drawing a launch factor and every step and part its own (lognormal spread `sd`); the measured
    step is the parts' sum (`step`: that many seconds instead, the timed parts unchanged)."""
    rng = np.random.default_rng(seed)
    parts = {**PARTS, **changed}
    records = []
    for _ in range(n):
        launch = rng.lognormal(0, sd)
        total = step if step is not None else sum(parts.values())
        steps = total * launch * rng.lognormal(0, sd, 20)
        series = {key: list(parts[p] * launch * rng.lognormal(0, sd, 3)) for p, key in TIMED.items()}
        series["anatomy_step_times"] = list(total * launch * rng.lognormal(0, sd, 3))
        records.append(make_record(list(steps), series=series))
    return write(tmp_path / name, records)


def anatomy(result, i=0):
    return result["comparisons"][i]["anatomy"]


@pytest.mark.parametrize("part", ["optimizer", "forward"])
def test_a_slower_part_is_the_part_named_with_its_change_and_interval(tmp_path, capsys, part):
    """The candidate's `part` takes 30 ms more (a step 30% longer), the other parts are as they were: the
    regression names that part, its change is +30 ms within its interval and excludes zero, and no other
    part's change comes near."""
    base = timed_runs(tmp_path, "a", seed=1)
    cand = timed_runs(tmp_path, "b", seed=2, **{part: PARTS[part] + 0.030})
    code, result = compare(tmp_path, base, cand)
    assert code == 1 and throughput(result)["verdict"] == "regression"
    moved = anatomy(result)["parts"][part]
    low, high = moved["ci"]
    assert moved["status"] == "compared" and 0 < low < 0.030 < high and moved["s"] == pytest.approx(0.03, 0.2)
    assert moved["share"] == pytest.approx(0.3, 0.2)  # of the baseline's 100 ms step
    assert anatomy(result)["moved"] == throughput(result)["part_that_moved"] == part
    others = [p for name, p in anatomy(result)["parts"].items() if name != part]
    assert all(abs(p["s"]) < 0.01 for p in others)
    out = capsys.readouterr().out
    label = f"{part} +{moved['s'] * 1e3:.1f} ms"
    interval = f"[{low * 1e3:+.1f}, {high * 1e3:+.1f}]"
    assert f"**regression**: {label} moved |" in out
    assert f"{label} ({moved['share']:+.1%} of the step) {interval}, the part that moved most" in out


def test_an_unresolved_part_is_never_named(tmp_path, capsys):
    """The candidate's step is 30 ms shorter while its timed parts are not (exactly as the baseline's):
    the step less its parts is negative beyond its noise, unresolved, and though its change is the only
    one, it is not compared and not named; the improvement says no part is resolved."""
    base = timed_runs(tmp_path, "a", sd=0.0)
    cand = timed_runs(tmp_path, "b", step=0.070, sd=0.0)
    code, result = compare(tmp_path, base, cand)
    assert code == 0 and throughput(result)["verdict"] == "improvement"
    assert anatomy(result)["moved"] is None and throughput(result)["part_that_moved"] is None
    other = anatomy(result)["parts"]["other"]
    assert other["status"] == "unresolved" and other["s"] is None and not other["moved"]
    assert other["note"] == "unresolved in 4 of 8 runs: negative beyond its noise"
    out = capsys.readouterr().out
    assert "improvement: no part resolved |" in out and "no part's change is resolved from zero" in out
    assert "other unresolved (unresolved in 4 of 8 runs" in out


def test_one_run_a_side_names_no_part(tmp_path, capsys):
    base = timed_runs(tmp_path, "a", n=1)
    cand = timed_runs(tmp_path, "b", n=1, optimizer=0.045)
    code, result = compare(tmp_path, base, cand)
    optimizer = anatomy(result)["parts"]["optimizer"]
    assert optimizer["ci"] is None and optimizer["moved"] is None and anatomy(result)["moved"] is None
    assert "optimizer +" in capsys.readouterr().out and "one run on a side: no interval" in optimizer["note"]


def test_parts_not_measured_are_n_a_and_a_record_without_an_anatomy_has_none(tmp_path):
    """Runs that timed no part (a one-rank run still has its exposed communication: none); a record from
    before the anatomy has no part at all; neither names a part."""
    code, result = compare(tmp_path, runs(tmp_path, "a", [1, 1]), runs(tmp_path, "b", [1, 1], seed=1))
    parts = anatomy(result)["parts"]
    assert {parts[p]["status"] for p in ("forward", "backward", "optimizer", "other")} == {"n/a"}
    assert parts["forward"]["note"] == "not measured in 4 of 4 runs"
    assert parts["exposed_comm"]["s"] == 0 and not parts["exposed_comm"]["moved"]
    assert anatomy(result)["moved"] is None
    older = [make_record([0.1] * 20) for _ in range(2)]
    for r in older:
        del r["summary"]["anatomy"]
    code, result = compare(tmp_path, write(tmp_path / "c", older), tmp_path / "b")
    assert {p["status"] for p in anatomy(result)["parts"].values()} == {"n/a"}


# ---- matching ------------------------------------------------------------------------------------------


def test_runs_match_on_configuration_and_the_rest_is_listed(tmp_path, capsys):
    base = write(
        tmp_path / "a",
        [
            make_record([0.1] * 5),
            make_record([0.2] * 5, gpus=2),
            make_record(
                [0.1] * 5, spec=PRESETS["tiny"].__class__(**{**PRESETS["tiny"].to_dict(), "n_layers": 2})
            ),
        ],
    )
    cand = write(tmp_path / "b", [make_record([0.1] * 5), make_record([0.1] * 5, precision="bf16")])
    code, result = compare(tmp_path, base, cand)
    assert code == 0 and [c["match"]["world_size"] for c in result["comparisons"]] == [1]
    assert result["comparisons"][0]["match"]["workload"] == "tiny"
    assert [k.split(" · 8 seq/rank")[0] for k in sorted(result["only_in_baseline"])] == [
        "torch-ddp · tiny · N=2 · fp32 · weak",
        "torch-ddp · tiny(n_layers=2) · N=1 · fp32 · weak",
    ]
    assert [k.split(" · 8 seq/rank")[0] for k in result["only_in_candidate"]] == [
        "torch-ddp · tiny · N=1 · bf16 · weak"
    ]
    assert all(k.endswith("1 thread(s)/worker, 3+5 steps · " + CPU) for k in result["only_in_baseline"])
    assert "Only in the candidate (not compared):" in capsys.readouterr().out


def test_failed_runs_are_reported_not_compared(tmp_path, capsys):
    base = write(tmp_path / "a", [make_record([0.1] * 5), make_record([0.1] * 5, gpus=2, status="failed")])
    cand = write(tmp_path / "b", [make_record([0.1] * 5), make_record([0.1] * 5, gpus=2, status="crashed")])
    code, result = compare(tmp_path, base, cand)
    assert code == 0 and len(result["comparisons"]) == 1
    assert {(n["side"], n["status"], n["newly_failing"]) for n in result["not_compared"]} == {
        ("baseline", "failed", False),
        ("candidate", "crashed", False),
    }
    # A candidate that fails where the baseline ran is the worst regression of all.
    write(tmp_path / "a", [make_record([0.1] * 5, gpus=2)])
    code, result = compare(tmp_path, base, cand)
    assert code == 1 and result["newly_failing"] == 1
    assert "**newly failing**" in capsys.readouterr().out


def test_different_device_kinds_are_refused_unless_forced(tmp_path, capsys):
    base = runs(tmp_path, "a", [1, 1, 1])
    cand = runs(
        tmp_path,
        "b",
        [1, 1, 1],
        seed=1,
        device_kind="cpu: Other CPU",
        versions={"python": "3.11.7", "torch": "2.14.0+cpu"},
    )
    code, result = compare(tmp_path, base, cand)
    err = capsys.readouterr().err.strip()
    assert code == 2 and result is None and len(err.splitlines()) == 1
    assert "Test CPU" in err and "Other CPU" in err and "--force" in err
    code, result = compare(tmp_path, base, cand, "--force")
    assert code == 0 and result["comparisons"][0]["key"].startswith(
        "torch-ddp · tiny · N=1 · fp32 · weak · 8 seq/rank"
    )
    diffs = result["comparisons"][0]["environment_differences"]
    assert f"device_kind: {CPU} -> cpu: Other CPU" in diffs and "torch: 2.13.0+cpu -> 2.14.0+cpu" in diffs
    assert "† Environment or settings differ" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["compare", "baseline", "history"])
def test_help_is_printed(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0 and "usage: harness" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case", ["missing", "schema", "foreign", "nothing-matched", "empty-dir", "bad-threshold"]
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, case):
    base = runs(tmp_path, "a", [1])
    cand = tmp_path / "cand.json"
    args = []
    if case == "missing":
        cand = tmp_path / "nope.json"
    elif case == "schema":
        write_json_atomic(cand, {**make_record([0.1] * 5), "schema_version": 99})
    elif case == "foreign":
        cand.write_text('{"hello": 1}')
    elif case == "nothing-matched":
        write_json_atomic(cand, make_record([0.1] * 5, gpus=4))
    elif case == "empty-dir":
        (cand := tmp_path / "empty").mkdir()
    else:
        write_json_atomic(cand, make_record([0.1] * 5))
        args = ["--threshold", "five"]
    code, _ = compare(tmp_path, base, cand, *args)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("harness: error: ") and len(err.strip().splitlines()) == 1
    expected = {
        "missing": "no such file",
        "schema": "schema_version 99",
        "foreign": "not a distbench run record",
        "nothing-matched": "nothing matched",
        "empty-dir": "no distbench run records",
        "bad-threshold": "expected a fraction",
    }[case]
    assert expected in err


# ---- baselines ------------------------------------------------------------------------------------------


@pytest.mark.subprocess  # baseline save asks git for the commit
def test_baseline_save_then_compare(tmp_path, capsys):
    records = runs(tmp_path, "results", [1, 1, 1])
    assert main(["baseline", "save", "main", str(records), "--dir", str(tmp_path / "baselines")]) == 0
    path = tmp_path / "baselines" / "main" / BASELINE_FILE
    saved = json.loads(path.read_text())
    assert saved["kind"] == "distbench-baseline" and saved["baseline_schema_version"] == 1
    assert saved["name"] == "main" and saved["created"] and "commit" in saved["git"]
    assert len(saved["records"]) == 3 and all("ranks" not in r for r in saved["records"])
    assert all(len(r["step_times_s"]) == 20 for r in saved["records"])
    capsys.readouterr()
    assert main(["baseline", "save", "main", str(records), "--dir", str(tmp_path / "baselines")]) == 0
    assert "replaced the previous baseline" in capsys.readouterr().out
    # Compared with the records it came from: identical samples, no change at all.
    code, result = compare(tmp_path, path.parent, records)
    assert code == 0 and throughput(result)["change"] == 0
    code, result = compare(tmp_path, path.parent, runs(tmp_path, "slow", [1.3] * 3, seed=9))
    assert code == 1
    saved["baseline_schema_version"] = 2
    path.write_text(json.dumps(saved))
    capsys.readouterr()
    assert compare(tmp_path, path, records)[0] == 2
    assert "baseline_schema_version 2" in capsys.readouterr().err


def test_baseline_name_must_be_a_plain_name(tmp_path, capsys):
    assert main(["baseline", "save", "../x", str(runs(tmp_path, "r", [1])), "--dir", str(tmp_path)]) == 2
    assert "baseline name" in capsys.readouterr().err


# ---- history ---------------------------------------------------------------------------------------------


def test_history_orders_commits_by_first_run_and_plots(tmp_path, capsys):
    records = [
        make_record([0.1] * 5, commit="b" * 40, start="2026-01-02T00:00:00+00:00"),
        make_record([0.1] * 5, commit="b" * 40, start="2026-01-02T01:00:00+00:00"),
        make_record([0.2] * 5, commit="a" * 40, start="2026-01-01T00:00:00+00:00"),
        make_record([0.1] * 5, commit="c" * 40, start="2026-01-03T00:00:00+00:00", status="failed"),
        make_record([0.1] * 5, gpus=2, commit="c" * 40, start="2026-01-03T00:00:00+00:00"),
    ]
    write(tmp_path / "r", records)
    plot = tmp_path / "plot.png"
    code = main(
        [
            "history",
            str(tmp_path / "r"),
            "--backend",
            "torch-ddp",
            "--workload",
            "tiny",
            "--gpus",
            "1",
            "--output",
            str(plot),
        ]
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "commit" not in line]
    assert code == 0 and plot.stat().st_size > 0
    assert [r.split("|")[1].strip() for r in rows] == ["a" * 10, "b" * 10, "c" * 10]
    assert "| 2 (0) | 10,240 |" in rows[1] and "+100.0%" in rows[1]  # 8 x 128 tokens per step / 0.1 s
    assert "| 1 (1) | n/a |" in rows[2]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--metric", "nope"], "unknown metric 'nope'; valid:"),
        (["--workload", "small"], "no records for backend"),
    ],
)
def test_history_bad_input(tmp_path, capsys, args, message):
    write(tmp_path / "r", [make_record([0.1] * 5), make_record([0.1] * 5, precision="bf16")])
    base = ["history", str(tmp_path / "r"), "--backend", "torch-ddp", "--workload", "tiny", "--gpus", "1"]
    assert main(base + ["--precision", "fp32"] + args) == 2
    assert message in capsys.readouterr().err
    assert main(base) == 2
    assert "several configurations match" in capsys.readouterr().err
