"""torch-fsdp, deepspeed (ZeRO 1-3) and horovod: the same model as torch-ddp, full records, and what each
really shards. Training runs go through `harness run`; the adapters are also checked without launching."""

import argparse
import glob
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    CPU_WARMUP_TRANSIENT_BYTES,
    assert_exposed_as_measured,
    assert_model_state_as_predicted,
    assert_traced_steps_follow_the_schedule,
    launched_once,
    run_record,
)
from test_equivalence import ISSUE_SHAPE, STEPS, assert_same_losses, ddp_reference

from backends import get_backend
from backends.base import WORKER_SCRIPT
from backends.deepspeed_zero import shm_segments
from backends.deepspeed_zero.ds_config import ds_config
from core.config import RunConfig
from core.process import TRACE_SETTINGS
from core.records import run_config
from harness.cli import main
from workloads.spec import PRESETS, ModelSpec

# label -> the `harness run` arguments that select it
FAMILY = {
    "torch-fsdp": ["--backend", "torch-fsdp"],
    "deepspeed-zero1": ["--backend", "deepspeed", "--zero-stage", "1"],
    "deepspeed-zero2": ["--backend", "deepspeed", "--zero-stage", "2"],
    "deepspeed-zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
    "horovod": ["--backend", "horovod"],
}


def config(backend: str, *cli: str, gpus=2, precision="fp32", **fields) -> RunConfig:
    """A RunConfig as `harness run --backend B CLI...` would give the adapter, without launching."""
    adapter = get_backend(backend)
    parser = argparse.ArgumentParser()
    adapter.Options.add_arguments(parser, backend)
    options = adapter.Options.from_args(parser.parse_args(list(cli))).to_dict()
    return RunConfig.build(
        backend=backend,
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=gpus,
        device="cpu",
        precision=precision,
        backend_options=options,
        **fields,
    )


# ------------------------------------------------------------------------------------------ without launching
@pytest.mark.parametrize(
    "backend,cli,precision,label,sharding,element_bytes",
    [
        ("torch-fsdp", [], "fp32", "torch-fsdp", "parameters", {4}),
        ("torch-fsdp", [], "bf16", "torch-fsdp", "parameters", {2, 4}),  # bf16 gathers, fp32 reduce-scatter
        (
            "torch-fsdp",
            ["--fp32-reduce", "off", "--reshard-after-forward", "off"],
            "bf16",
            "torch-fsdp-noreshard-bf16reduce",
            "parameters",
            {2},
        ),
        ("deepspeed", [], "bf16", "deepspeed-zero3", "parameters", {4}),  # autocast: fp32 parameters
        (
            "deepspeed",
            ["--ds-mixed-precision", "native"],
            "bf16",
            "deepspeed-zero3-native",
            "parameters",
            {2},
        ),
        ("deepspeed", ["--zero-stage", "0"], "fp32", "deepspeed-zero0", "none", {4}),
        ("deepspeed", ["--zero-stage", "1"], "fp32", "deepspeed-zero1", "optimizer", {4}),
        (
            "deepspeed",
            ["--zero-stage", "2", "--offload-optimizer"],
            "fp16",
            "deepspeed-zero2-offload",
            "gradients",
            {4},
        ),
        ("horovod", [], "bf16", "horovod", "none", {4}),  # autocast keeps fp32 gradients
        ("horovod", ["--hvd-compression", "fp16"], "fp32", "horovod-fp16comp", "none", {2}),
    ],
)
@pytest.mark.unit
def test_adapter_labels_sharding_and_communicated_dtypes(
    backend, cli, precision, label, sharding, element_bytes
):
    """Labels, sharding and the element size each collective moves; the volumes themselves, term by term:
    tests/test_comm_patterns.py."""
    adapter, cfg = get_backend(backend), config(backend, *cli, precision=precision)
    assert (adapter.label(cfg), adapter.sharding(cfg)) == (label, sharding)
    tensors = [t for t in adapter.comm_pattern(cfg).terms if t.elements > 1]  # not ZeRO's norm scalars
    assert {t.dtype_bytes for t in tensors} == element_bytes


@pytest.mark.unit
def test_deepspeed_config_is_built_from_the_run():
    cfg = config(
        "deepspeed", "--zero-stage", "2", "--offload-optimizer", precision="bf16", micro_batch=4, grad_accum=3
    )
    assert ds_config(cfg) == {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
        "gradient_clipping": 0.0,  # said: DeepSpeed's default clips to 1.0 (tests/test_equivalence.py)
        "torch_autocast": {"enabled": True, "dtype": "bf16", "lower_precision_safe_modules": []},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
        "timers": {"throughput": {"enabled": False, "synchronized": False}},  # no syncs inside the step
    }
    assert not {"bf16", "torch_autocast"} & set(ds_config(config("deepspeed")))
    native = ds_config(config("deepspeed", "--ds-mixed-precision", "native", precision="fp16"))
    assert native["fp16"] == {"enabled": True} and "torch_autocast" not in native


@pytest.mark.unit
def test_deepspeed_builds_its_ops_inside_the_environment_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    [proc] = get_backend("deepspeed").launch(config("deepspeed"), tmp_path, 29123, []).processes
    assert proc.env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "venv" / "distbench" / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    [proc] = get_backend("deepspeed").launch(config("deepspeed"), tmp_path, 29123, []).processes
    assert proc.env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)  # no virtual environment: torch's own default
    [proc] = get_backend("deepspeed").launch(config("deepspeed"), tmp_path, 29123, []).processes
    assert "TORCH_EXTENSIONS_DIR" not in proc.env


@pytest.mark.unit
def test_deepspeed_launches_with_its_own_runner(tmp_path):
    [proc] = get_backend("deepspeed").launch(config("deepspeed"), tmp_path, 29123, []).processes
    assert proc.argv[:4] == [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    assert {"--no_local_rank", "--master_port=29123", "--num_gpus=2"} <= set(proc.argv)
    assert proc.argv[-1] == str(tmp_path) and proc.env["DS_ACCELERATOR"] == "cpu"
    # one launcher per node, without ssh: a hostfile gives DeepSpeed the world layout
    node = config("deepspeed", gpus=4, nodes=2, node_rank=1, master_addr="10.0.0.1", hosts=["a", "b"])
    plan = get_backend("deepspeed").launch(node, tmp_path, 29123, [])
    [proc] = plan.processes
    assert {
        "--no_ssh",
        "--node_rank=1",
        "--master_addr=10.0.0.1",
        f"--hostfile={tmp_path / 'hostfile'}",
    } <= set(proc.argv)
    assert plan.files == {tmp_path / "hostfile": "a slots=2\nb slots=2\n"}  # for the runner to write
    assert not (tmp_path / "hostfile").exists()  # launch() itself writes nothing


@pytest.mark.unit
def test_horovod_launches_horovodrun_with_gloo(tmp_path):
    [proc] = get_backend("horovod").launch(config("horovod", timeout_s=60), tmp_path, 29123, []).processes
    assert proc.argv[0].endswith("horovodrun") and proc.argv[1:5] == ["-np", "2", "-H", "localhost:2"]
    assert "--gloo" in proc.argv
    assert proc.argv[-3:] == [sys.executable, str(WORKER_SCRIPT), str(tmp_path)]
    # Both of horovodrun's own waits follow the run's timeout: its start (default 30 s) and gloo's.
    for flag in ("--start-timeout", "--gloo-timeout-seconds"):
        assert proc.argv[proc.argv.index(flag) + 1] == "60", flag


@pytest.mark.unit
def test_horovod_multi_node_is_one_horovodrun_on_node_0(tmp_path):
    """horovodrun starts every node's workers itself (-H h1:G,h2:G), so other nodes start nothing."""
    node0 = config("horovod", gpus=4, nodes=2, node_rank=0, hosts=["a", "b"], collective_timeout_s=7)
    [proc] = get_backend("horovod").launch(node0, tmp_path, 29123, []).processes
    assert proc.argv[1:5] == ["-np", "4", "-H", "a:2,b:2"] and "--gloo" in proc.argv
    assert proc.argv[proc.argv.index("--gloo-timeout-seconds") + 1] == "7"
    assert get_backend("horovod").launch(node0.evolve(node_rank=1), tmp_path, 29123, []).processes == []
    isolated = node0.evolve(node_rank=1, isolated_index=2)
    [alone] = get_backend("horovod").launch(isolated, tmp_path, 29123, []).processes
    assert alone.argv[1:5] == ["-np", "1", "-H", "localhost:1"]


@pytest.mark.unit
def test_horovod_reports_a_failed_build_without_importing_it(tmp_path, monkeypatch):
    (tmp_path / "distbench").mkdir()
    (tmp_path / "distbench" / "horovod-unavailable").write_text("cmake ...\nerror: no C++17 compiler\n")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert get_backend("horovod").availability() == (False, "build failed: error: no C++17 compiler")
    assert not {"torch", "horovod", "deepspeed"} & set(sys.modules)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--backend", "deepspeed", "--zero-stage", "4"], "invalid choice: 4"),
        (["--backend", "horovod", "--hvd-compression", "bf16"], "invalid choice: 'bf16'"),
        (["--backend", "torch-fsdp", "--reshard-after-forward", "maybe"], "invalid choice: 'maybe'"),
    ],
)
@pytest.mark.unit
def test_bad_backend_options_are_usage_errors(args, expected, out, capsys):
    code = main(["run", *args, "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], lines
    assert not out.exists()


# --------------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """torch-ddp, one micro-batch a step, on the shape the full-record tests run on (ISSUE_SHAPE of
    tests/test_equivalence.py, which compares against the same launch: one per test run)."""
    return ddp_reference(ISSUE_SHAPE, tmp_path_factory)


def final_weights(rec):
    return np.load(f"{rec['launch']['log_dir']}/weights_rank0.npz")


# One world-1 launch per backend suffices to show the isolated counterfactual works for it: the ZeRO stages
# share DeepSpeed's launch, so stages 1 and 2 skip it to keep the suite short.
ISOLATED = {"torch-fsdp", "deepspeed-zero3", "horovod"}


def full_record(label: str, tmp_path_factory) -> dict:
    """The full-record run of `label`: ISSUE_SHAPE, two accumulated micro-batches a step, traced, final
    weights dumped, and a transient taken before the first step. Launched once per test run: the GPU
    tier's CPU rehearsal (tests/test_gpu_tier.py) reads the runs of the stacks that shard parameters."""
    method = "isolated" if label in ISOLATED else "none"
    # One isolated launch, not the default two: that the repeats are joined is tests/test_ddp.py's to show
    repeats = ["--isolated-repeats", "1"] if method == "isolated" else []
    return launched_once(
        f"family-{label}",
        lambda: run_record(
            tmp_path_factory.mktemp(label),
            *FAMILY[label],
            *ISSUE_SHAPE.args(accum=2),
            *("--compute-method", method, *repeats),
            *("--warmup-transient", CPU_WARMUP_TRANSIENT_BYTES, "--dump-weights"),
        ),
    )


@pytest.mark.slow
@pytest.mark.parametrize("label", FAMILY)
def test_two_workers_train_the_same_model_as_ddp_with_a_full_record(label, ddp_run, tmp_path_factory):
    """On ISSUE_SHAPE with two accumulated micro-batches a step (so this launch is also the accumulation
    case of tests/test_equivalence.py) against torch-ddp's one; on another shape: the same file."""
    rec = full_record(label, tmp_path_factory)
    method = run_config(rec).measurement.compute_method
    # DeepSpeed's CPU all-reduce leaves ~70 MB of /dev/shm per rank per launch unless the harness removes
    # it: none of this run's (named by its port: another test's run may be using its own meanwhile)
    if label.startswith("deepspeed"):
        launcher_log = Path(rec["launch"]["log_dir"], "launcher.log").read_text()
        (port,) = set(re.findall(r"--master_port=(\d+)", launcher_log))
        assert not glob.glob(shm_segments(int(port)))
    s = rec["summary"]
    assert rec["status"] == "ok" and rec["backend_info"]["label"] == label
    assert len(s["losses"]) == STEPS and s["loss_last"] < s["loss_first"]
    assert_same_losses(s["losses"], ddp_run["summary"]["losses"], f"{label} on {ISSUE_SHAPE}, accum 2")
    reference, weights = final_weights(ddp_run), final_weights(rec)  # gathered from the shards where sharded
    for name in reference.files:  # ~1e-6 seen (ZeRO's flat AdamW); one AdamW step moves a weight ~3e-4
        np.testing.assert_allclose(weights[name], reference[name], rtol=0, atol=5e-6, err_msg=name)
    for key in (
        "throughput_tokens_per_s",
        "per_device_tokens_per_s",
        "comm_bytes_per_rank_per_step",
        "peak_rss_bytes",
        "model_state_bytes_per_rank",
        "model_state_bytes_analytic",
    ):
        assert s[key] is not None and s[key] > 0, key
    for r in rec["ranks"]:
        assert len(r["step_times"]) == len(r["data_prep"]) == STEPS and r["versions"]["torch"]
        assert set(r["model_state_bytes"]) == {"params", "grads", "optimizer", "total"}
        settings = r["process_settings"]  # as they reached the worker through the backend's launcher
        assert settings["OMP_NUM_THREADS"] == str(run_config(rec).topology.threads_per_worker)
        assert settings["MALLOC_TRIM_THRESHOLD_"]
        assert not any(settings[k] for k in TRACE_SETTINGS), settings  # the measured steps ran untraced
    # The collective trace of the steps after the measured ones, by each stack's own instrument
    m, n = s["comm_measured"], run_config(rec).model.spec.n_params
    assert m["method"] == ("horovod timeline" if label == "horovod" else "torch profiler (kineto)")
    if label == "horovod":  # DistributedOptimizer all-reduces every fp32 gradient once per step
        assert m["ops"]["all_reduce"]["size_bytes_per_step"] == 4 * n
    own = get_backend(rec["config"]["backend"]).traces_in_own_launch  # Horovod: a launch of its own
    assert {r["comm_trace"]["launch"] for r in rec["ranks"]} == {"own" if own else "inline"}
    # ZeRO-3 on this shape: every tensor under the persistence threshold, gathered after each optimizer step
    assert m["vs_analytic"] == pytest.approx(1, abs=0.02)
    if label != "horovod":  # Horovod's fusion depends on timing: it has no fixed schedule to hold to
        assert_traced_steps_follow_the_schedule(rec, in_order=label != "torch-fsdp")
    assert_holds_what_it_shards(label, rec, ddp_run)
    assert_model_state_as_predicted(rec)
    assert_model_state_as_predicted(ddp_run)
    if method == "isolated":  # t_compute from two world-1 launches of the same backend, side by side
        assert rec["comm"] == {"t_compute_method": "isolated"} and len(rec["isolated_ranks"]) == 2
        assert all(r["status"] == "ok" and len(r["step_times"]) == STEPS for r in rec["isolated_ranks"])
        assert s["t_compute_s"] > 0
        assert_exposed_as_measured(s)


def assert_holds_what_it_shards(label: str, rec: dict, ddp_run: dict) -> None:
    """What a rank of the full-record run holds, in fp32 at 2 ranks. FSDP2: half of DDP's model state (its
    parameters, gradients and moments, each cut on dim 0 and padded to a multiple of 2, plus AdamW's
    unsharded step counters). ZeRO-1 and -2: the whole fp32 model, the optimizer's fp32 master and
    moments halved, and gradients only for the rank's partition. (ZeRO-3 and Horovod: below, and none.)"""
    s, p = rec["summary"], run_config(rec).model.spec.n_params
    if label == "torch-fsdp":
        ddp = ddp_run["summary"]["model_state_bytes_per_rank"]
        assert s["model_state_bytes_per_rank"] / ddp == pytest.approx(0.5, abs=0.02)
    if label not in ("deepspeed-zero1", "deepspeed-zero2"):
        return
    for held in (r["model_state_bytes"] for r in rec["ranks"]):
        assert held["params"] == pytest.approx(4 * p, rel=0.01)  # the whole model on every rank
        # under torch_autocast DeepSpeed keeps an fp32 master copy beside the fp32 model: with the two
        # moments, 12 bytes a parameter, halved
        assert held["optimizer"] == pytest.approx(12 * p / 2, rel=0.01)
        # Once reduced, DeepSpeed keeps gradients only for this rank's partition, at stage 1 as at stage 2,
        # in a buffer sized by the whole parameters that overlap the partition: a little over half.
        assert 4 * p / 2 <= held["grads"] < 0.65 * 4 * p
    # The analytic ZeRO-1 model keeps whole gradients: one half-gradient more than stage 1 holds.
    expected = s["model_state_bytes_analytic"] - (4 * p / 2 if label.endswith("1") else 0)
    assert s["model_state_bytes_per_rank"] == pytest.approx(expected, rel=0.03)


# A shape whose every weight matrix is over DeepSpeed's ZeRO-3 persistence threshold (1e5 elements; smaller
# parameters stay whole on every rank), cheap on a CPU: 4.4M parameters, one 128-token sequence per rank.
# bf16, where every backend keeps 16 bytes per parameter unsharded (DDP autocast: fp32 parameters,
# gradients and moments; DeepSpeed's native bf16, NATIVE: bf16 parameters and gradients, fp32 master and
# moments). In fp32, and under its default torch_autocast, DeepSpeed still keeps a separate fp32 master
# copy, 20 bytes per parameter.
WIDE = (
    "--workload tiny --d-model 384 --layers 2 --micro-batch 1 --steps 1 "
    "--warmup 0 --precision bf16 --compute-method none --timeout 180"
).split()
NATIVE = ["--ds-mixed-precision", "native"]
WIDE_PARAMS = ModelSpec(**{**PRESETS["tiny"].to_dict(), "d_model": 384, "d_ff": 1536, "n_layers": 2}).n_params


# What torch-ddp holds per rank in bf16 autocast: fp32 parameters, gradients and both AdamW moments, 16
# bytes a parameter, unsharded (measured to the byte, AdamW's step counters included: tests/test_ddp.py).
DDP_STATE = 16 * WIDE_PARAMS


# ZeRO-3 on WIDE in native bf16 (an eighth of DDP_STATE, its persistent tensors whole; traced bytes as
# analytic): tests/test_range.py, at 8 ranks.


@pytest.mark.slow
def test_zero2_in_native_bf16_shards_the_optimizer_state_and_reduces_in_bf16(out):
    """DeepSpeed's own bf16 module (--ds-mixed-precision native), which the autocast runs elsewhere never
    reach: bf16 parameters and gradients, fp32 master and moments sharded; stage 1 is the same here."""
    rec = run_record(out, *FAMILY["deepspeed-zero2"], "--gpus", "2", *WIDE, *NATIVE)
    p = WIDE_PARAMS
    for held in (r["model_state_bytes"] for r in rec["ranks"]):
        assert held["params"] == pytest.approx(2 * p, rel=0.01)  # the whole bf16 model on every rank
        assert held["optimizer"] == pytest.approx(12 * p / 2, rel=0.01)  # fp32 master + moments, halved
        assert 2 * p / 2 <= held["grads"] < 0.65 * 2 * p
    # Traced: bf16 gradients all-reduced for their owners (plus a few scalar overflow and norm checks),
    # the updated bf16 parameters all-gathered
    traced = rec["summary"]["comm_measured"]["ops"]
    assert_traced_steps_follow_the_schedule(rec)  # bf16: the overflow flag besides the norm scalars
    assert traced["all_gather"]["size_bytes_per_step"] == 2 * p
    assert 2 * p <= traced["all_reduce"]["size_bytes_per_step"] <= 2 * p + 64
    s = rec["summary"]
    assert s["model_state_bytes_per_rank"] == pytest.approx(s["model_state_bytes_analytic"], rel=0.03)
