"""torch-ddp end to end through `harness run`: the record, learning, DDP correctness, comm ratio, failures."""

import json
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import (
    assert_cpu_worker_probes,
    assert_exposed_as_measured,
    assert_traced_steps_follow_the_schedule,
    run_record,
    run_with_output,
)
from test_equivalence import ISSUE_SHAPE, ddp_reference

from core.records import run_config

pytestmark = pytest.mark.slow
FAST = ["--steps", "6", "--warmup", "1", "--timeout", "180"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, Path]:
    """torch-ddp on `tiny` at 2 ranks as a user runs it (compute method and trace by default), with its
    --out folder: the full-record test's run, and the 2-rank side of the comm-ratio test."""
    out = tmp_path_factory.mktemp("two") / "results"
    rec = run_record(
        out,
        "--backend",
        "torch-ddp",
        "--gpus",
        "2",
        "--workload",
        "tiny",
        "--steps",
        "20",
        "--timeout",
        "180",
        "--tensorboard",
        out.parent / "tensorboard",  # imported only when asked for: this run is its path's test
    )
    return rec, out


def test_two_worker_record_has_every_field_and_loss_decreases(two_ranks):
    rec, out = two_ranks
    (curves,) = (out.parent / "tensorboard").iterdir()
    assert rec["run_id"] in curves.name and any(curves.glob("events.out.tfevents.*"))
    assert (
        rec["status"] == "ok"
        and rec["error"] is None
        and rec["schema_version"] == 4
        and rec["kind"] == "training"
    )
    assert [r["rank"] for r in rec["ranks"]] == [0, 1]
    assert_cpu_worker_probes(rec)
    for r in rec["ranks"]:
        assert len(r["step_times"]) == len(r["losses"]) == len(r["data_prep"]) == 20
        assert r["memory"]["peak_rss"] > 50e6 and r["threads"] == 1
        # fp32 params + grads + AdamW moments, unsharded, plus AdamW's 4-byte step counter per tensor
        assert r["model_state_bytes"]["total"] == 16 * 1_071_872 + 4 * 52
        assert len(r["compute_only_step_times"]) == 5
        assert len(r["comm_trace"]["step_times"]) == 2  # --trace-steps, after the measured steps
        settings = r["process_settings"]  # as they reached the worker through torchrun
        assert settings["OMP_NUM_THREADS"] == str(run_config(rec).topology.threads_per_worker)
        assert int(settings["MALLOC_TRIM_THRESHOLD_"]) > 0 and r["minor_faults_per_step"] >= 0
        assert min(r["data_prep"]) > 0  # the batches are prepared before the step's clock starts
        assert r["memory"]["peak_rss_scope"] == "after warm-up"
    m = rec["summary"]["comm_measured"]
    # every gradient (1,071,872 fp32 parameters, counted by hand) all-reduced once per step in DDP's buckets
    assert (
        m["method"] == "torch profiler (kineto)"
        and m["ranks_traced"] == 2
        and set(m["ops"]) == {"all_reduce"}
    )
    assert m["ops"]["all_reduce"]["size_bytes_per_step"] == 4 * 1_071_872 and m["vs_analytic"] == 1.0
    assert_traced_steps_follow_the_schedule(rec)  # the two buckets the prediction models, in their order
    s = rec["summary"]
    for key in (
        "throughput_tokens_per_s",
        "throughput_samples_per_s",
        "per_device_tokens_per_s",
        "comm_bytes_per_rank_per_step",
        "model_flops_per_step",
        "t_compute_s",
    ):
        assert s[key] is not None and s[key] >= 0, key
    assert_exposed_as_measured(s)
    assert s["step_time_s"]["p10"] <= s["step_time_s"]["median"] <= s["step_time_s"]["p90"]
    assert s["mfu"] is None  # CPU: peak unknown, never guessed
    assert s["compute_method"] == "no_sync"
    assert s["loss_last"] < s["loss_first"] - 0.1, s["losses"]
    env = rec["environment"]
    assert env["device_type"] == "cpu" and env["device_kind"].startswith("cpu")
    assert env["versions"]["torch"] and env["world_size"] == 2 and env["command_line"] and env["git"]
    assert env["process_settings"] == rec["ranks"][0]["process_settings"]
    assert not list(out.glob(".*.tmp")), "half-written files left behind"


def final_weights(rec):
    return np.load(f"{rec['launch']['log_dir']}/weights_rank0.npz")


# One rank, torch-ddp's whole global batch in one micro-batch, on ISSUE_SHAPE of tests/test_equivalence.py
# (three blocks, synthetic data, 10 steps): the run the tests below hold two ranks (that shape's torch-ddp
# reference, which the suite launches once for every module that compares against it), a token file and
# world size 1 against. (Gradient accumulation against one micro-batch, for torch-ddp as for every stack:
# tests/test_equivalence.py.)
ONE_RANK = ["--backend", "torch-ddp", *ISSUE_SHAPE.args(gpus=1)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    return run_record(tmp_path_factory.mktemp("one"), *ONE_RANK, "--dump-weights")


def test_one_worker_and_two_workers_reach_the_same_weights(one_rank, tmp_path_factory):
    """DDP correctness: the global batch on one worker == half of it on each of two (fp32). Tolerance 2e-5
    absolute on weights of scale ~0.02: the all-reduce sums in a different order than one process does, and
    AdamW normalises updates, so float32 rounding differences (~1e-7) grow to at most ~1e-6 over 10 steps."""
    two = ddp_reference(ISSUE_SHAPE, tmp_path_factory)
    assert [run_config(r).topology.world_size for r in (one_rank, two)] == [1, 2]
    assert run_config(one_rank).batch.micro_batch == 2 * run_config(two).batch.micro_batch
    np.testing.assert_allclose(one_rank["summary"]["losses"], two["summary"]["losses"], rtol=1e-5)
    w1, w2 = final_weights(one_rank), final_weights(two)
    assert set(w1.files) == set(w2.files)
    for name in w1.files:
        np.testing.assert_allclose(w1[name], w2[name], atol=2e-5, rtol=0, err_msg=name)


def test_comm_ratio_is_zero_for_one_worker_and_measured_for_two(one_rank, two_ranks):
    """One rank has no communication to expose. Two ranks measure t_compute with sync off and derive the
    ratio from it; only gross bounds hold on a live run, since on a loaded machine the sync-off steps can
    take as long as the synced ones (the ratio is then about 0 or unresolved, the volume per exposed second
    unknown). That the ratio is (t_step - t_compute) / t_step is tests/test_metrics.py's, on recorded
    times."""
    alone = one_rank["summary"]
    assert alone["exposed_comm_ratio"] == 0.0 and alone["compute_method"] == "none"
    s = two_ranks[0]["summary"]
    assert s["compute_method"] == "no_sync" and s["t_compute_s"] > 0, s
    assert_exposed_as_measured(s)
    assert s["comm_bytes_per_rank_per_step"] > 0 and s["comm_measured"]["bytes_per_rank_per_step"] > 0, s


def assert_phases(shown: str, *phases: str) -> None:
    """The progress lines name each phase, in this order (a phase's first line starts with its name)."""
    firsts = [line.split("] ", 1)[1] for line in shown.splitlines() if line.startswith("[")]
    at = [next((i for i, line in enumerate(firsts) if line.startswith(p)), None) for p in phases]
    assert None not in at and at == sorted(at), f"phases {phases} at {at} in:\n{shown}"


def test_failing_rank_is_recorded_with_its_log_and_nothing_is_left_behind(out):
    rec, shown = run_with_output(
        out, "--backend", "torch-ddp", "--gpus", "2", "--inject-fault", "1:2:raise", *FAST, expect_rc=1
    )
    assert_phases(shown, "launching", "warm-up", "measured", "writing the record", "failed")
    assert rec["status"] == "failed"
    assert rec["error"]["rank"] == 1 and "injected fault at step 2" in rec["error"]["message"]
    assert any("injected fault" in line for line in rec["error"]["log_tail"])
    log_dir = rec["launch"]["log_dir"]
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if log_dir in " ".join(p.info["cmdline"] or [])]
    assert not leftovers
    assert json.loads((out / f"{rec['run_id']}.json").read_text())["status"] == "failed"


def test_token_file_data_and_activation_checkpointing(one_rank, out, tmp_path):
    """--data reads the memory-mapped file; checkpointing recomputes activations without changing the math."""
    tokens = (np.arange(200_000) * 7919 % ISSUE_SHAPE.vocab).astype(np.uint16)
    data = tmp_path / "train.bin"
    tokens.tofile(data)
    common = [*ONE_RANK, "--data", data]
    plain = run_record(out, *common)
    ckpt = run_record(out, *common, "--activation-checkpointing")
    assert run_config(plain).batch.data_path == str(data) and run_config(ckpt).model.activation_checkpointing
    np.testing.assert_allclose(plain["summary"]["losses"], ckpt["summary"]["losses"], rtol=1e-6)
    assert plain["summary"]["losses"][0] != one_rank["summary"]["losses"][0]  # not the synthetic batches
