"""Derived figures on hand-made records with known answers."""

import json

import pytest
import record_factory as factory

import harness.analyze.summary as summary_view
import harness.run.record as run_record
from core.records import validate_record
from harness.analyze.metrics import comm_bytes_per_rank, device_peak_flops, per_step_max, summarize

pytestmark = pytest.mark.unit

# The tiny preset, by hand (see record_factory): 1,071,872 parameters; AdamW in fp32 holds 16 B of each.
TINY_PARAMS = 1_071_872
TINY_STATE = 16 * TINY_PARAMS  # 17,149,952
# 6 x matmul params + 12 x layers x d_model x seq_len, with matmul params = 4 x (128x384 + 128x128 + 128x512 +
# 512x128) + 2048x128 (the tied head) = 1,048,576: 6,291,456 + 786,432
TINY_FLOPS_PER_TOKEN = 7_077_888


def record(world=2, step_times=None, compute=None, device="cpu: test", method="no_sync", precision="fp32"):
    """A torch-ddp run record of the tiny preset (4 seq/rank x 2 accum), assembled as the runner does, with
    `step_times[r]` for rank r and `compute[r]` its compute-only steps (its own with sync off for no_sync,
    its isolated worker's for isolated)."""
    step_times = step_times or [[0.1, 0.2, 0.3]] * world
    compute = compute or [[]] * world
    cfg = factory.config(
        "torch-ddp",
        world,
        device="cpu" if device.startswith("cpu") else "cuda",
        precision=precision,
        micro_batch=4,
        grad_accum=2,
        steps=len(step_times[0]),
        compute_method=method,
    )
    ranks = [
        factory.rank_record(
            r,
            step_times[r],
            device=device,
            peak_rss=100 + r,
            losses=[5.0 + r, 4.0 + r, 3.0 + r][: len(step_times[r])],
            state_total=TINY_STATE,
            compute_times=compute[r] if method == "no_sync" else (),
        )
        for r in range(world)
    ]
    isolated = [factory.rank_record(0, c, device=device) for c in compute if c and method == "isolated"]
    return factory.assemble(
        cfg, "metrics-test", ranks, isolated_ranks=isolated, environment=factory.environment(device, world)
    )


def test_step_time_is_the_slowest_rank_per_step():
    assert per_step_max([{"t": [1, 5, 2]}, {"t": [3, 1, 2]}], "t") == [3, 5, 2]
    s = summarize(record(step_times=[[0.1, 0.4, 0.2], [0.3, 0.1, 0.2]]))
    assert s["step_time_s"]["median"] == pytest.approx(0.3)  # per-step max = [0.3, 0.4, 0.2]


def test_throughput_and_losses():
    s = summarize(record())
    tokens = 4 * 2 * 2 * 128
    assert s["tokens_per_step"] == tokens
    assert s["throughput_tokens_per_s"] == pytest.approx(tokens / 0.2)
    assert s["per_device_tokens_per_s"] == pytest.approx(tokens / 0.2 / 2)
    assert s["losses"] == [5.5, 4.5, 3.5]  # mean over ranks


def test_exposed_comm_ratio_and_bus_bandwidth():
    s = summarize(record(compute=[[0.15, 0.15, 0.15], [0.14, 0.15, 0.16]]))
    assert s["t_compute_s"] == pytest.approx(0.15)
    assert s["exposed_comm_ratio"] == pytest.approx(0.25)  # (0.2 - 0.15) / 0.2
    volume = 2 * 1 / 2 * TINY_PARAMS * 4  # ring all-reduce of fp32 gradients at N=2
    assert s["comm_bytes_per_rank_per_step"] == pytest.approx(volume)
    assert s["volume_per_exposed_s"] == pytest.approx(volume / 0.05)
    # compute slower than the synced step beyond its noise: unresolved, never clamped to 0, no bandwidth
    s = summarize(record(step_times=[[0.2] * 3] * 2, compute=[[0.3] * 3] * 2))
    exposed = s["anatomy"]["parts"]["exposed_comm"]
    assert s["exposed_comm_ratio"] is None and s["volume_per_exposed_s"] is None
    assert exposed["status"] == "unresolved" and exposed["s"] == pytest.approx(-0.1)
    # slower within its noise: the small negative difference is shown as it is, consistent with none
    s = summarize(record(compute=[[0.15, 0.21, 0.26], [0.15, 0.2, 0.25]]))
    exposed = s["anatomy"]["parts"]["exposed_comm"]
    assert exposed["status"] == "derived" and exposed["ci"][0] < 0 < exposed["ci"][1]
    assert s["exposed_comm_ratio"] == pytest.approx(-0.05)
    rec = record(compute=[[0.15, 0.21, 0.26], [0.15, 0.2, 0.25]])
    validate_record(json.loads(json.dumps({**rec, "summary": s})))  # the record is written as it is


def test_single_rank_has_zero_comm_by_definition():
    s = summarize(record(world=1))
    assert s["exposed_comm_ratio"] == 0.0 and s["comm_bytes_per_rank_per_step"] == 0.0


def test_volume_sums_the_terms_with_ring_factors():
    terms = [
        {"op": "all_gather", "elements": 1000, "dtype_bytes": 2, "per_step": 2, "what": "params"},
        {"op": "reduce_scatter", "elements": 1000, "dtype_bytes": 4, "per_step": 1, "what": "grads"},
        {"op": "all_reduce", "elements": 10, "dtype_bytes": 4, "per_step": 3, "what": "x"},
    ]
    # N=4: (N-1)/N = 0.75 for gather and scatter, 2(N-1)/N = 1.5 for all-reduce
    assert comm_bytes_per_rank(terms, 4) == pytest.approx(
        0.75 * 1000 * 2 * 2 + 0.75 * 1000 * 4 + 1.5 * 10 * 4 * 3
    )
    assert comm_bytes_per_rank(terms, 1) == 0.0


def test_mfu_only_with_a_known_peak():
    assert summarize(record())["mfu"] is None
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    s = summarize(record(device="NVIDIA H200", precision="bf16"))
    expected = TINY_FLOPS_PER_TOKEN * (4 * 2 * 2 * 128 / 0.2 / 2) / 989e12
    assert s["mfu"] == pytest.approx(expected)


def test_model_state_against_analytic():
    s = summarize(record())
    assert s["model_state_bytes_per_rank"] == TINY_STATE
    assert s["model_state_bytes_analytic"] == pytest.approx(TINY_STATE)  # 16 B x 1,071,872 params, by hand
    assert s["model_state_vs_analytic"] == pytest.approx(1.0)
    assert s["peak_rss_bytes"] == 101
    r = record()
    r["ranks"][1]["model_state_bytes"]["total"] = 1.5 * TINY_STATE  # the largest rank is reported
    assert summarize(r)["model_state_vs_analytic"] == pytest.approx(1.5)


def test_failed_ranks_are_not_measured():
    r = record()
    r["ranks"][1]["status"] = "failed"
    assert summarize(r)["step_time_s"]["n"] == 3  # only rank 0 counted


def test_isolated_counterfactual_gives_t_compute():
    # The isolated workers' per-step max is [0.16] * 3, the synced step's median 0.2: 20% exposed.
    s = summarize(record(compute=[[0.15] * 3, [0.16] * 3], method="isolated"))
    assert s["compute_method"] == "isolated" and s["t_compute_s"] == pytest.approx(0.16)
    assert s["exposed_comm_ratio"] == pytest.approx(0.2)


def test_t_compute_is_each_process_median_then_the_slowest():
    # Out of lockstep: rank 0 slow in step 0, rank 1 in step 2. A per-step max would give [0.3, 0.1, 0.3]
    # (median 0.3); each rank's median is 0.1 and 0.1: t_compute 0.1.
    s = summarize(record(compute=[[0.3, 0.1, 0.1], [0.1, 0.1, 0.3]]))
    assert s["t_compute_s"] == pytest.approx(0.1)
    s = summarize(record(compute=[[0.3, 0.1, 0.1], [0.1, 0.1, 0.3]], method="isolated"))
    assert s["t_compute_s"] == pytest.approx(0.1) and "median per worker" in s["t_compute_detail"]


def test_isolated_counterfactual_of_a_sharded_stack_discounts_the_optimizer_it_does_not_share():
    # An isolated ZeRO-1 worker steps AdamW over all parameters (0.04 s of each 0.2 s step); a rank of the
    # 4-rank run steps a quarter of them: t_compute = 0.2 - 3/4 x 0.04 = 0.17.
    cfg = factory.config("deepspeed-zero3", 4, steps=3)
    cfg = cfg.evolve(backend_options={"zero_stage": 1, "offload_optimizer": False})
    ranks = [factory.rank_record(r, [0.25] * 3) for r in range(4)]
    workers = [{**factory.rank_record(0, [0.2] * 3), "optimizer_step_times": [0.04] * 3} for _ in range(4)]
    rec = factory.assemble(cfg, "zero1", ranks, isolated_ranks=workers, environment=factory.environment())
    s = summarize(rec)
    assert s["t_compute_s"] == pytest.approx(0.17) and "(N-1)/N" in s["t_compute_detail"]
    assert s["exposed_comm_ratio"] == pytest.approx((0.25 - 0.17) / 0.25)
    # without the optimizer's times it says so instead of guessing
    workers = [factory.rank_record(0, [0.2] * 3) for _ in range(4)]
    rec = factory.assemble(cfg, "zero1", ranks, isolated_ranks=workers, environment=factory.environment())
    assert summarize(rec)["t_compute_s"] is None


def test_peaks_are_matched_by_exact_device_name():
    assert device_peak_flops("NVIDIA RTX A1000", "bf16") is None  # not an A100
    assert device_peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert device_peak_flops("NVIDIA H100 NVL", "bf16") == 835.5e12  # not the SXM's 989
    assert device_peak_flops("NVIDIA H200 NVL", "bf16") == 835.5e12
    assert device_peak_flops("NVIDIA H200", "bf16") == 989e12


def test_fp32_mfu_uses_the_tf32_peak_when_every_rank_ran_tf32():
    tokens_per_device_s = 4 * 2 * 2 * 128 / 0.2 / 2
    r = record(device="NVIDIA H100 80GB HBM3")
    assert summarize(r)["mfu"] == pytest.approx(TINY_FLOPS_PER_TOKEN * tokens_per_device_s / 67e12)
    for rank in r["ranks"]:
        rank["math_mode"] = {"tf32": True}
    s = summarize(r)
    assert s["device_peak_precision"] == "tf32" and s["tf32"] is True
    assert s["mfu"] == pytest.approx(TINY_FLOPS_PER_TOKEN * tokens_per_device_s / 494.5e12)
    r["ranks"][1]["math_mode"] = {"tf32": False}  # disagreeing ranks: the plain fp32 peak
    assert summarize(r)["device_peak_precision"] == "fp32"


def test_a_failing_analysis_still_leaves_a_record_with_the_raw_ranks(monkeypatch, capsys):
    def broken(record):
        raise KeyError("an analysis bug")

    monkeypatch.setattr(run_record, "summarize", broken)
    rec = record()
    assert rec["summary"] == {"error": "KeyError: 'an analysis bug'"} and len(rec["ranks"]) == 2
    summary_view.print_summary(rec)
    assert "no summary: KeyError" in capsys.readouterr().out
