"""`harness commbench`: each stack's collectives timed as nccl-tests defines the figures, recorded like runs.

Unit tier: the figures (busbw, the α-β fit, the slowest rank), the size and op parsing, the result check.
Integration: real launches of every stack's collectives; a failing or hung collective is a recorded failure.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import harness
from processes import leftovers

from backends.commbench import WrongResult, check_output, expected_output
from core.commbench_spec import CommbenchSpec
from core.config import RunConfig
from core.records import load_records, run_config
from harness.analyze.baseline import trim
from harness.analyze.collectives import (
    call_time,
    commbench_rows,
    fit_alpha_beta,
    op_time_index,
    summarize_commbench,
)
from harness.analyze.compare import compare_runs
from harness.analyze.metrics import bus_factor
from harness.cli import main
from harness.run.commbench import parse_sizes, whole_shares
from workloads.spec import PRESETS

unit = pytest.mark.unit


def synthetic_record(op: str, world: int, sizes: list[int], per_rank_times: list[list[list[float]]]) -> dict:
    """A commbench record whose rank r timed size i's calls as per_rank_times[r][i]."""
    return {
        "kind": "commbench",
        "run_id": f"synthetic-{op}-{world}",
        "status": "ok",
        "config": RunConfig.build(
            "torch-ddp",
            workload="tiny",
            spec=PRESETS["tiny"],
            world_size=world,
            device="cpu",
            commbench={"dtype": "fp32", "ops": [op], "sizes": sizes, "iters": 5, "warmup": 1},
        ).to_dict(),
        "ranks": [
            {
                "status": "ok",
                "collectives": [{"op": op, "bytes": s, "times": t} for s, t in zip(sizes, per_rank_times[r])],
            }
            for r in range(world)
        ],
    }


# ------------------------------------------------------------------------------------------------ unit tier
@unit
@pytest.mark.parametrize(
    "op, world, factor",
    [
        ("all_reduce", 4, 1.5),
        ("all_reduce", 2, 1.0),
        ("all_gather", 8, 7 / 8),
        ("reduce_scatter", 4, 0.75),
        ("all_to_all", 2, 0.5),
        ("broadcast", 16, 1.0),
    ],
)
def test_busbw_follows_the_nccl_tests_formula_on_a_synthetic_timing(op, world, factor):
    """algbw = S / t of the slowest rank's median call; busbw = algbw x the op's factor (nccl-tests'
    PERFORMANCE.md). Rank 1 is the slowest in every call: its times are the ones that count."""
    size = 1 << 20
    fast, slow = [1e-3, 2e-3, 3e-3], [4e-3, 5e-3, 6e-3]
    times = [[slow if r == 1 else fast] for r in range(world)]
    point = summarize_commbench(synthetic_record(op, world, [size], times))["ops"][op]["points"][0]
    assert point["time_s"]["median"] == 5e-3
    assert point["algbw_Bps"] == pytest.approx(size / 5e-3)
    assert point["busbw_Bps"] == pytest.approx(size / 5e-3 * factor)
    assert bus_factor(op, world) == pytest.approx(factor)


@unit
def test_slowest_rank_is_taken_per_call_not_per_rank():
    """Call i's time is the max over ranks of call i: two ranks slow on different calls make every call
    slow, which medians per rank would hide."""
    times = [[[1.0, 9.0, 1.0]], [[9.0, 1.0, 9.0]]]
    point = summarize_commbench(synthetic_record("all_reduce", 2, [1024], times))["ops"]["all_reduce"][
        "points"
    ][0]
    assert point["times_s"] == [9.0, 9.0, 9.0]


@unit
def test_alpha_beta_fit_recovers_the_latency_and_bus_bandwidth_of_a_synthetic_curve():
    alpha, beta, world = 30e-6, 12e9, 8
    sizes = [1 << k for k in range(10, 27, 2)]
    times = [alpha + s * bus_factor("all_reduce", world) / beta for s in sizes]
    fit = fit_alpha_beta(sizes, times, "all_reduce", world)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["beta_busbw_Bps"] == pytest.approx(beta, rel=1e-6)
    assert fit["max_rel_error"] < 1e-6


@unit
def test_op_time_index_weighs_every_size_alike():
    record = synthetic_record("all_gather", 2, [1024, 1 << 20], [[[1e-4], [1e-2]], [[1e-4], [1e-2]]])
    assert op_time_index(summarize_commbench(record), "all_gather") == pytest.approx(1e-3)


@unit
def test_a_wrong_collective_result_is_refused():
    """Chunks out of order (rank 1's data first) or one rank's contribution missing: not a result."""
    assert expected_output("all_gather", 4, 2).tolist() == [1, 1, 2, 2]  # rank r's input is r + 1
    assert expected_output("all_to_all", 4, 2).tolist() == [1, 1, 2, 2]  # chunk k came from rank k
    assert expected_output("reduce_scatter", 8, 4).tolist() == [10, 10]
    assert expected_output("all_reduce", 2, 4).tolist() == [10, 10] and expected_output(
        "broadcast", 2, 4
    ).tolist() == [1, 1]
    world, elements = 4, 16
    good = expected_output("all_gather", elements, world)
    check_output("all_gather", good, elements, world, "fp32")
    with pytest.raises(WrongResult, match="all_gather"):
        check_output("all_gather", good[::-1].copy(), elements, world, "fp32")
    with pytest.raises(WrongResult, match="all_reduce"):
        check_output("all_reduce", np.full(elements, 9.0), elements, world, "fp32")
    with pytest.raises(WrongResult, match="shape"):
        check_output("reduce_scatter", np.full(elements, 10.0), elements, world, "fp32")


@unit
def test_sizes_step_like_nccl_tests_and_round_to_whole_shares():
    assert parse_sizes("1K:64M", 2) == [1 << k for k in range(10, 27)]  # 1 KiB .. 64 MiB, 17 sizes
    assert parse_sizes("1K:1M", 4) == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert parse_sizes("4K,1K,4K", 2) == [1024, 4096]
    assert whole_shares([1000, 4096], 3, 4) == [996, 4092]  # multiples of ranks x element bytes


@unit
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "torch-ddp", "--gpus", "1"], "at least 2 ranks"),
        (
            ["--backend", "torch-ddp", "--gpus", "2", "--ops", "allsum"],
            "unknown collective 'allsum'; valid: all_reduce",
        ),
        (
            ["--backend", "tf-mwms", "--gpus", "2", "--ops", "reducescatter"],
            "tf-mwms offers no reduce_scatter here",
        ),
        (
            ["--backend", "paddle-fleet", "--gpus", "2", "--device", "cpu", "--ops", "alltoall"],
            "all_reduce, all_gather, broadcast",
        ),
        (["--backend", "torch-ddp", "--gpus", "2", "--sizes", "64M:1K"], "first size is larger"),
        (["--backend", "torch-ddp", "--gpus", "2", "--sizes", "1X"], "cannot read size '1X'"),
        (
            ["--backend", "torch-ddp", "--gpus", "2", "--dtype", "fp64"],
            "unknown dtype 'fp64'; valid: fp32, bf16",
        ),
        (["--backend", "nope", "--gpus", "2"], "unknown backend 'nope'"),
        (
            ["--backend", "torch-ddp", "--gpus", "2", "--zero-stage", "2"],
            "--zero-stage is an option of backend deepspeed",
        ),
    ],
)
def test_bad_commbench_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main(["commbench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error:") and message in err[0], err
    assert not list(tmp_path.glob("*.json"))


@unit
def test_commbench_runs_are_gated_per_op_like_training_runs():
    """A 20% slower all_reduce in every candidate run is a regression; the unchanged all_gather is not."""
    rng = np.random.default_rng(0)

    def run(i, slow):
        sizes = [1024, 1 << 20]
        times = [
            [[t * slow * (1 + 0.01 * rng.standard_normal())] * 5 for t in (1e-4, 1e-2)] for _ in range(2)
        ]
        record = synthetic_record("all_reduce", 2, sizes, times)
        gather = synthetic_record("all_gather", 2, sizes, [[[t] * 5 for t in (1e-4, 1e-2)]] * 2)
        for rank, other in zip(record["ranks"], gather["ranks"]):
            rank["collectives"] += other["collectives"]
        record["config"] = (
            run_config(record)
            .evolve(
                commbench={
                    "dtype": "fp32",
                    "ops": ["all_reduce", "all_gather"],
                    "sizes": sizes,
                    "iters": 5,
                    "warmup": 1,
                },
                backend="torch-ddp",
                device="cpu",
                threads_per_worker=1,
            )
            .to_dict()
        )
        record.update(
            run_id=f"r{i}-{slow}",
            schema_version=3,
            backend_info={"label": "torch-ddp"},
            environment={"device_kind": "cpu: test"},
            error=None,
        )
        record["summary"] = summarize_commbench(record)
        return trim(record)

    result = compare_runs([run(i, 1.0) for i in range(4)], [run(i, 1.2) for i in range(4)], threshold=0.05)
    (comparison,) = result["comparisons"]
    verdicts = {m["label"]: m["verdict"] for m in comparison["metrics"]}
    assert verdicts == {"all_reduce time": "regression", "all_gather time": "ok"}
    assert result["result"] == "regression"


# --------------------------------------------------------------------------------------------- integration
def commbench(out: Path, *args, expect_rc=0, timeout=240) -> dict:
    before = set(out.glob("*.json")) if out.exists() else set()
    proc = harness("commbench", *args, "--out", out, timeout=timeout)
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    (new,) = sorted(set(out.glob("*.json")) - before)
    return json.loads(new.read_text())


SMALL = ("--gpus", "2", "--sizes", "1K,64K", "--iters", "3", "--warmup-iters", "1", "--device", "cpu")
OFFERED = {  # torch-fsdp's are torch-ddp's: the same module (torch_ddp/collectives.py) and launcher
    "torch-ddp": 5,
    "deepspeed": 5,
    "horovod": 5,
    "tf-mwms": 2,  # all_reduce, all_gather
    "paddle-fleet": 3,  # gloo: all_reduce, all_gather, broadcast
}


@pytest.fixture(scope="module")
def ddp_bench(tmp_path_factory) -> tuple[dict, Path]:
    """torch-ddp's commbench of every op it offers, and its --out folder: the per-stack test's torch-ddp
    case, and the first of the two records the reporting test reads."""
    out = tmp_path_factory.mktemp("ddp-bench") / "results"
    return commbench(out, "--backend", "torch-ddp", *SMALL), out


@pytest.mark.parametrize("backend", list(OFFERED))
def test_every_stack_s_collectives_are_timed_checked_and_recorded(backend, out, request):
    """Each stack's own API, through its own launcher: every op it offers here, at every size, on both
    ranks, each checked against the known answer first (a wrong one would fail the run)."""
    if backend == "torch-ddp":
        record = request.getfixturevalue("ddp_bench")[0]
    else:
        record = commbench(out, "--backend", backend, *SMALL)
    assert record["kind"] == "commbench" and record["status"] == "ok", record.get("error")
    ops = record["summary"]["ops"]
    assert len(ops) == OFFERED[backend] == len(run_config(record).role.commbench["ops"])
    for op, entry in ops.items():
        assert [p["bytes"] for p in entry["points"]] == [1024, 65536]
        for p in entry["points"]:
            assert p["time_s"]["n"] == 3 and p["busbw_Bps"] == pytest.approx(
                p["bytes"] / p["time_s"]["median"] * bus_factor(op, 2)
            )
    assert [len(r["collectives"]) for r in record["ranks"]] == [2 * OFFERED[backend]] * 2
    assert record["environment"]["versions"]


def test_a_failing_collective_is_a_recorded_failure_naming_the_rank(out):
    record = commbench(out, "--backend", "torch-ddp", *SMALL, "--inject-fault", "1:3:raise", expect_rc=1)
    assert record["kind"] == "commbench" and record["status"] == "failed"
    assert record["error"]["rank"] == 1 and "injected fault at step 3" in record["error"]["message"]
    assert any("injecting fault 'raise'" in line for line in record["error"]["log_tail"])
    assert not leftovers(out, wait_s=10)


@pytest.mark.slow
def test_a_hung_collective_ends_at_the_collective_timeout_as_a_recorded_timeout(out):
    record = commbench(
        out,
        "--backend",
        "torch-ddp",
        *SMALL,
        "--inject-fault",
        "1:2:hang",
        "--collective-timeout",
        "5",
        expect_rc=1,
    )
    assert record["status"] == "timeout" and record["error"]["rank"] == 1
    assert "gave up waiting in a collective for rank(s) [1]" in record["error"]["message"]
    assert record["launch"]["elapsed_s"] < 60
    assert not leftovers(out, wait_s=10)


def test_commbench_records_go_to_report_results_and_compare_beside_training_records(ddp_bench, tmp_path):
    first, out = ddp_bench  # every op torch-ddp offers, as the second run: compare matches like with like
    second = commbench(out, "--backend", "torch-ddp", *SMALL)
    proc = harness("report", out)
    assert proc.returncode == 0, proc.stderr
    assert "## Collectives (commbench)" in proc.stdout and "| torch-ddp | all_reduce |" in proc.stdout
    proc = harness("results", out, "--kind", "commbench", "--csv", tmp_path / "cb.csv")
    rows = 2 * OFFERED["torch-ddp"] * 2  # a row per record, op and size
    assert proc.returncode == 0 and (tmp_path / "cb.csv").read_text().count("\n") == 1 + rows
    proc = harness(
        "compare", out / f"{first['run_id']}.json", out / f"{second['run_id']}.json", "--threshold", "0.99"
    )
    # one run a side, 3 calls of 1 KiB: noise alone moved an op's time by +217% once, past any threshold, so
    # the verdict is not this test's (test_commbench_runs_are_gated_per_op_like_training_runs checks it)
    assert proc.returncode in (0, 1) and "distbench compare" in proc.stdout, proc.stdout + proc.stderr
    assert "all_reduce time" in proc.stdout and "all_gather time" in proc.stdout


@unit
def test_a_call_is_priced_by_commbench_at_its_op_and_size():
    """Inside the measured sizes log-log interpolation between their medians; beyond them the α-β fit;
    with one size measured, that size's median there and nothing elsewhere."""
    sizes = [1024, 4096, 16384]
    bench = summarize_commbench(synthetic_record("all_reduce", 2, sizes, [[[1e-4], [2e-4], [5e-4]]] * 2))
    assert call_time(bench, "all_reduce", 2048) == pytest.approx(np.sqrt(1e-4 * 2e-4))
    fit = bench["ops"]["all_reduce"]["fit"]
    assert call_time(bench, "all_reduce", 1 << 20) == pytest.approx(
        fit["alpha_s"] + (1 << 20) / fit["beta_busbw_Bps"]
    )
    assert call_time(bench, "all_gather", 2048) is None
    single = summarize_commbench(synthetic_record("all_reduce", 2, [1 << 20], [[[1e-3, 3e-3, 2e-3]]] * 2))
    assert call_time(single, "all_reduce", 1 << 20) == pytest.approx(2e-3)
    assert call_time(single, "all_reduce", 1 << 21) is None


EARLIER = Path(__file__).parent / "data" / "predict" / "torch-ddp"


@unit
def test_a_record_of_an_earlier_version_loads_and_reports_by_its_calls_alone(tmp_path, capsys):
    """Records made before commbench dropped its CPU-only series hold calls timed beside a compute thread
    (`under_load`, `times_under_load`) and 8 at a time (`burst_times`, each rank's `burst`), and a summary
    with their figures. They still load, their settings still parse, and their figures come from the calls
    timed alone: the summary, the prices, `harness results` and the report's table."""
    (record,) = load_records([EARLIER], kind="commbench")
    point = record["ranks"][0]["collectives"][0]
    assert {"times_under_load", "burst_times"} <= set(point) and run_config(record).role.commbench[
        "under_load"
    ]
    assert CommbenchSpec.from_dict(run_config(record).role.commbench).sizes[0] == 1024
    summary = summarize_commbench(record)
    first = summary["ops"]["all_reduce"]["points"][0]
    assert set(first) == {"bytes", "time_s", "algbw_Bps", "busbw_Bps", "times_s"}
    slowest = [max(r["collectives"][0]["times"][k] for r in record["ranks"]) for k in range(20)]
    assert call_time(summary, "all_reduce", 1024) == pytest.approx(float(np.median(slowest)))
    rows = commbench_rows([record])  # from the summary stored with the record, burst figures and all
    assert len(rows) == 17 and rows["time_s"].iloc[0] == pytest.approx(
        record["summary"]["ops"]["all_reduce"]["points"][0]["time_s"]["median"]
    )
    (tmp_path / "old.json").write_text(json.dumps(record))
    assert main(["report", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    assert "## Collectives (commbench)" in report and "| torch-ddp | all_reduce |" in report
