"""The prepared GPU check's decisions (scripts/gpu_check.py), held to records on a CPU: a sound record of
each kind gets PASS, a broken one FAIL, and a check that a CPU cannot answer NOT CHECKED.

Records are built the way the runner builds them (tests/record_factory.py: raw rank records assembled by
the runner, so the summary, MFU and peak precision come from harness.analyze.metrics, not from here), set
to a GPU where the check is about one; trace calls are made by backends.comm_trace.collective, the
constructor the trace readers use. The integration tests run the real thing on the CPU: a `harness run`
with the check's CPU shape, and the two-rank gloo probe under torchrun.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import record_factory as rf

from backends.comm_trace import collective

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
H200 = "NVIDIA H200"


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


gc = load_check()

NUMERICS = {
    "fp32": {"compute": "fp32", "forward_params": "fp32", "grad_reduce": "fp32", "master_weights": "none"},
    "bf16": {"compute": "bf16", "forward_params": "fp32", "grad_reduce": "fp32", "master_weights": "fp32"},
}


def gpu_record(
    precision: str = "fp32",
    *,
    tf32: bool | None = False,
    asked_tf32: bool = False,
    allocated: int | None = 3 * rf.TINY_MODEL_STATE,
    step_time: float = 0.01,
    losses: list[float] | None = None,
    numerics: dict | None = None,
    device: str = H200,
) -> dict:
    """A 1-rank torch-ddp run on an H200 as the runner assembles it, with the math mode a worker records."""
    cfg = rf.config("torch-ddp", 1, precision=precision, steps=rf.STEPS, warmup=1, device="cuda")
    steps = len(losses) if losses else rf.STEPS
    rank = rf.rank_record(0, [step_time] * steps, device=device, allocated=allocated, losses=losses)
    rank["math_mode"] = {"tf32": tf32, "tf32_setting": "torch.backends.cuda.matmul.fp32_precision=ieee"}
    if numerics is not None:
        rank["math_mode"]["numerics"] = numerics
    env = rf.environment(device, 1, device_type="cuda")
    record = rf.assemble(cfg, f"gc-test-{precision}", [rank], environment=env)
    record["config"]["model"]["tf32"] = asked_tf32
    return record


def cpu_record(**kw) -> dict:
    return rf.make_record("torch-ddp", 1, **kw)


# ---- a training run ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_sound_run_passes_and_each_broken_one_fails():
    assert gc.judge_run("torch-ddp/fp32", cpu_record(), "cpu").outcome == gc.PASS
    assert gc.judge_run("torch-ddp/fp32", gpu_record(), "cuda").outcome == gc.PASS

    failed = gc.judge_run("torch-ddp/fp32", cpu_record(status="failed"), "cpu")
    assert failed.outcome == gc.FAIL and "status failed" in failed.text and "injected fault" in failed.text
    # a run that fell back to the CPU is not a GPU check
    assert "ran on cpu" in gc.judge_run("x", cpu_record(), "cuda").text

    nan = gpu_record(losses=[7.0, math.nan, 6.8, 6.7])
    assert gc.judge_run("x", nan, "cuda").outcome == gc.FAIL
    rising = gpu_record(losses=[7.0, 7.1, 7.2, 7.3])  # warm-up loss 7.1, then up
    verdict = gc.judge_run("x", rising, "cuda")
    assert verdict.outcome == gc.FAIL and "did not fall" in verdict.text

    stalled = gpu_record()
    stalled["summary"]["throughput_tokens_per_s"] = 0.0
    assert gc.judge_run("x", stalled, "cuda").outcome == gc.FAIL


def tuned_record(first_step: float | None = 9.5, applied: bool = True, step_time: float = 0.05) -> dict:
    """A 1-rank torch-ddp --tuned run on the CPU, its first warm-up step carrying the compile time."""
    cfg = rf.config("torch-ddp", 1, steps=rf.STEPS, warmup=1, variant="tuned")
    rank = rf.rank_record(0, [step_time] * rf.STEPS)
    if first_step is not None:
        rank["warmup_step_times"] = [first_step]
    record = rf.assemble(cfg, "gc-tuned", [rank], environment=rf.environment())
    if not applied:
        record["backend_info"]["tuned"]["compile"]["value"] = False
    return record


@pytest.mark.unit
def test_a_tuned_run_must_list_its_applied_set_and_its_first_step():
    default = cpu_record(step_time=0.1)
    verdict = gc.judge_tuned("torch-ddp/tuned/bf16", tuned_record(), default, "cpu")
    assert verdict.outcome == gc.PASS, verdict
    assert "compile=True" in verdict.text and "first step 9.5s" in verdict.text and "2.00x" in verdict.text
    assert gc.judge_tuned("x", tuned_record(first_step=None), default, "cpu").outcome == gc.FAIL
    assert gc.judge_tuned("x", tuned_record(applied=False), default, "cpu").outcome == gc.FAIL
    assert gc.judge_tuned("x", default, None, "cpu").outcome == gc.FAIL  # a default run is not a tuned one


@pytest.mark.unit
def test_one_noisy_step_does_not_fail_a_falling_loss_but_a_flat_one_fails():
    """Thirds, not first against last: a last step above the first cannot fail a loss that fell."""
    noisy = gpu_record(losses=[7.0, 6.6, 6.5, 6.4, 6.3, 6.2, 6.1, 7.15])  # warm-up 7.1; the last above it
    assert gc.judge_run("x", noisy, "cuda").outcome == gc.PASS
    flat = gpu_record(losses=[7.1, 7.1, 7.1, 7.1])
    assert gc.judge_run("x", flat, "cuda").outcome == gc.FAIL


@pytest.mark.unit
def test_a_run_the_harness_refuses_on_a_cpu_is_not_checked_there_but_fails_on_a_gpu():
    ctx = gc.Context("cpu", sys.executable, Path("."), 100, 1)
    line = "error: deepspeed fp16 needs a GPU"
    assert gc.no_record_verdict(ctx, "x", 2, line).outcome == gc.NOT_CHECKED
    assert gc.no_record_verdict(ctx, "x", 1, line).outcome == gc.FAIL
    ctx.device = "cuda"
    assert gc.no_record_verdict(ctx, "x", 2, line).outcome == gc.FAIL


# ---- TF32 ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_fp32_without_tf32_must_be_ieee():
    ieee = {"ddp": gpu_record(), "bf16 is not judged": gpu_record("bf16", tf32=None)}
    verdict = gc.judge_tf32_default(ieee, "cuda")
    assert verdict.outcome == gc.PASS and "ddp" in verdict.text and "bf16" not in verdict.text

    silent_tf32 = gpu_record(tf32=True)  # the runner then takes MFU against the TF32 peak too
    assert silent_tf32["summary"]["device_peak_precision"] == "tf32"
    verdict = gc.judge_tf32_default({"ddp": silent_tf32}, "cuda")
    assert verdict.outcome == gc.FAIL and "tf32 [True]" in verdict.text and "tf32 peak" in verdict.text

    unsaid = gc.judge_tf32_default({"ddp": gpu_record(tf32=None)}, "cuda")  # a GPU worker must say
    assert unsaid.outcome == gc.FAIL and "tf32 [None]" in unsaid.text
    mixed = gc.judge_tf32_default({"a": gpu_record(), "b": gpu_record(tf32=None)}, "cuda")
    assert mixed.outcome == gc.FAIL

    on_cpu = gc.judge_tf32_default({"ddp": cpu_record()}, "cpu")
    assert on_cpu.outcome == gc.NOT_CHECKED and "cpu: TF32 is a CUDA matmul mode" in on_cpu.text


@pytest.mark.unit
def test_tf32_opt_in_must_switch_tf32_on_and_is_not_checked_without_the_flag():
    asked = gpu_record(tf32=True, asked_tf32=True)
    assert gc.judge_tf32_opt_in(asked, True, "cuda").outcome == gc.PASS
    ignored = gpu_record(tf32=False, asked_tf32=True)
    assert gc.judge_tf32_opt_in(ignored, True, "cuda").outcome == gc.FAIL
    unrecorded = gpu_record(tf32=True, asked_tf32=False)
    assert gc.judge_tf32_opt_in(unrecorded, True, "cuda").outcome == gc.FAIL
    no_flag = gc.judge_tf32_opt_in(None, False, "cuda")
    assert no_flag.outcome == gc.NOT_CHECKED and "no --tf32 flag" in no_flag.text
    # an opted-in record is not held to the IEEE rule
    assert gc.judge_tf32_default({"plain": gpu_record(), "opt-in": asked}, "cuda").outcome == gc.PASS


# ---- memory -------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_allocator_peak_must_hold_the_model_state():
    assert gc.judge_memory_vs_state({"ddp": gpu_record()}, "cuda").outcome == gc.PASS
    short = gpu_record(allocated=rf.TINY_MODEL_STATE // 2)
    verdict = gc.judge_memory_vs_state({"ddp": gpu_record(), "short": short}, "cuda")
    assert verdict.outcome == gc.FAIL and "short" in verdict.text and "ddp:" not in verdict.text
    assert gc.judge_memory_vs_state({"ddp": cpu_record()}, "cpu").outcome == gc.NOT_CHECKED


def memory_probe(after_warmup: int, lifetime: int = gc.TRANSIENT_BYTES + (40 << 20)) -> dict:
    rank = rf.rank_record(0, [0.01] * rf.STEPS, device=H200, allocated=after_warmup)
    return {"transient_bytes": gc.TRANSIENT_BYTES, "lifetime_peak_bytes": lifetime, "record": rank}


@pytest.mark.unit
def test_the_peak_must_be_reset_after_the_warmup_transient():
    state = rf.TINY_MODEL_STATE
    verdict = gc.judge_peak_reset(memory_probe(3 * state), "cuda")
    assert verdict.outcome == gc.PASS and "2 GiB warm-up transient" in verdict.text
    # no reset: the peak still holds the warm-up's transient (it is the lifetime peak)
    lifetime = gc.TRANSIENT_BYTES + 3 * state
    verdict = gc.judge_peak_reset(memory_probe(lifetime, lifetime), "cuda")
    assert verdict.outcome == gc.FAIL and "not reset" in verdict.text
    # a peak below what the rank holds misses allocations
    assert gc.judge_peak_reset(memory_probe(state // 2), "cuda").outcome == gc.FAIL
    # the transient never reached the allocator: the probe proves nothing
    assert gc.judge_peak_reset(memory_probe(3 * state, lifetime=10 << 20), "cuda").outcome == gc.FAIL
    assert gc.judge_peak_reset({"error": "RuntimeError: boom"}, "cuda").outcome == gc.FAIL
    assert gc.judge_peak_reset(None, "cuda").outcome == gc.FAIL
    cpu = {"transient_bytes": None, "record": rf.rank_record(0, [0.01] * rf.STEPS)}
    assert gc.judge_peak_reset(cpu, "cpu").outcome == gc.NOT_CHECKED


# ---- traces and the probes ------------------------------------------------------------------------------


def call(elements: int = 1 << 16, dtype: str = "float", time_s: float | None = 2e-5) -> dict:
    return collective("all_reduce", "c10d::allreduce_", elements, dtype, 2, 0.0, time_s, 0.0)


@pytest.mark.unit
def test_a_trace_needs_calls_with_their_bytes():
    verdict = gc.judge_trace("t", [call(), call(time_s=None)])
    assert verdict.outcome == gc.PASS and "all_reduce x2 0.50 MiB (1 timed)" in verdict.text
    assert gc.judge_trace("t", [call(), {**call(), "size_bytes": 0}]).outcome == gc.FAIL  # zero bytes
    assert gc.judge_trace("t", [call(dtype="mystery")]).outcome == gc.FAIL  # bytes unknown
    assert gc.judge_trace("t", []).outcome == gc.FAIL
    assert gc.judge_trace("t", None, "lost").outcome == gc.FAIL


def gloo_rank(rank: int, digest: str = "same", grads_elements: int = 1 << 16, device: str = "cuda:0") -> dict:
    record = rf.rank_record(rank, [0.01] * rf.STEPS)
    record["model_state_bytes"]["params"] = grads_elements * 4
    record["comm_trace"] = {"method": "torch profiler (kineto)", "steps": 2, "collectives": [call()] * 2}
    return {"rank": rank, "record": record, "weights_sha256": digest, "backend": "gloo", "device": device}


@pytest.mark.unit
def test_two_ranks_over_gloo_must_stay_in_sync_and_trace_the_gradients():
    ddp, trace = gc.judge_gloo([gloo_rank(0), gloo_rank(1)], "cuda")
    assert (ddp.outcome, trace.outcome) == (gc.PASS, gc.PASS), (ddp, trace)
    assert "= the fp32 gradients" in trace.text
    ddp, _ = gc.judge_gloo([gloo_rank(0), gloo_rank(1, digest="other")], "cuda")
    assert ddp.outcome == gc.FAIL and "not keep them in sync" in ddp.text
    ddp, _ = gc.judge_gloo([gloo_rank(0), gloo_rank(1, device="cuda:1")], "cuda")
    assert ddp.outcome == gc.FAIL
    _, trace = gc.judge_gloo([gloo_rank(0, grads_elements=1 << 17), gloo_rank(1)], "cuda")
    assert trace.outcome == gc.FAIL and "all-reduced" in trace.text
    assert all(v.outcome == gc.FAIL for v in gc.judge_gloo([gloo_rank(0), None], "cuda"))
    broken = {"rank": 1, "error": "RuntimeError: gloo does not support CUDA tensors"}
    assert all(v.outcome == gc.FAIL for v in gc.judge_gloo([gloo_rank(0), broken], "cuda"))


@pytest.mark.unit
def test_the_world1_probe_passes_on_a_gpu_and_is_only_rehearsed_on_a_cpu():
    probe = {"calls": [call()] * 5, "kernels": [], "commbench": {"all_reduce": {"us": 12.0}}}
    assert [v.outcome for v in gc.judge_world1(probe, "cuda")] == [gc.PASS, gc.PASS]
    on_cpu = gc.judge_world1(probe, "cpu")
    assert [v.outcome for v in on_cpu] == [gc.NOT_CHECKED] * 2 and "rehearsed over gloo" in on_cpu[0].text
    bad = {**probe, "commbench": {"all_gather": {"error": "AssertionError: wrong output"}}}
    assert [v.outcome for v in gc.judge_world1(bad, "cuda")] == [gc.PASS, gc.FAIL]
    assert [v.outcome for v in gc.judge_world1({"error": "x"}, "cpu")] == [gc.FAIL, gc.FAIL]


# ---- MFU, precision facts, device -----------------------------------------------------------------------


def record_at_mfu(mfu: float) -> dict:
    """A bf16 H200 record whose step time gives this MFU by harness.analyze.metrics' own numbers."""
    probe = gpu_record("bf16", tf32=None)
    flops, peak = probe["summary"]["model_flops_per_step"], probe["summary"]["device_peak_flops"]
    return gpu_record("bf16", tf32=None, step_time=flops / (mfu * peak))


@pytest.mark.unit
def test_mfu_must_land_in_the_band():
    inside = record_at_mfu(0.4)
    assert inside["summary"]["mfu"] == pytest.approx(0.4)
    verdict = gc.judge_mfu(inside, "cuda")
    assert verdict.outcome == gc.PASS and "MFU 40.0% of the 989 TFLOP/s bf16 peak" in verdict.text
    assert gc.judge_mfu(record_at_mfu(0.05), "cuda").outcome == gc.FAIL  # as if the matmuls left bf16
    assert gc.judge_mfu(record_at_mfu(0.9), "cuda").outcome == gc.FAIL  # above the device's matmul rate
    unknown = gpu_record("bf16", tf32=None, device="NVIDIA Mystery GPU")  # no peak: no MFU
    assert gc.judge_mfu(unknown, "cuda").outcome == gc.FAIL
    assert gc.judge_mfu(cpu_record(precision="bf16"), "cpu").outcome == gc.NOT_CHECKED
    assert gc.judge_mfu(cpu_record(precision="bf16", status="failed"), "cpu").outcome == gc.FAIL


@pytest.mark.unit
def test_precision_facts_are_printed_and_must_match_the_precision():
    records = {
        "ddp/fp32": gpu_record(numerics=NUMERICS["fp32"]),
        "ddp/bf16": gpu_record("bf16", tf32=None, numerics=NUMERICS["bf16"]),
    }
    verdict = gc.judge_precision_facts(records)
    assert verdict.outcome == gc.PASS
    assert "ddp/bf16: compute=bf16 forward_params=fp32 grad_reduce=fp32 master_weights=fp32" in verdict.text
    records["ddp/bf16"] = gpu_record("bf16", tf32=None, numerics=NUMERICS["fp32"])  # computed in fp32
    verdict = gc.judge_precision_facts(records)
    assert verdict.outcome == gc.FAIL and "compute fp32 in a bf16 run" in verdict.text
    partial = {"a": gpu_record(numerics=NUMERICS["fp32"]), "b": gpu_record()}
    assert gc.judge_precision_facts(partial).outcome == gc.FAIL
    assert gc.judge_precision_facts({"a": gpu_record()}).outcome == gc.NOT_CHECKED


@pytest.mark.unit
def test_every_rank_must_say_it_ran_on_the_gpu_nvidia_smi_lists():
    records = {"a": gpu_record()}
    assert gc.judge_device_contract(records, [H200], "cuda").outcome == gc.PASS
    elsewhere = {"a": gpu_record(device="NVIDIA A100-SXM4-80GB")}
    assert gc.judge_device_contract(elsewhere, [H200], "cuda").outcome == gc.FAIL
    assert gc.judge_device_contract(records, [], "cuda").outcome == gc.NOT_CHECKED
    assert gc.judge_device_contract({"a": cpu_record()}, [], "cpu").outcome == gc.NOT_CHECKED


# ---- the verdict's form -----------------------------------------------------------------------------------


@pytest.mark.unit
def test_each_check_is_one_line_and_any_fail_makes_the_exit_non_zero(capsys):
    ctx = gc.Context("cuda", sys.executable, Path("."), 420, 7)
    ctx.say(gc.Verdict(gc.PASS, "a", "fine\nacross lines"))
    ctx.say(gc.Verdict(gc.NOT_CHECKED, "b", "no wheels"))
    assert gc.finish(ctx) == 0
    ctx.say(gc.Verdict(gc.FAIL, "c", "broken"))
    assert gc.finish(ctx) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["PASS a: fine across lines", "NOT CHECKED b: no wheels"]
    assert lines[2].startswith("1 passed, 0 failed, 1 not checked (in ")
    assert lines[-1].startswith("1 passed, 1 failed, 1 not checked")


@pytest.mark.unit
def test_a_group_that_no_longer_fits_the_budget_is_skipped_with_the_reason():
    ctx = gc.Context("cuda", sys.executable, Path("."), 420, 7)
    assert ctx.over_budget(100) is None
    ctx.t0 -= 400  # 400 s spent
    assert "400s of 420s spent, this needs about 100s" in ctx.over_budget(100)
    assert ctx.hard_left() == pytest.approx(50, abs=1)  # a started command may use the budget + 30 s


@pytest.mark.unit
@pytest.mark.subprocess  # bash -n
def test_the_shell_scripts_parse():
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        proc = subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.unit
@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_shell_scripts_pass_shellcheck():
    scripts = [str(REPO / "scripts" / s) for s in ("gpu_check.sh", "gpu_wheels.sh")]
    proc = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.unit
def test_wheels_are_ignored_so_they_travel_only_when_carried():
    assert "/wheels/" in (REPO / ".gitignore").read_text().splitlines()


# ---- the real thing, on the CPU ------------------------------------------------------------------------


def test_a_real_cpu_run_of_the_check_shape_passes_and_its_failed_copy_fails(tmp_path):
    """The check's CPU shape trains: its loss falls within the steps it runs, so the rehearsal's verdicts
    are about the plumbing, not about a shape too small to learn."""
    argv = [
        sys.executable,
        "-m",
        "harness",
        "run",
        "--backend",
        "torch-ddp",
        "--gpus",
        "1",
        "--device",
        "cpu",
        "--quiet",
        "--out",
        str(tmp_path),
        "--run-id",
        "r",
        "--compute-method",
        "none",
        "--timeout",
        "240",
        *gc.SHAPES["cpu"],
    ]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "r.json").read_text())
    verdict = gc.judge_run("torch-ddp/fp32", record, "cpu")
    assert verdict.outcome == gc.PASS, verdict
    assert gc.judge_tf32_default({"r": record}, "cpu").outcome == gc.NOT_CHECKED
    broken = copy.deepcopy(record)
    broken["status"] = "crashed"
    assert gc.judge_run("torch-ddp/fp32", broken, "cpu").outcome == gc.FAIL


def test_the_gloo_probe_trains_two_ranks_in_sync_and_traces_their_gradients(tmp_path):
    """The probe the GPU check runs on cuda:0, here on the CPU: the harness's DDP trainer and timed loop on
    two torchrun ranks over gloo."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "probe-gloo",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"gloo-rank{r}.json").read_text()) for r in range(2)]
    ddp, trace = gc.judge_gloo(ranks, "cpu")
    assert (ddp.outcome, trace.outcome) == (gc.PASS, gc.PASS), (ddp, trace)
