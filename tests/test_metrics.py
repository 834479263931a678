"""Derived figures on hand-made records with known answers."""
import pytest

from harness.analyze.metrics import comm_bytes_per_rank, device_peak_flops, per_step_max, summarize
from workloads.spec import PRESETS


def record(world=2, step_times=None, compute=None, device="cpu: test", method="no_sync", precision="fp32"):
    spec = PRESETS["tiny"]
    step_times = step_times or [[0.1, 0.2, 0.3]] * world
    ranks = [{"rank": r, "status": "ok", "device": device, "step_times": step_times[r],
              "data_wait": [0.001] * len(step_times[r]), "losses": [5.0 + r, 4.0 + r, 3.0 + r][:len(step_times[r])],
              "compute_only_step_times": (compute or [[]] * world)[r],
              "memory": {"peak_rss": 100 + r}, "model_state_bytes": {"total": 16 * spec.n_params}}
             for r in range(world)]
    return {"config": {"spec": spec.to_dict(), "world_size": world, "micro_batch": 4, "grad_accum": 2,
                       "precision": precision},
            "backend_info": {"sharding": "none", "precision_scheme": "autocast",
                             "comm_pattern": {"kind": "allreduce", "dtype_bytes": 4}},
            "comm": {"t_compute_method": method if world > 1 else "none"}, "ranks": ranks}


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
    volume = 2 * 1 / 2 * PRESETS["tiny"].n_params * 4
    assert s["comm_bytes_per_rank_per_step"] == pytest.approx(volume)
    assert s["implied_busbw_bytes_per_s"] == pytest.approx(volume / 0.05)
    # compute slower than the synced step (noise): clamped at 0, no bandwidth claimed
    s = summarize(record(compute=[[0.3] * 3] * 2))
    assert s["exposed_comm_ratio"] == 0.0 and s["implied_busbw_bytes_per_s"] is None


def test_single_rank_has_zero_comm_by_definition():
    s = summarize(record(world=1))
    assert s["exposed_comm_ratio"] == 0.0 and s["comm_bytes_per_rank_per_step"] == 0.0


def test_sharded_volume():
    assert comm_bytes_per_rank("sharded", 1000, 2, 4) == pytest.approx(3 * 3 / 4 * 1000 * 2)


def test_mfu_only_with_a_known_peak():
    assert summarize(record())["mfu"] is None
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    s = summarize(record(device="NVIDIA H200", precision="bf16"))
    expected = PRESETS["tiny"].flops_per_token * (4 * 2 * 2 * 128 / 0.2 / 2) / 989e12
    assert s["mfu"] == pytest.approx(expected)


def test_model_state_against_analytic():
    s = summarize(record())
    assert s["model_state_vs_analytic"] == pytest.approx(1.0)
    assert s["peak_rss_bytes"] == 101


def test_failed_ranks_are_not_measured():
    r = record()
    r["ranks"][1]["status"] = "failed"
    assert summarize(r)["step_time_s"]["n"] == 3  # only rank 0 counted
