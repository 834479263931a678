"""Every derived figure, computed here and only here, from raw rank records (see shared DESIGN.md).

Reports, sweeps and compare all call `summarize`; no backend computes a metric of its own.
"""

from __future__ import annotations

import numpy as np

from workloads.spec import ModelSpec

# Dense peak FLOP/s per device, from the vendors' data sheets (no sparsity). fp32 is plain FP32 (non-TF32)
# because PyTorch does not use TF32 for fp32 matmuls by default. Matched by substring, first match wins.
PEAK_FLOPS = (
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
)


def device_peak_flops(device_name: str | None, precision: str) -> float | None:
    """Peak FLOP/s for this device and precision, or None when unknown (a CPU, an unlisted GPU)."""
    for key, peaks in PEAK_FLOPS:
        if device_name and key in device_name:
            return peaks.get(precision)
    return None


def per_step_max(ranks: list[dict], key: str) -> list[float]:
    """Step i's time = the slowest rank's time for step i: the slowest rank sets the pace."""
    series = [r.get(key) or [] for r in ranks]
    if not series or not all(series):
        return []
    n = min(len(s) for s in series)
    return [max(s[i] for s in series) for i in range(n)]


def stats(xs: list[float]) -> dict:
    if not xs:
        return {"median": None, "p10": None, "p90": None, "mean": None, "min": None, "max": None, "n": 0}
    a = np.asarray(xs, float)
    return {
        "median": float(np.median(a)),
        "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
        "n": int(a.size),
    }


def comm_bytes_per_rank(
    kind: str,
    n_params: int,
    dtype_bytes: int,
    world: int,
    reduce_dtype_bytes: int = 0,
    param_gathers: int = 2,
) -> float:
    """Analytic bytes each rank sends per step: ring all-reduce 2(N-1)/N x G; sharded data parallel
    (FSDP, ZeRO-3) 3(N-1)/N x P (all-gather params forward and backward, reduce-scatter grads), with
    `param_gathers` all-gathers and the gradients in `reduce_dtype_bytes` where those differ."""
    if world <= 1:
        return 0.0
    reduce = reduce_dtype_bytes or dtype_bytes
    per_param = {"allreduce": 2 * reduce, "sharded": param_gathers * dtype_bytes + reduce}[kind]
    return (world - 1) / world * n_params * per_param


def comm_volume_method(pattern: dict) -> str:
    """How the volume was obtained, spelled out where a sharded pattern departs from 3 equal transfers."""
    if pattern["kind"] == "sharded" and (
        pattern.get("reduce_dtype_bytes") or pattern.get("param_gathers", 2) != 2
    ):
        return (
            f"analytic sharded ({pattern.get('param_gathers', 2)} all-gather(s) of "
            f"{pattern['dtype_bytes']}-byte params, reduce-scatter of "
            f"{pattern.get('reduce_dtype_bytes') or pattern['dtype_bytes']}-byte grads)"
        )
    return f"analytic {pattern['kind']} ({pattern['dtype_bytes']}-byte elements)"


def summarize(record: dict) -> dict:
    """The derived figures of one run record. Unmeasurable figures are None, never guessed."""
    cfg, info = record["config"], record.get("backend_info", {})
    spec = ModelSpec(**cfg["spec"])
    world = cfg["world_size"]
    ranks = [r for r in record.get("ranks", []) if r.get("status") == "ok"]
    step_times = per_step_max(ranks, "step_times")
    t = stats(step_times)
    tokens_per_step = cfg["micro_batch"] * cfg["grad_accum"] * world * spec.seq_len
    samples_per_step = cfg["micro_batch"] * cfg["grad_accum"] * world
    t_step = t["median"]
    throughput = tokens_per_step / t_step if t_step else None

    method = record.get("comm", {}).get("t_compute_method", "none")
    compute_series = {
        "no_sync": per_step_max(ranks, "compute_only_step_times"),
        "isolated": per_step_max(record.get("isolated_ranks", []), "step_times"),
    }.get(method, [])
    t_compute = stats(compute_series)["median"]
    exposed = None
    if world == 1:
        exposed = 0.0
    elif t_step and t_compute:
        exposed = max(0.0, (t_step - t_compute) / t_step)

    pattern = info.get("comm_pattern", {"kind": "allreduce", "dtype_bytes": 4})
    volume = comm_bytes_per_rank(
        pattern["kind"],
        spec.n_params,
        pattern["dtype_bytes"],
        world,
        pattern.get("reduce_dtype_bytes", 0),
        pattern.get("param_gathers", 2),
    )
    exposed_s = (t_step - t_compute) if (t_step and t_compute and t_step > t_compute) else None
    busbw = volume / exposed_s if (volume and exposed_s) else None

    losses = [float(np.mean(step)) for step in zip(*[r["losses"] for r in ranks])] if ranks else []
    device = ranks[0]["device"] if ranks else None
    peak = device_peak_flops(device, cfg["precision"])
    per_device = throughput / world if throughput else None
    mfu = spec.flops_per_token * per_device / peak if (peak and per_device) else None

    def rank_max(section: str, key: str):
        values = [r.get(section, {}).get(key) for r in ranks]
        values = [v for v in values if v is not None]
        return max(values) if values else None

    analytic_state = spec.model_state_bytes(
        cfg["precision"], info.get("precision_scheme"), info.get("sharding", "none"), world
    )
    measured_state = rank_max("model_state_bytes", "total")
    data_wait = stats(per_step_max(ranks, "data_wait"))["median"]
    return {
        "step_time_s": t,
        "tokens_per_step": tokens_per_step,
        "throughput_tokens_per_s": throughput,
        "throughput_samples_per_s": samples_per_step / t_step if t_step else None,
        "per_device_tokens_per_s": per_device,
        "data_wait_s": data_wait,
        "data_wait_fraction": data_wait / t_step if (data_wait is not None and t_step) else None,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "compute_method": method,
        "t_compute_s": t_compute,
        "exposed_comm_ratio": exposed,
        "comm_bytes_per_rank_per_step": volume,
        "comm_volume_method": comm_volume_method(pattern),
        "implied_busbw_bytes_per_s": busbw,
        "model_flops_per_step": spec.flops_per_token * tokens_per_step,
        "device_peak_flops": peak,
        "mfu": mfu,
        "peak_rss_bytes": rank_max("memory", "peak_rss"),
        "minor_faults_per_step": max(
            (r["minor_faults_per_step"] for r in ranks if "minor_faults_per_step" in r), default=None
        ),
        "peak_allocated_bytes": rank_max("memory", "allocated_peak"),
        "peak_reserved_bytes": rank_max("memory", "reserved_peak"),
        "nvml_used_bytes": rank_max("memory", "nvml_used"),
        "model_state_bytes_per_rank": measured_state,
        "model_state_bytes_analytic": analytic_state["total"],
        "model_state_vs_analytic": measured_state / analytic_state["total"] if measured_state else None,
    }
