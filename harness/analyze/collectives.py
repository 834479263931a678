"""`harness commbench` figures, computed here and only here from the raw per-rank, per-call times: the time
of each op and size, its algorithm and bus bandwidth as nccl-tests defines them, and a fitted latency and
bandwidth per op (the α-β model the prediction of larger clusters uses).

nccl-tests (doc/PERFORMANCE.md): algbw = S / t, with S the message size it prints (all_reduce and
broadcast: the buffer; all_gather: the gathered output; reduce_scatter: the input; all_to_all: one rank's
send buffer); busbw = algbw x the op's bus factor: 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all, 1 for broadcast. busbw is the bandwidth a ring's busiest link sees, so it is
comparable across ops and rank counts, and with a link's peak.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from core.records import run_config
from harness.analyze.metrics import bus_factor, slowest, stats


def fit_alpha_beta(sizes: list[int], times: list[float], op: str, world: int) -> dict:
    """Least-squares fit of t(S) = α + S·busfactor/β over the sizes, in relative error (sizes span
    decades, so absolute error would fit only the largest), with α, 1/β >= 0. β is a bus bandwidth."""
    s = np.asarray(sizes, float) * bus_factor(op, world)
    t = np.asarray(times, float)
    design = np.column_stack([1 / t, s / t])
    (alpha, inverse_beta), _ = nnls(design, np.ones_like(t))
    predicted = alpha + s * inverse_beta
    return {
        "alpha_s": float(alpha),
        "beta_busbw_Bps": float(1 / inverse_beta) if inverse_beta > 0 else None,
        "max_rel_error": float(np.max(np.abs(predicted - t) / t)),
        "sizes": [int(min(sizes)), int(max(sizes))],
    }


def summarize_commbench(record: dict) -> dict:
    """Per op: per size the slowest rank's call times (median, p10, p90), algbw and busbw at the median;
    and the α-β fit over all sizes. Series other than the calls alone (`times`) that records of earlier
    versions hold are left out."""
    world = run_config(record).topology.world_size
    ranks = [r for r in record["ranks"] if r.get("status") == "ok"]
    if len(ranks) < world:
        return {"error": f"{world - len(ranks)} rank(s) without results"}
    ops: dict[str, dict] = {}
    for i, point in enumerate(ranks[0]["collectives"]):
        op, size = point["op"], point["bytes"]
        times = slowest([r["collectives"][i]["times"] for r in ranks])  # a call ends when every rank's has
        t = stats(times)
        algbw = size / t["median"] if t["median"] else None
        entry = {
            "bytes": size,
            "time_s": {k: t[k] for k in ("median", "p10", "p90", "n")},
            "algbw_Bps": algbw,
            "busbw_Bps": algbw and algbw * bus_factor(op, world),
            "times_s": times,
        }
        ops.setdefault(op, {"points": []})["points"].append(entry)
    for op, entry in ops.items():
        points = entry["points"]
        if len(points) >= 2:
            entry["fit"] = fit_alpha_beta(
                [p["bytes"] for p in points], [p["time_s"]["median"] for p in points], op, world
            )
    return {"ops": ops, "world_size": world, "dtype": run_config(record).commbench_spec.dtype}


def op_time_index(summary: dict, op: str) -> float | None:
    """One number per run for an op's whole curve: the geometric mean over sizes of its median call times,
    so every size weighs the same in a comparison (a plain mean would be the largest size's time)."""
    points = (summary.get("ops") or {}).get(op, {}).get("points") or []
    times = [p["time_s"]["median"] for p in points if p["time_s"]["median"]]
    return float(np.exp(np.mean(np.log(times)))) if times else None


def largest_busbw(summary: dict, op: str) -> tuple[int, float | None] | None:
    """(size, busbw) at the op's largest size: the bandwidth end of its curve."""
    points = (summary.get("ops") or {}).get(op, {}).get("points") or []
    return (points[-1]["bytes"], points[-1]["busbw_Bps"]) if points else None


TABLE_KEYS = ["label", "device", "world_size", "dtype", "op", "bytes"]


def commbench_rows(records: list[dict]) -> pd.DataFrame:
    """The tidy table of commbench records: one row per ok record, op and size (for report and results)."""
    rows = []
    for record in records:
        summary = record.get("summary") or {}
        if record.get("status") != "ok" or "ops" not in summary:
            continue
        topo = run_config(record).topology
        for op, entry in summary["ops"].items():
            fit = entry.get("fit") or {}
            for p in entry["points"]:
                rows.append(
                    {
                        "run_id": record["run_id"],
                        "label": record["backend_info"]["label"],
                        "api": record["backend_info"].get("api"),
                        "device": (record.get("environment") or {}).get("device_kind") or topo.device,
                        "world_size": topo.world_size,
                        "nodes": topo.nodes,
                        "dtype": summary["dtype"],
                        "op": op,
                        "bytes": p["bytes"],
                        "time_s": p["time_s"]["median"],
                        "time_p10_s": p["time_s"]["p10"],
                        "time_p90_s": p["time_s"]["p90"],
                        "algbw_Bps": p["algbw_Bps"],
                        "busbw_Bps": p["busbw_Bps"],
                        "alpha_s": fit.get("alpha_s"),
                        "beta_busbw_Bps": fit.get("beta_busbw_Bps"),
                    }
                )
    return pd.DataFrame(rows, columns=None if rows else ["run_id", *TABLE_KEYS, "time_s", "busbw_Bps"])


def commbench_aggregate(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per stack, device, N, dtype, op and size over repeated records: the median of their median
    times, with algbw and busbw recomputed from it (a median of bandwidths would not be one time's)."""
    if rows.empty:
        return rows
    agg = rows.groupby(TABLE_KEYS, as_index=False).agg(
        time_s=("time_s", "median"),
        runs=("run_id", "nunique"),
        alpha_s=("alpha_s", "median"),
        beta_busbw_Bps=("beta_busbw_Bps", "median"),
    )
    agg["algbw_Bps"] = agg["bytes"] / agg["time_s"]
    agg["busbw_Bps"] = [
        a * bus_factor(op, n) for a, op, n in zip(agg["algbw_Bps"], agg["op"], agg["world_size"])
    ]
    return agg


def call_time(summary: dict, op: str, size: float) -> float | None:
    """What commbench says one `op` of `size` bytes takes: its median times interpolated log-log between
    the measured sizes, the α-β fit outside them; with one size measured (no fit), that size's median, at
    that size only. None if the op was not measured."""
    entry = (summary.get("ops") or {}).get(op)
    if not entry or not size:
        return None
    points, fit = entry["points"], entry.get("fit")
    if points[0]["bytes"] <= size <= points[-1]["bytes"]:
        sizes = np.array([p["bytes"] for p in points], float)
        times = np.array([p["time_s"]["median"] for p in points], float)
        return float(np.exp(np.interp(np.log(size), np.log(sizes), np.log(times))))
    return fitted_time(fit, op, size, summary["world_size"]) if fit else None


def fitted_time(fit: dict, op: str, size: float, world: int) -> float:
    """t(S) = α + S·busfactor/β of an α-β fit (fit_alpha_beta)."""
    beta = fit["beta_busbw_Bps"]
    return fit["alpha_s"] + (size * bus_factor(op, world) / beta if beta else 0.0)
