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


# A commbench point's raw series (per rank, per call) -> its statistics' key in the summary -> its fit's key.
SERIES = {
    "times": "time_s",
    "times_under_load": "time_under_load_s",
    "burst_times": "time_burst_s",
    "burst_times_under_load": "time_burst_under_load_s",
}
FITS = {
    "time_s": "fit",
    "time_under_load_s": "fit_under_load",
    "time_burst_s": "fit_burst",
    "time_burst_under_load_s": "fit_burst_under_load",
}


def average(key: str) -> str:
    """The statistic a series is priced by. Under load a call either runs at once or waits for a time
    slice: a mixture whose median flips between the two, where a step pays the mean; idle, the median."""
    return "mean" if "under_load" in key else "median"


def summarize_commbench(record: dict) -> dict:
    """Per op: per size the slowest rank's call times (median, p10, p90), algbw and busbw at the median;
    and the α-β fit over all sizes. The same times and fit beside a compute thread when the run measured
    them too (`under_load`), and per call in bursts (calls queued back to back) at the sizes timed so."""
    world = record["config"]["world_size"]
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
        for series, key in SERIES.items():
            if series != "times" and series in point:
                timed = stats(slowest([r["collectives"][i][series] for r in ranks]))
                entry[key] = {k: timed[k] for k in ("median", "mean", "p10", "p90", "n")}
        ops.setdefault(op, {"points": []})["points"].append(entry)
    for op, entry in ops.items():
        for key, fit_key in FITS.items():  # one fit over every size a series has, pooling their calls
            measured = [p for p in entry["points"] if key in p]
            if len(measured) >= 2:
                entry[fit_key] = fit_alpha_beta(
                    [p["bytes"] for p in measured], [p[key][average(key)] for p in measured], op, world
                )
    return {
        "ops": ops,
        "world_size": world,
        "dtype": record["config"]["commbench"]["dtype"],
        "under_load": bool(record["config"]["commbench"].get("under_load")),
    }


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
        cfg = record["config"]
        for op, entry in summary["ops"].items():
            fit, burst_fit = entry.get("fit") or {}, entry.get("fit_burst") or {}
            for p in entry["points"]:
                rows.append(
                    {
                        "run_id": record["run_id"],
                        "label": record["backend_info"]["label"],
                        "api": record["backend_info"].get("api"),
                        "device": (record.get("environment") or {}).get("device_kind") or cfg["device"],
                        "world_size": cfg["world_size"],
                        "nodes": cfg.get("nodes", 1),
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
                        # per call of a burst (calls queued back to back), where sizes were timed so
                        "time_burst_s": (p.get("time_burst_s") or {}).get("median"),
                        "alpha_burst_s": burst_fit.get("alpha_s"),
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
        time_burst_s=("time_burst_s", "median"),
        alpha_burst_s=("alpha_burst_s", "median"),
    )
    agg["algbw_Bps"] = agg["bytes"] / agg["time_s"]
    agg["busbw_Bps"] = [
        a * bus_factor(op, n) for a, op, n in zip(agg["algbw_Bps"], agg["op"], agg["world_size"])
    ]
    return agg


def call_time(
    summary: dict, op: str, size: float, under_load: bool = False, burst: bool = False
) -> float | None:
    """What commbench says one `op` of `size` bytes takes. Idle: its median times interpolated log-log
    between the measured sizes, the α-β fit outside them. Beside a compute thread (`under_load`): the α-β
    fit of the mean times at every size. None if the op (or that series) was not measured.

    `burst`: a call among others queued back to back, priced per call of commbench's bursts the same way
    (idle: medians interpolated, the fit below the smallest size; under load: the fit of the means) up to
    the largest size timed in bursts; as a call alone above it, and where fewer than two sizes were timed
    in bursts (records from before bursts, or sizes that start above 1 MiB)."""
    entry = (summary.get("ops") or {}).get(op)
    if not entry or not size:
        return None
    if under_load and any("time_under_load_s" not in p for p in entry["points"]):
        return None
    world = summary["world_size"]
    if burst:
        key = "time_burst_under_load_s" if under_load else "time_burst_s"
        timed = [p for p in entry["points"] if key in p]
        if len(timed) >= 2 and size <= timed[-1]["bytes"]:
            return series_time(entry, key, op, size, world)
    return series_time(entry, "time_under_load_s" if under_load else "time_s", op, size, world)


def series_time(entry: dict, key: str, op: str, size: float, world: int) -> float | None:
    """One series' price of a call of `size`: under load the fit of its means; idle its medians
    interpolated log-log between the measured sizes, the fit outside them; without a fit (one size), that
    size's figure, at that size only."""
    points = [p for p in entry["points"] if key in p]
    fit = entry.get(FITS[key])
    if (average(key) == "median" or not fit) and points[0]["bytes"] <= size <= points[-1]["bytes"]:
        sizes = np.array([p["bytes"] for p in points], float)
        times = np.array([p[key][average(key)] for p in points], float)
        return float(np.exp(np.interp(np.log(size), np.log(sizes), np.log(times))))
    return fitted_time(fit, op, size, world) if fit else None


def fitted_time(fit: dict, op: str, size: float, world: int) -> float:
    """t(S) = α + S·busfactor/β of an α-β fit (fit_alpha_beta)."""
    beta = fit["beta_busbw_Bps"]
    return fit["alpha_s"] + (size * bus_factor(op, world) / beta if beta else 0.0)


def traced_ranks(run: dict) -> list[dict]:
    """The collective traces of a run's ranks that have one (Horovod's timeline: rank 0's only)."""
    return [
        r["comm_trace"] for r in run["ranks"] if (r.get("comm_trace") or {}).get("collectives") is not None
    ]


def aligned_calls(calls: list[list[dict]]) -> list[tuple] | None:
    """Each rank's traced calls side by side, call k of every rank together: ranks issue the same
    collectives in the same order. None where their (op, size) sequences differ, since pairing them by
    position would then pair different calls."""
    sequences = [[(c["op"], c["size_bytes"]) for c in rank] for rank in calls]
    return list(zip(*calls)) if all(seq == sequences[0] for seq in sequences) else None


def predicted_comm(run: dict, bench: dict) -> dict:
    """A training run's traced collectives priced by a commbench record of the same stack, device and N.
    Per op: the traced time per step (the slowest rank's), the same with each call's time taken from the
    rank that waited least in it (the last to arrive: ranks call the same collectives in the same order),
    commbench's time for each traced call's op and size summed, and the ratios; the same priced under
    load where commbench timed calls beside a compute thread. Calls commbench did not measure (an op it
    lacks) are counted, not priced."""
    traces = traced_ranks(run)
    steps = traces[0]["steps"]
    out, unpriced = {}, 0
    for op in sorted({c["op"] for t in traces for c in t["collectives"]}):
        calls = [[c for c in t["collectives"] if c["op"] == op] for t in traces]
        slowest_rank = max(sum(c["time_s"] or 0 for c in rank_calls) for rank_calls in calls)
        together = aligned_calls(calls)
        least_waiting = (
            sum(min(c["time_s"] or 0 for c in same) for same in together) if together is not None else None
        )
        predicted, loaded, priced = 0.0, 0.0, {}
        for c in calls[0]:
            size = c["size_bytes"]
            if size not in priced:  # a step repeats its sizes: each priced once
                priced[size] = (
                    call_time(bench["summary"], op, size),
                    call_time(bench["summary"], op, size, under_load=True),
                )
            t, t_loaded = priced[size]
            unpriced += t is None
            predicted += t or 0.0
            loaded += t_loaded or 0.0
        out[op] = {
            "measured_s_per_step": slowest_rank / steps,
            "least_waiting_s_per_step": least_waiting / steps if least_waiting is not None else None,
            "predicted_s_per_step": predicted / steps,
            "ratio": slowest_rank / predicted if predicted else None,
            "least_waiting_ratio": least_waiting / predicted
            if predicted and least_waiting is not None
            else None,
            # priced as calls that run beside compute, where commbench timed them so (--under-load)
            "predicted_under_load_s_per_step": loaded / steps if loaded else None,
            "ratio_under_load": slowest_rank / loaded if loaded else None,
        }

    def total(key):
        return sum(o[key] or 0.0 for o in out.values())

    totals = {
        key: total(key)
        for key in (
            "measured_s_per_step",
            "least_waiting_s_per_step",
            "predicted_s_per_step",
            "predicted_under_load_s_per_step",
        )
    }
    return {
        "ops": out,
        **totals,
        "ratio": totals["measured_s_per_step"] / totals["predicted_s_per_step"]
        if totals["predicted_s_per_step"]
        else None,
        "ratio_under_load": totals["measured_s_per_step"] / totals["predicted_under_load_s_per_step"]
        if totals["predicted_under_load_s_per_step"]
        else None,
        "unpriced_calls": unpriced,
    }


BESIDE_COMPUTE = 0.5  # a traced call that overlapped compute for more than this share of its time


def matched_comm(run: dict, bench: dict) -> dict | None:
    """A training run's traced collectives against commbench under the conditions commbench times them.

    - Each call as the last rank to arrive saw it (the least time over ranks): commbench starts every call
      from a barrier, so a rank's wait for a late peer is no part of its figure.
    - Each call priced by the condition it ran in: beside compute for most of its time (its overlap share
      over `BESIDE_COMPUTE`, where the trace measures overlap) at commbench's under-load time, the fit of
      means; otherwise at the idle time, a median.
    - Where every traced step repeats one sequence of calls, each position in the step is measured with
      commbench's statistic for its price: the mean over steps for a call priced under load, the median for
      one priced idle (a call the scheduler stalled once moves a mean). Where the sequence varies from step
      to step (Horovod fuses what each cycle finds ready), the mean over steps.
    None where no step was traced, the ranks' calls differ, a call has no time on any rank, or commbench
    has no time for a call."""
    traces = traced_ranks(run)
    steps = traces[0]["steps"] if traces else 0
    calls = aligned_calls([t["collectives"] for t in traces]) if steps else None  # [call][rank]
    if not calls:
        return None
    sequence = [(same[0]["op"], same[0]["size_bytes"]) for same in calls]
    per_step = len(calls) // steps
    repeats = per_step > 0 and len(calls) == per_step * steps and sequence == sequence[:per_step] * steps
    # the groups of calls measured together: each position in the step, or each call on its own
    groups = [calls[k::per_step] for k in range(per_step)] if repeats else [[same] for same in calls]
    loaded_known = bool(bench["summary"].get("under_load"))
    measured = predicted = beside_calls = 0.0
    for group in groups:
        shares = [
            c["overlapped_s"] / c["time_s"]
            for same in group
            for c in same
            if c["overlapped_s"] is not None and c["time_s"]
        ]
        beside = loaded_known and bool(shares) and float(np.median(shares)) > BESIDE_COMPUTE
        price = call_time(bench["summary"], group[0][0]["op"], group[0][0]["size_bytes"], under_load=beside)
        if price is None:
            return None
        known = [[c["time_s"] for c in same if c["time_s"] is not None] for same in group]
        if not all(known):
            return None
        last_arrival = [min(times) for times in known]
        statistic = np.mean if beside or not repeats else np.median
        measured += float(statistic(last_arrival)) * len(group)
        predicted += price * len(group)
        beside_calls += beside * len(group)
    measured, predicted = measured / steps, predicted / steps
    return {
        "statistic": "each call position's median or mean over steps" if repeats else "mean over steps",
        "calls_per_step": len(calls) / steps,
        "calls_beside_compute_per_step": beside_calls / steps,
        "measured_s_per_step": float(measured),
        "predicted_s_per_step": float(predicted),
        "ratio": float(measured / predicted) if predicted else None,
    }
