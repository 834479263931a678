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

from backends.commbench import BURST_CALLS, WrongResult, check_output, expected_output
from harness.analyze.baseline import trim
from harness.analyze.collectives import (
    call_time,
    commbench_rows,
    fit_alpha_beta,
    matched_comm,
    op_time_index,
    predicted_comm,
    summarize_commbench,
)
from harness.analyze.compare import compare_runs
from harness.analyze.metrics import bus_factor
from harness.cli import main
from harness.run.commbench import parse_sizes, whole_shares

unit = pytest.mark.unit


def synthetic_record(op: str, world: int, sizes: list[int], per_rank_times: list[list[list[float]]]) -> dict:
    """A commbench record whose rank r timed size i's calls as per_rank_times[r][i]."""
    return {
        "kind": "commbench",
        "run_id": f"synthetic-{op}-{world}",
        "status": "ok",
        "config": {"world_size": world, "commbench": {"dtype": "fp32", "ops": [op], "sizes": sizes}},
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
        record["config"].update(
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


@pytest.mark.parametrize("backend", list(OFFERED))
def test_every_stack_s_collectives_are_timed_checked_and_recorded(backend, out):
    """Each stack's own API, through its own launcher: every op it offers here, at every size, on both
    ranks, each checked against the known answer first (a wrong one would fail the run)."""
    record = commbench(out, "--backend", backend, *SMALL, "--under-load")
    assert record["kind"] == "commbench" and record["status"] == "ok", record.get("error")
    ops = record["summary"]["ops"]
    assert len(ops) == OFFERED[backend] == len(record["config"]["commbench"]["ops"])
    for op, entry in ops.items():
        assert [p["bytes"] for p in entry["points"]] == [1024, 65536]
        for p in entry["points"]:
            assert p["time_s"]["n"] == 3 and p["busbw_Bps"] == pytest.approx(
                p["bytes"] / p["time_s"]["median"] * bus_factor(op, 2)
            )
            assert p["time_under_load_s"]["n"] == 3  # timed beside a compute thread too
            assert p["time_burst_s"]["n"] == p["time_burst_under_load_s"]["n"] == 3  # and in bursts
    assert [len(r["collectives"]) for r in record["ranks"]] == [2 * OFFERED[backend]] * 2
    mode = {"tf-mwms": "sequential", "paddle-fleet": "sequential", "horovod": "async, fused"}.get(
        backend, "async"
    )
    assert [r["burst"] for r in record["ranks"]] == [{"calls": BURST_CALLS, "mode": mode}] * 2
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


def test_commbench_records_go_to_report_results_and_compare_beside_training_records(out, tmp_path):
    first = commbench(out, "--backend", "torch-ddp", *SMALL, "--ops", "allreduce,allgather")
    second = commbench(out, "--backend", "torch-ddp", *SMALL, "--ops", "allreduce,allgather")
    proc = harness("report", out)
    assert proc.returncode == 0, proc.stderr
    assert "## Collectives (commbench)" in proc.stdout and "| torch-ddp | all_reduce |" in proc.stdout
    assert "α µs per call in bursts" in proc.stdout
    proc = harness("results", out, "--kind", "commbench", "--csv", tmp_path / "cb.csv")
    assert proc.returncode == 0 and (tmp_path / "cb.csv").read_text().count("\n") == 1 + 2 * 2 * 2
    proc = harness(
        "compare", out / f"{first['run_id']}.json", out / f"{second['run_id']}.json", "--threshold", "0.99"
    )
    # one run a side, 3 calls of 1 KiB: noise alone moved an op's time by +217% once, past any threshold, so
    # the verdict is not this test's (test_commbench_runs_are_gated_per_op_like_training_runs checks it)
    assert proc.returncode in (0, 1) and "distbench compare" in proc.stdout, proc.stdout + proc.stderr
    assert "all_reduce time" in proc.stdout and "all_gather time" in proc.stdout


@unit
def test_a_traced_call_is_priced_by_commbench_at_its_op_and_size():
    """Inside the measured sizes log-log interpolation; beyond them the α-β fit."""
    sizes = [1024, 4096, 16384]
    bench = summarize_commbench(synthetic_record("all_reduce", 2, sizes, [[[1e-4], [2e-4], [5e-4]]] * 2))
    assert call_time(bench, "all_reduce", 2048) == pytest.approx(np.sqrt(1e-4 * 2e-4))
    fit = bench["ops"]["all_reduce"]["fit"]
    assert call_time(bench, "all_reduce", 1 << 20) == pytest.approx(
        fit["alpha_s"] + (1 << 20) / fit["beta_busbw_Bps"]
    )
    assert call_time(bench, "all_gather", 2048) is None
    assert call_time(bench, "all_reduce", 2048, under_load=True) is None  # not measured under load
    calls = [
        {"op": "all_reduce", "size_bytes": 4096, "time_s": t, "overlapped_s": None, "dtype": "float"}
        for t in (6e-4, 2e-4)
    ]
    run = {"ranks": [{"comm_trace": {"steps": 1, "collectives": [calls[r]]}} for r in range(2)]}
    priced = predicted_comm(run, {"summary": bench})["ops"]["all_reduce"]
    assert priced["predicted_s_per_step"] == pytest.approx(2e-4)
    assert priced["ratio"] == pytest.approx(3.0) and priced["least_waiting_ratio"] == pytest.approx(1.0)


@unit
def test_a_call_among_others_queued_back_to_back_is_priced_per_call_of_a_burst():
    """Bursts are timed up to 64 KiB here: a call alone takes 1 ms, one of a burst 0.1 ms idle (medians,
    log-log between sizes) and, beside compute, 0.2 ms of α plus S / 1 GB/s (the fit of the means). Above
    the largest burst size, and in a record without bursts, a burst call is priced as a call alone."""
    sizes = [1 << 10, 1 << 16, 1 << 20]
    record = synthetic_record("all_gather", 2, sizes, [[[1e-3] * 5] * 3] * 2)
    record["config"]["commbench"]["under_load"] = True
    for rank in record["ranks"]:
        for point in rank["collectives"]:
            point["times_under_load"] = [3e-3] * 5
            if point["bytes"] <= 1 << 16:
                point["burst_times"] = [1e-4 + point["bytes"] / 2 / 1e9] * 5
                point["burst_times_under_load"] = [1e-4 + point["bytes"] / 2 / 1e9] * 4 + [
                    3e-4 + point["bytes"] / 2 / 1e9
                ]
    bench = summarize_commbench(record)
    assert bench["ops"]["all_gather"]["points"][0]["time_burst_s"]["n"] == 5
    assert "time_burst_s" not in bench["ops"]["all_gather"]["points"][2]
    ends = [1e-4 + (1 << 9) / 1e9, 1e-4 + (1 << 15) / 1e9]  # log-log between the burst medians around it
    assert call_time(bench, "all_gather", 1 << 12, burst=True) == pytest.approx(
        np.exp(np.interp(12, [10, 16], np.log(ends)))
    )
    assert call_time(bench, "all_gather", 512, burst=True) == pytest.approx(1e-4 + 256 / 1e9)  # the fit
    assert call_time(bench, "all_gather", 1 << 12) == pytest.approx(1e-3)
    loaded = call_time(bench, "all_gather", 1 << 12, under_load=True, burst=True)
    assert loaded == pytest.approx(1.4e-4 + (1 << 12) / 2 / 1e9, rel=1e-6)
    assert call_time(bench, "all_gather", 1 << 20, burst=True) == pytest.approx(1e-3)  # above the bursts
    before_bursts = summarize_commbench(synthetic_record("all_gather", 2, sizes, [[[1e-3] * 5] * 3] * 2))
    assert call_time(before_bursts, "all_gather", 1 << 12, burst=True) == pytest.approx(1e-3)
    record.update(summary=bench, backend_info={"label": "torch-ddp"})  # what report and results read
    record["config"]["device"] = "cpu"
    rows = commbench_rows([record])
    assert list(rows["time_burst_s"].isna()) == [False, False, True]
    assert rows["time_burst_s"].iloc[0] == pytest.approx(ends[0])
    assert rows["alpha_burst_s"].iloc[0] == pytest.approx(1e-4)


@unit
def test_calls_beside_a_compute_thread_are_priced_by_the_fit_of_their_means():
    """Under load a call runs at once or waits for a time slice, so its times are a mixture: here 15 calls
    of 0.4 ms and 5 of 4.4 ms at every size plus S / 1 GB/s. The median (the fast mode) would price the
    step's calls 1 ms short each; the fit of the means gives α = 0.4 + 1 ms = 1.4 ms, β = 1 GB/s. The idle
    series keeps its own medians and fit."""
    sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 22]
    record = synthetic_record("all_reduce", 2, sizes, [[[1e-4 + s / 1e9] * 5 for s in sizes]] * 2)
    record["config"]["commbench"]["under_load"] = True
    for rank in record["ranks"]:
        for point in rank["collectives"]:
            wire = point["bytes"] / 1e9
            point["times_under_load"] = [4e-4 + wire] * 15 + [4.4e-3 + wire] * 5
    bench = summarize_commbench(record)
    assert bench["under_load"]
    fit = bench["ops"]["all_reduce"]["fit_under_load"]
    assert fit["alpha_s"] == pytest.approx(1.4e-3, rel=1e-6) and fit["beta_busbw_Bps"] == pytest.approx(1e9)
    assert call_time(bench, "all_reduce", 1 << 21, under_load=True) == pytest.approx(1.4e-3 + (1 << 21) / 1e9)
    one_size = synthetic_record("all_reduce", 2, [1 << 20], [[[1e-3] * 5]] * 2)
    for rank in one_size["ranks"]:
        rank["collectives"][0]["times_under_load"] = [2e-3] * 3 + [5e-3]
    single = summarize_commbench(one_size)  # no fit from one size: its mean, at that size only
    assert call_time(single, "all_reduce", 1 << 20, under_load=True) == pytest.approx(2.75e-3)
    assert call_time(single, "all_reduce", 1 << 21, under_load=True) is None
    idle = [1e-4 + s / 1e9 for s in (1 << 20, 1 << 22)]  # log-log between the idle medians around it
    assert call_time(bench, "all_reduce", 1 << 21) == pytest.approx(np.sqrt(idle[0] * idle[1]))


@unit
def test_a_run_s_calls_are_held_against_commbench_as_the_last_rank_to_arrive_saw_them():
    """The matched cross-check. Commbench (2 ranks): idle 1 ms at 4 KiB and 2 ms at 16 KiB; under load
    3 ms and 6 ms. The run: 3 traced steps, each an all-reduce of 4 KiB that ran beside compute (80% of
    it) then one of 16 KiB that did not; rank 0 waited 5 ms for rank 1 in every call, so rank 1's times
    are the calls'. Beside compute the statistic is commbench's there, a mean (3, 4, 8 ms: 5 ms); idle a
    median (2, 2, 20 ms: 2 ms, the stalled call left out). Measured 7 ms against 3 + 2 = 5 ms priced."""
    sizes = [4096, 16384]
    record = synthetic_record("all_reduce", 2, sizes, [[[1e-3] * 5, [2e-3] * 5]] * 2)
    record["config"]["commbench"]["under_load"] = True
    for rank in record["ranks"]:
        for point, t in zip(rank["collectives"], (3e-3, 6e-3)):
            point["times_under_load"] = [t] * 5
    bench = {"summary": summarize_commbench(record)}

    def call(size, t, overlapped):
        return {"op": "all_reduce", "size_bytes": size, "time_s": t, "overlapped_s": overlapped}

    rank1 = [(3e-3, 2e-3), (4e-3, 2e-3), (8e-3, 20e-3)]
    ranks = [[], []]
    for beside, idle in rank1:
        for r, wait in ((0, 5e-3), (1, 0.0)):
            ranks[r] += [call(4096, beside + wait, 0.8 * (beside + wait)), call(16384, idle + wait, 0.0)]
    run = {"ranks": [{"comm_trace": {"steps": 3, "collectives": calls}} for calls in ranks]}
    matched = matched_comm(run, bench)
    assert matched["statistic"] == "each call position's median or mean over steps"
    assert (matched["calls_per_step"], matched["calls_beside_compute_per_step"]) == (2, 1)
    assert matched["predicted_s_per_step"] == pytest.approx(5e-3)
    assert matched["measured_s_per_step"] == pytest.approx(7e-3)
    # a time rank 1 did not record: rank 0's (with its wait) is the only one there is, not zero
    ranks[1][0] = {**ranks[1][0], "time_s": None}
    assert matched_comm(run, bench)["measured_s_per_step"] == pytest.approx((8e-3 + 4e-3 + 8e-3) / 3 + 2e-3)
    # ranks whose calls differ cannot be paired call by call
    del ranks[0][-1]
    assert matched_comm(run, bench) is None
    # Horovod fuses what each cycle finds ready, so its steps differ: each call priced, the mean over steps
    # (one rank's timeline, no overlap known: every call idle)
    varying = [call(4096, 1e-3, None), call(16384, 3e-3, None), call(4096, 2e-3, None)]
    run = {"ranks": [{"comm_trace": {"steps": 2, "collectives": varying}}]}
    matched = matched_comm(run, bench)
    assert matched["statistic"] == "mean over steps" and matched["calls_per_step"] == 1.5
    assert matched["measured_s_per_step"] == pytest.approx(3e-3)
    assert matched["predicted_s_per_step"] == pytest.approx(2e-3)


@unit
def test_the_compute_load_holds_a_core_while_the_calls_run_and_stops_after():
    """The load is real CPU work beside the calls: its thread's own CPU clock runs while this thread only
    sleeps, to 0.3 s (on a busy machine it gets less of a core, so the test waits longer, up to two
    minutes), with matrix products done; and the thread is gone when the block ends."""
    import threading
    import time

    from backends.commbench import ComputeLoad

    with ComputeLoad() as load:
        clock = time.pthread_getcpuclockid(load._thread.ident)
        start = time.monotonic()
        while time.clock_gettime(clock) < 0.3 and time.monotonic() < start + 120:
            time.sleep(0.01)
        used, wall = time.clock_gettime(clock), time.monotonic() - start
    assert used >= 0.3 and load.products > 0, (used, load.products)
    # Computing, it runs whenever it is scheduled: a tenth of a core even beside 19 other busy threads on
    # two cores. A loop that sleeps between small steps stays far below.
    assert used >= 0.1 * wall, (used, wall)
    assert not any(t.name == "commbench-load" for t in threading.enumerate())


@unit
@pytest.mark.parametrize("flags, expected", [([], False), (["--under-load"], True)])
def test_commbench_times_calls_under_load_when_asked(flags, expected):
    """Idle calls only by default (the nccl-tests figures, in the time the issue allows); --under-load adds
    the times beside a compute thread that the local prediction profile prices with."""
    from harness.cli import make_parser
    from harness.run.commbench import build_commbench_config

    argv = ["commbench", "--backend", "torch-ddp", "--gpus", "2", "--device", "cpu", *flags]
    cfg = build_commbench_config(make_parser().parse_args(argv))
    assert cfg.commbench["under_load"] is expected


@unit
def test_the_cross_check_s_commbench_spans_the_powers_of_two_around_the_traced_sizes():
    """scripts/comm_crosscheck.py times commbench only around what the run sent: DDP's two buckets on tiny
    (3,230,720 and 1,048,576 B) between 1 MiB and 4 MiB, 5,000 B from 4 KiB, an 8-byte norm scalar from 1 KiB
    (commbench's smallest); sizes asked for pass as they are."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "comm_crosscheck.py"
    spec = importlib.util.spec_from_file_location("comm_crosscheck", path)
    crosscheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(crosscheck)

    def run(*sizes):
        calls = [{"op": "all_reduce", "size_bytes": s} for s in sizes]
        return {"ranks": [{"comm_trace": {"collectives": calls}}, {"comm_trace": None}]}

    assert crosscheck.sizes_around(run(3_230_720, 1_048_576), "traced") == f"{1 << 20}:{1 << 22}"
    assert crosscheck.sizes_around(run(8, 5000), "traced") == f"{1 << 10}:{1 << 13}"
    assert crosscheck.sizes_around(run(5000, 3_230_720), "traced") == f"{1 << 12}:{1 << 22}"
    assert crosscheck.sizes_around(run(3_230_720), "1K:64M") == "1K:64M"
