"""tf-mwms and paddle-fleet end to end through `harness run`: they train the same model on the same data as
torch-ddp and report the same losses, with 1 and 2 workers, and write the full record.

They run on the drawn shape of tests/test_equivalence.py (RECORD_SHAPE), whose torch-ddp reference they
share; every run reads torch-ddp's global batch of 2 x B sequences, laid out to exercise each path: 1 worker
accumulates two micro-batches of B (accumulation alone); 2 workers all-reduce every step (MWMS's replica
gradients, B each), or accumulate two micro-batches of B/2 under no_sync and sync once (Paddle). The same
losses on other shapes, and MWMS with accumulation: tests/test_equivalence.py.

The 2-worker tf-mwms run also shows that its worker's synchronize() runs in a multi-worker MWMS job and
leaves the losses alone (tf.test.experimental.sync_devices(), which syncs every logical device, fails there:
the other workers' devices are in the device list). What a CPU run cannot show is that it waits for the
step's all-reduce and optimizer tail: on CPU a tf.function call returns only after all of its ops ran.
The GPU tier (tests/test_gpu_tier.py) runs it where synchronize() has a device to wait for.
"""

import json
from pathlib import Path

import pytest
from conftest import (
    assert_cpu_worker_probes,
    assert_exposed_as_measured,
    assert_model_state_as_predicted,
    assert_traced_steps_follow_the_schedule,
    run_record,
)
from test_equivalence import CROSS_FRAMEWORK_LOSS_ATOL, RECORD_SHAPE, STEPS, assert_same_losses, ddp_reference

from backends import get_backend
from core.config import InvalidConfig, RunConfig
from workloads.spec import PRESETS

BACKENDS = ("tf-mwms", "paddle-fleet")
COMPUTE_STEPS = ["--compute-steps", "2", "--isolated-repeats", "1"]  # repeats joined: test_ddp.py
# (backend, workers) -> micro-batches accumulated per step
LAYOUTS = {("tf-mwms", 1): 2, ("tf-mwms", 2): 1, ("paddle-fleet", 1): 2, ("paddle-fleet", 2): 2}
SPEC = RECORD_SHAPE.spec
N = SPEC.n_params
# Optimizer bytes beyond the two fp32 AdamW moments, counted from each framework's own state: Keras keeps
# an int64 iteration count and an fp32 learning rate; Paddle a beta1 and a beta2 power per tensor.
OPTIMIZER_EXTRA = {"tf-mwms": 8 + 4, "paddle-fleet": len(SPEC.parameter_shapes()) * 2 * 4}


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory):
    return ddp_reference(RECORD_SHAPE, tmp_path_factory)["summary"]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_trains_like_torch_ddp_with_a_full_record(out, ddp_losses, backend, gpus):
    layout = RECORD_SHAPE.args(gpus=gpus, accum=LAYOUTS[backend, gpus])
    args = ["--backend", backend, *layout, *COMPUTE_STEPS]
    rec = traced_tf_run(out, args) if (backend, gpus) == ("tf-mwms", 2) else run_record(out, *args)
    assert rec["status"] == "ok" and rec["error"] is None
    assert [r["rank"] for r in rec["ranks"]] == list(range(gpus))
    assert_cpu_worker_probes(rec)
    assert_model_state_as_predicted(rec)
    for r in rec["ranks"]:
        assert len(r["step_times"]) == len(r["losses"]) == len(r["data_prep"]) == STEPS
        assert r["memory"]["peak_rss"] > 50e6 and r["device"].startswith("cpu")
        state = r["model_state_bytes"]  # fp32 params, grads and AdamW moments, unsharded
        assert (state["params"], state["grads"]) == (4 * N, 4 * N)
        assert state["optimizer"] == 8 * N + OPTIMIZER_EXTRA[backend]
        assert (
            r["process_settings"] == rec["ranks"][0]["process_settings"] and r["minor_faults_per_step"] >= 0
        )
        assert r["process_settings"]["MALLOC_MMAP_THRESHOLD_"]  # reached the worker through the launcher
    s = rec["summary"]
    assert_same_losses(
        s["losses"], ddp_losses, f"{backend} x {gpus} on {RECORD_SHAPE}", CROSS_FRAMEWORK_LOSS_ATOL
    )
    assert s["loss_last"] < s["loss_first"]
    assert s["throughput_tokens_per_s"] > 0 and s["model_state_bytes_per_rank"] > 0
    if gpus == 1:
        assert s["exposed_comm_ratio"] == 0.0
        assert s["compute_method"] == "none" and s["comm_bytes_per_rank_per_step"] == 0
    else:  # t_compute measured: Paddle's DataParallel by no_sync, MWMS by the isolated counterfactual
        assert_exposed_as_measured(s)
        assert s["compute_method"] == {"tf-mwms": "isolated", "paddle-fleet": "no_sync"}[backend]
        assert s["t_compute_s"] > 0 and s["comm_bytes_per_rank_per_step"] == 2 * (2 - 1) / 2 * N * 4
    framework = {"tf-mwms": "tensorflow", "paddle-fleet": "paddle"}[backend]
    assert rec["backend_info"]["framework"] == framework and rec["environment"]["versions"][framework]
    if (backend, gpus) == ("paddle-fleet", 2):  # the trace is on by default
        assert_reducer_log_and_wire_count_the_gradients_once_per_step(rec)
    if (backend, gpus) == ("tf-mwms", 2):
        assert_tf_trace_counts_every_gradient_byte_once_per_step(rec)


# gloo's framing on top of the payload: a header per message it sends, a few buckets and chunks a step
GLOO_FRAMING_BYTES_PER_STEP = 4096
GLOO_FRAMING_BYTES_PER_CALL = 512  # a call on one tensor: its messages' headers (measured: 216 B)


def assert_wire_bytes_are_the_gradients_once_per_step(m: dict, wires: list[dict]) -> None:
    """Each of 2 ranks sends half its gradients in the all-reduce's reduce-scatter and half in its
    all-gather: 4N bytes a step (2(n-1)/n x S with S = 4N), plus gloo's framing, on its TCP connections;
    and over each connection between the two ranks, what one end sent is what the other received, but
    for a message in flight at the edge of the traced windows: each rank opens and closes its own, so a
    message one sent just before its window closed can reach the other after the other's had (under load,
    192 bytes of one connection's 978 KB were). A rank's totals also hold its own launcher's and store's
    connections, whose traffic falls in the traced window or not as the timing goes."""
    for rank, sent in m["wire_sent_bytes_per_step"].items():
        assert 4 * N <= sent <= 4 * N + GLOO_FRAMING_BYTES_PER_STEP, (rank, sent, 4 * N)
    ends = [{tuple(c["endpoints"]): c for c in w["connections"]} for w in wires]
    between = [(c, ends[1][(p, loc)]) for (loc, p), c in ends[0].items() if (p, loc) in ends[1]]
    assert sum(c0["sent_bytes"] for c0, _ in between) >= 4 * N, (wires, "the gradients' bytes between ranks")
    for c0, c1 in between:
        for sent, received in (
            (c0["sent_bytes"], c1["received_bytes"]),
            (c1["sent_bytes"], c0["received_bytes"]),
        ):
            assert abs(sent - received) <= GLOO_FRAMING_BYTES_PER_CALL, (c0, c1)


def assert_reducer_log_and_wire_count_the_gradients_once_per_step(rec: dict) -> None:
    """Paddle's reducer log: DataParallel's fused all-reduces of a step hold every fp32 gradient once
    (S = 4N), each timed; the wire agrees."""
    m = rec["summary"]["comm_measured"]
    assert m["method"].startswith("paddle reducer log") and m["ranks_traced"] == 2, m
    assert m["ops"]["all_reduce"]["size_bytes_per_step"] == 4 * N, m
    assert m["vs_analytic"] == pytest.approx(1.0) and m["ops"]["all_reduce"]["ranks_agree"]
    for r in rec["ranks"]:
        calls = r["comm_trace"]["collectives"]
        assert calls and all(c["time_s"] > 0 and c["dtype"] == "float32" for c in calls), calls
    assert_wire_bytes_are_the_gradients_once_per_step(m, [r["comm_trace"]["wire"] for r in rec["ranks"]])
    assert_traced_steps_follow_the_schedule(rec)  # the reducer's groups are the prediction's


# TF 2.21's profiler can kill a worker as it stops (a double free while it collects the trace; README): the
# run stays ok, its incident names that rank and its trace is lost. It can also lose a rank's last collective
# event (the record names that rank in ranks_short). A run that ends either way is run again, up to this many
# times in all; any other incident or failure fails the test.
TF_PROFILE_ATTEMPTS = 3


def traced_tf_run(out, args: list[str]) -> dict:
    """A tf-mwms run with its trace (on by default), run again if the profiler lost the trace."""
    for _ in range(TF_PROFILE_ATTEMPTS):
        rec = run_record(out, *args)
        assert rec["status"] == "ok", rec["error"]
        if rec["incident"]:
            tail = " ".join(rec["incident"]["log_tail"])
            assert rec["incident"]["phase"] == "collective trace", rec["incident"]
            assert "Profiler session collecting data" in tail, rec["incident"]
            continue
        if not rec["summary"]["comm_measured"]["ops"]["all_reduce"]["ranks_short"]:
            break
    assert not rec["incident"], f"the profiler killed a worker in {TF_PROFILE_ATTEMPTS} runs of {out}"
    return rec


def assert_tf_trace_counts_every_gradient_byte_once_per_step(rec: dict) -> None:
    """The trace's all-reduce bytes per step are the model's fp32 gradient bytes (MWMS packs them into one
    all-reduce per step), read from TensorFlow's profiler and the step's graph."""
    m = rec["summary"]["comm_measured"]
    assert m["method"].startswith("tf.profiler") and m["ranks_traced"] == 2
    assert m["ops"]["all_reduce"]["size_bytes_per_step"] == 4 * N and m["vs_analytic"] == 1.0
    for r in rec["ranks"]:
        calls = r["comm_trace"]["collectives"]
        assert len(calls) == 2 and all(c["time_s"] > 0 and c["dtype"] == "float32" for c in calls)
    assert_traced_steps_follow_the_schedule(rec)


@pytest.mark.slow
def test_paddle_sharding_stage_1_shards_the_optimizer_state(out, ddp_losses):
    rec = run_record(
        out,
        "--backend",
        "paddle-fleet",
        "--sharding-stage",
        "1",
        "--compute-method",
        "none",
        *RECORD_SHAPE.args(accum=2),
        *COMPUTE_STEPS,
    )
    assert rec["status"] == "ok" and rec["backend_info"]["sharding"] == "optimizer"
    what = f"paddle sharding 1 on {RECORD_SHAPE}"
    assert_same_losses(rec["summary"]["losses"], ddp_losses, what, CROSS_FRAMEWORK_LOSS_ATOL)
    held = [r["model_state_bytes"]["optimizer"] for r in rec["ranks"]]
    assert sum(held) == 8 * N + OPTIMIZER_EXTRA["paddle-fleet"] and max(held) < 0.9 * sum(held)
    assert_model_state_as_predicted(rec)
    # On the wire: each gradient reduced to its owner (gloo: a ring reduce-scatter, then the non-owner's
    # half to the owner) and each updated tensor broadcast by it: 1.25 x 4N a rank on average, which the
    # analytic volume now counts (the gather as an all-gather of N/2), plus gloo's framing of one reduce and
    # one broadcast per tensor.
    m = rec["summary"]["comm_measured"]
    assert m["method"] == "kernel TCP counters" and m["ops"] == {}, m  # outside the reducer: no log
    analytic = rec["summary"]["comm_bytes_per_rank_per_step"]
    assert analytic == pytest.approx(1.25 * 4 * N, abs=4)  # N // 2 elements gathered: N may be odd
    calls = 2 * len(SPEC.parameter_shapes())
    assert analytic <= m["bytes_per_rank_per_step"] <= analytic + calls * GLOO_FRAMING_BYTES_PER_CALL, m
    assert "gather to the root" in rec["summary"]["comm_volume_method"]


# --------------------------------------------------------------------- launch commands (no process started)
def second_of_two_nodes(**overrides) -> RunConfig:
    """Node 1 of 2, two workers each: the layout a multi-node orchestrator hands every adapter."""
    layout = {"nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1", "hosts": ["10.0.0.1", "10.0.0.2"]}
    return RunConfig.build(
        backend="",
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=4,
        device="cpu",
        **{**layout, **overrides},
    )


@pytest.mark.unit
def test_tf_mwms_gives_each_worker_of_this_node_the_whole_cluster_and_its_global_index():
    processes = get_backend("tf-mwms").launch(second_of_two_nodes(), Path("/run"), 29500, []).processes
    assert len(processes) == 2
    for i, process in enumerate(processes):
        tf_config = json.loads(process.env["TF_CONFIG"])
        assert tf_config["cluster"]["worker"] == [
            "10.0.0.1:29500",
            "10.0.0.1:29501",
            "10.0.0.2:29502",
            "10.0.0.2:29503",
        ]
        assert tf_config["task"] == {"type": "worker", "index": 2 + i} and process.env[
            "DISTBENCH_RANK"
        ] == str(2 + i)
    alone = (
        get_backend("tf-mwms")
        .launch(second_of_two_nodes().evolve(isolated_index=3), Path("/run"), 1, [])
        .processes
    )
    assert (
        len(alone) == 1
        and json.loads(alone[0].env["TF_CONFIG"]) == {}
        and alone[0].env["DISTBENCH_RANK"] == "0"
    )
    with pytest.raises(InvalidConfig, match="host of every node"):
        get_backend("tf-mwms").validate(second_of_two_nodes(hosts=[]))


@pytest.mark.unit
def test_paddle_fleet_launches_this_node_against_the_master():
    [launcher] = get_backend("paddle-fleet").launch(second_of_two_nodes(), Path("/run"), 29500, []).processes
    assert launcher.argv[1:3] == ["-m", "paddle.distributed.launch"] and launcher.argv[-1] == "/run"
    assert {"--nnodes=2", "--rank=1", "--master=10.0.0.1:29500", "--nproc_per_node=2"} <= set(launcher.argv)
    [alone] = (
        get_backend("paddle-fleet")
        .launch(second_of_two_nodes().evolve(isolated_index=3), Path("/run"), 29600, [])
        .processes
    )
    assert {"--nproc_per_node=1", "--ips=127.0.0.1", "--start_port=29600"} <= set(alone.argv)
    assert not any(a.startswith(("--nnodes", "--master")) for a in alone.argv)


def paddle_config(device: str, precision: str = "fp32", stage: int = 0, commbench: dict | None = None):
    return RunConfig.build(
        "paddle-fleet",
        {"sharding_stage": stage},
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=2,
        device=device,
        precision=precision,
        commbench=commbench,
    )


@pytest.mark.unit
def test_paddle_refuses_before_launch_what_its_cpu_build_cannot_train():
    """bf16/fp16 (paddle.amp does not cast on CPU) and sharding stages 2-3 (GPU/XPU only) on CPU are
    refused by the adapter, naming what works, where the workers used to launch and fail; on cuda they
    stand, and a commbench's bf16 messages are no autocast."""
    paddle = get_backend("paddle-fleet")
    for precision in ("bf16", "fp16"):
        with pytest.raises(InvalidConfig, match=f"--precision {precision} needs --device cuda.*fp32"):
            paddle.validate(paddle_config("cpu", precision))
        paddle.validate(paddle_config("cuda", precision))
    for stage in (2, 3):
        with pytest.raises(InvalidConfig, match=f"--sharding-stage {stage} needs --device cuda"):
            paddle.validate(paddle_config("cpu", stage=stage))
    paddle.validate(paddle_config("cpu", stage=1))
    paddle.validate(paddle_config("cpu", "bf16", commbench={"ops": ["all_reduce"], "sizes": [1024]}))


@pytest.mark.unit
@pytest.mark.subprocess
def test_a_paddle_bf16_run_on_cpu_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            "--backend",
            "paddle-fleet",
            "--gpus",
            "2",
            "--device",
            "cpu",
            "--precision",
            "bf16",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "needs --device cuda" in proc.stderr and not list(tmp_path.glob("*.json"))
