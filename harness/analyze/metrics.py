"""Every derived figure, computed here and only here, from raw rank records (defined in docs/measurement.md).

Reports, sweeps and compare all call `summarize`; no backend computes a metric of its own.
"""

from __future__ import annotations

import numpy as np

from backends import get_backend
from core.records import run_config
from harness.analyze.anatomy import (
    resolved,
    slowest_less_sharded_optimizer,
    slowest_process_series,
    step_anatomy,
)

# Dense peak FLOP/s (no sparsity) from NVIDIA's data sheets, by the exact name the driver reports
# (torch.cuda.get_device_name, nvidia-smi): a substring would take "RTX A1000" for an A100. "tf32" is the
# peak of fp32 matmuls run as TF32, which each worker records (math_mode) since frameworks differ in it.
A100 = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
H100_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}  # also the H200 (SXM)
H100_PCIE = {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}
NVL = {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}  # H100 NVL, H200 NVL
PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": A100,
    "NVIDIA A100-SXM4-80GB": A100,
    "NVIDIA A100-PCIE-40GB": A100,
    "NVIDIA A100 80GB PCIe": A100,
    "NVIDIA H100 80GB HBM3": H100_SXM,
    "NVIDIA H100 PCIe": H100_PCIE,
    "NVIDIA H100 NVL": NVL,
    "NVIDIA H200": H100_SXM,
    "NVIDIA H200 NVL": NVL,
}


def peak_precision(precision: str, tf32: bool | None) -> str:
    """The peak an fp32 run is measured against: TF32's when its matmuls ran as TF32."""
    return "tf32" if precision == "fp32" and tf32 else precision


def run_numerics(ranks: list[dict]) -> dict | None:
    """The numerics the run's workers recorded (core.precision: the adapter's, checked by each worker
    against what it observed, so every ok rank holds the same): the first rank's; None for a record
    from before workers recorded them."""
    recorded = ((r.get("math_mode") or {}).get("numerics") for r in ranks)
    return next((n for n in recorded if n), None)


def device_peak_flops(device_name: str | None, precision: str) -> float | None:
    """Peak FLOP/s for this exact device and precision (peak_precision's), or None when unknown (a CPU, an
    unlisted GPU): never guessed."""
    peaks = PEAK_FLOPS.get(" ".join((device_name or "").split()))
    return peaks.get(precision) if peaks else None


def slowest(series: list[list[float]]) -> list[float]:
    """Element i = the largest of the series' i-th values: step i's (or call i's) time is the slowest
    rank's, which sets the pace. Empty if any series is."""
    if not series or not all(series):
        return []
    n = min(len(s) for s in series)
    return [max(s[i] for s in series) for i in range(n)]


def per_step_max(ranks: list[dict], key: str) -> list[float]:
    """Step i's `key` (a per-step series of every rank record) = the slowest rank's."""
    return slowest([r.get(key) or [] for r in ranks])


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


# Bytes each rank sends per element of the whole tensor, by collective, on a ring of N ranks (the nccl-tests
# convention): all-reduce 2(N-1)/N, all-gather and reduce-scatter (N-1)/N.
def bus_factor(op: str, world: int) -> float:
    """nccl-tests' factor from a collective's size S to the bytes each rank sends in a ring (and from
    algbw to busbw): 2(n-1)/n for all_reduce; (n-1)/n for all_gather, reduce_scatter and all_to_all; 1 for
    broadcast. Used for the analytic volume, the traced volume and commbench alike."""
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) / world
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op}")


def comm_bytes_per_rank(terms: list[dict], world: int) -> float:
    """Analytic bytes each rank sends per step: the sum over the stack's collectives (the adapter's
    CommPattern terms) of ring factor x whole-tensor elements x element bytes x times per step."""
    if world <= 1:
        return 0.0
    return sum(bus_factor(t["op"], world) * t["elements"] * t["dtype_bytes"] * t["per_step"] for t in terms)


def comm_volume_method(pattern: dict) -> str:
    """How the volume was obtained: analytic, term by term, with the model's assumptions."""
    terms = "; ".join(
        f"{t['per_step']:g} x {t['op']} of {t['what']} ({t['dtype_bytes']}-byte)" for t in pattern["terms"]
    )
    return f"analytic: {terms}" + (f" [{pattern['assumptions']}]" if pattern.get("assumptions") else "")


def measured_comm(ranks: list[dict], world: int, terms: list[dict]) -> dict | None:
    """The collective trace of the profiled steps (backends.comm_trace entries per rank), per op: calls and
    size (nccl-tests' S) per step, time per step (the slowest rank's), the share of that time the rank's
    compute ran alongside, and busbw = S x bus factor / time; and the bytes each rank sent per step (S x
    bus factor, summed), next to the analytic volume and per op beside the analytic size; the traced steps'
    median time (profiling slows them). Only ranks whose instrument wrote a trace count (Horovod's timeline
    is rank 0's); with none, the reason. None without ranks. Where the ranks also counted their bytes on
    the wire (Paddle on CPU), those stand beside the trace; where that is all they have, wire_comm.

    Every collective here spans all ranks, so each rank issues the same calls; a rank whose trace holds
    fewer bytes of an op than another's lost events (TensorFlow's profiler can drop the last one). The op's
    size is then the largest rank's, and `ranks_short` names the ranks below it, with their sizes."""
    if not ranks:
        return None
    traces = [r.get("comm_trace") or {} for r in ranks]

    def ranks_with(has) -> dict:
        return {
            r.get("rank", i): t for i, (r, t) in enumerate(zip(ranks, traces)) if t.get("method") and has(t)
        }

    traced_by_rank = ranks_with(lambda t: t.get("collectives") is not None)
    if not traced_by_rank:
        wired = ranks_with(lambda t: t.get("wire"))
        if wired:
            return wire_comm(wired, traces, world, terms)
        reasons = {t["reason"] for t in traces if t.get("reason") is not None}
        return {"method": None, "reason": "; ".join(sorted(reasons)) or "not traced"}
    traced, traced_ids = list(traced_by_rank.values()), list(traced_by_rank)
    steps = traced[0]["steps"]
    ops: dict[str, dict] = {}
    for op in sorted({c["op"] for t in traced for c in t["collectives"]}):
        per_rank = [[c for c in t["collectives"] if c["op"] == op] for t in traced]
        sizes = [sum(c["size_bytes"] or 0 for c in calls) / steps for calls in per_rank]
        times = [sum(c["time_s"] or 0 for c in calls) / steps for calls in per_rank]
        overlaps = [c["overlapped_s"] for calls in per_rank for c in calls if c["overlapped_s"] is not None]
        total_time = sum(times) * steps
        fullest = max(range(len(sizes)), key=sizes.__getitem__)
        short = {str(traced_ids[i]): size for i, size in enumerate(sizes) if size < sizes[fullest]}
        ops[op] = {
            "calls_per_step": len(per_rank[fullest]) / steps,
            "size_bytes_per_step": sizes[fullest],
            "ranks_agree": not short,
            "ranks_short": short,
            "time_s_per_step": max(times),
            "overlap_fraction": sum(overlaps) / total_time if overlaps and total_time else None,
            "busbw_Bps": sizes[fullest] * bus_factor(op, world) / max(times) if max(times) else None,
            "dtypes": sorted({str(c["dtype"]) for calls in per_rank for c in calls}),
            "analytic_size_bytes_per_step": sum(
                t["elements"] * t["dtype_bytes"] * t["per_step"] for t in terms if t["op"] == op
            ),
        }
    sent = sum(o["size_bytes_per_step"] * bus_factor(op, world) for op, o in ops.items())
    analytic_bytes = comm_bytes_per_rank(terms, world)
    out = {
        **trace_frame(traced_by_rank, traces, lambda t: t.get("collectives") is None),
        "ops": ops,
        "bytes_per_rank_per_step": sent,
        "vs_analytic": sent / analytic_bytes if analytic_bytes else None,
    }
    if all(t.get("wire") for t in traced):  # a second, independent count of the same traffic
        out.update(wire_figures(traced_by_rank))
    return out


def trace_frame(by_rank: dict, traces: list[dict], untraced) -> dict:
    """What measured_comm says of the trace itself: its method and steps, the ranks that count (and why
    the others, those `untraced` picks, do not), and the traced steps' median time."""
    first = next(iter(by_rank.values()))
    traced_steps = slowest([t["step_times"] for t in traces if t.get("step_times")])
    return {
        "method": first["method"],
        "steps": first["steps"],
        "ranks_traced": len(by_rank),
        "untraced_reason": "; ".join(sorted({t["reason"] for t in traces if untraced(t) and t.get("reason")}))
        or None,
        "traced_step_time_s": float(np.median(traced_steps)) if traced_steps else None,
    }


def wire_figures(by_rank: dict) -> dict:
    """Each rank's bytes sent per step on its TCP connections, and how many connections closed while
    traced (they took their bytes with them: the figures may be short)."""
    return {
        "wire_sent_bytes_per_step": {
            str(rank): t["wire"]["sent_bytes"] / t["steps"] for rank, t in by_rank.items()
        },
        "connections_closed": sum(t["wire"].get("connections_closed", 0) for t in by_rank.values()),
    }


def wire_comm(wired: dict, traces: list[dict], world: int, terms: list[dict]) -> dict:
    """measured_comm from the bytes each rank's connections carried over the traced steps (a stack whose
    own instrument records no collective: Paddle's sharding on CPU): the ranks' mean sent bytes per step
    beside the analytic volume (a ring sends the same from every rank; a rooted op does not, so the mean),
    each rank's own, and no per-op figure: neither op nor time is known."""
    wire = wire_figures(wired)
    per_rank = float(np.mean(list(wire["wire_sent_bytes_per_step"].values())))
    analytic_bytes = comm_bytes_per_rank(terms, world)
    return {
        **trace_frame(wired, traces, lambda t: not t.get("wire")),
        "ops": {},
        **wire,
        "bytes_per_rank_per_step": per_rank,
        "vs_analytic": per_rank / analytic_bytes if analytic_bytes else None,
    }


def rank_median_max(series: list[list[float]]) -> float | None:
    """Each process's median, then the slowest: processes that are not in lockstep (isolated workers, ranks
    with sync off) drift apart, and a per-step maximum over them would be biased up by their spread."""
    slowest = slowest_process_series(series)
    return float(np.median(slowest)) if slowest else None


def compute_time(
    record: dict, method: str, ranks: list[dict], sharding: str, world: int
) -> tuple[float | None, str, list[float] | None]:
    """t_compute, how it was obtained, and the series it is the median of (the slowest process's). no_sync:
    the ranks' sync-off steps. isolated: the isolated workers' steps; where the stack shards the optimizer,
    each worker stepped the optimizer over all P parameters while a rank steps P/N, so (N-1)/N of its
    median optimizer time (timed in its anatomy steps) is taken off each of its steps."""
    if method == "no_sync":
        series = slowest_process_series([r.get("compute_only_step_times") or [] for r in ranks])
        return (
            float(np.median(series)) if series else None,
            "sync-off steps: median per rank, slowest rank",
            series,
        )
    if method != "isolated":
        return None, "none", None
    workers = record.get("isolated_ranks") or []
    discount = sharding != "none" and world > 1
    if not discount:
        series = slowest_process_series([w.get("step_times") or [] for w in workers])
        return (
            float(np.median(series)) if series else None,
            "isolated workers: median per worker, slowest worker",
            series,
        )
    for w in workers:
        if not w.get("optimizer_step_times"):
            return None, "isolated: optimizer step times missing, cannot discount the sharded optimizer", None
        if not w.get("step_times"):
            return None, "isolated: a worker recorded no steps", None
    detail = (
        "isolated workers: median step per worker less (N-1)/N of its median optimizer step (a rank "
        f"steps 1/{world} of it; timed in its anatomy steps), slowest worker"
    )
    series = slowest_less_sharded_optimizer(workers, "step_times", world)
    return (float(np.median(series)) if series else None), detail, series


def per_step_series(record: dict) -> dict[str, list[float]]:
    """The run's curves over its measured steps, as the summary derives them: the loss averaged over the
    ranks, the step time of the slowest rank, and the tokens per second that step time gives. Empty lists
    where no rank reported."""
    ranks = [r for r in record.get("ranks", []) if r.get("status") == "ok"]
    step_times = per_step_max(ranks, "step_times")
    tokens = run_config(record).tokens_per_step
    return {
        "loss": [float(np.mean(step)) for step in zip(*[r["losses"] for r in ranks])] if ranks else [],
        "step_time_s": step_times,
        "tokens_per_s": [tokens / t for t in step_times if t > 0],
    }


def cpu_oversubscription(record: dict) -> dict | None:
    """CPU workers on one node asking for more threads than the CPUs they may use (affinity, cgroup quota;
    the host's count for records made before that was recorded): their step times measure the contention,
    so the record says so. None on GPUs or when the workers fit."""
    topo, env = run_config(record).topology, record.get("environment") or {}
    cpus = env.get("cpus_available") or env.get("cpu_count")
    if topo.device != "cpu" or not cpus:
        return None
    workers, threads = topo.gpus_per_node, topo.threads_per_worker
    if workers * threads <= cpus:
        return None
    return {"workers_per_node": workers, "threads_per_worker": threads, "cpus": cpus}


def summarize(record: dict) -> dict:
    """The derived figures of one run record. Unmeasurable figures are None, never guessed."""
    cfg, info = run_config(record), record.get("backend_info", {})
    spec = cfg.model.spec
    world = cfg.topology.world_size
    ranks = [r for r in record.get("ranks", []) if r.get("status") == "ok"]
    series = per_step_series(record)
    step_times = series["step_time_s"]
    t = stats(step_times)
    n_tokens = cfg.tokens_per_step
    samples_per_step = cfg.global_batch
    t_step = t["median"]
    throughput = n_tokens / t_step if t_step else None

    method = record.get("comm", {}).get("t_compute_method", "none")
    sharding = info.get("sharding", "none")
    t_compute, t_compute_detail, compute_series = compute_time(record, method, ranks, sharding, world)
    anatomy = step_anatomy(
        record,
        ranks,
        step_times,
        (t_compute, compute_series),
        method,
        discount_optimizer=sharding != "none" and method == "isolated",
        world=world,
    )
    # Exposed communication, the anatomy's part: null where unresolved (the sync-off step slower than the
    # synced one beyond its noise), never clamped to zero.
    exposed_part = resolved(anatomy, "exposed_comm")
    exposed = exposed_part / t_step if (exposed_part is not None and t_step) else None

    pattern = info.get("comm_pattern") or {"terms": []}
    volume = comm_bytes_per_rank(pattern["terms"], world)
    exposed_s = (t_step - t_compute) if (t_step and t_compute and t_step > t_compute) else None
    volume_per_exposed_s = volume / exposed_s if (volume and exposed_s) else None

    comm_measured = measured_comm(ranks, world, pattern["terms"]) if world > 1 else None
    if comm_measured and comm_measured.get("traced_step_time_s") and t_step:
        comm_measured["trace_cost"] = comm_measured["traced_step_time_s"] / t_step - 1

    losses = series["loss"]
    device = ranks[0]["device"] if ranks else None
    tf32_states = {(r.get("math_mode") or {}).get("tf32") for r in ranks}
    peak_kind = peak_precision(cfg.model.precision, tf32_states == {True})
    peak = device_peak_flops(device, peak_kind)
    per_device = throughput / world if throughput else None
    mfu = spec.flops_per_token * per_device / peak if (peak and per_device) else None

    def rank_max(section: str, key: str):
        values = [r.get(section, {}).get(key) for r in ranks]
        values = [v for v in values if v is not None]
        return max(values) if values else None

    try:  # the predictor's term, so that measured / analytic reads against what `select` sizes
        analytic_state = get_backend(cfg.backend).model_state_bytes(cfg)
    except KeyError:  # a stack this install does not register: the spec's rule for what the record says
        analytic_state = spec.model_state_bytes(
            cfg.model.precision, info.get("precision_scheme"), info.get("sharding", "none"), world
        )
    measured_state = rank_max("model_state_bytes", "total")
    data_prep = stats(per_step_max(ranks, "data_prep"))["median"]
    # The first warm-up step, slowest rank: what compiling (torch.compile, XLA, to_static) and first-touch
    # allocation cost once per launch, which no statistic over the measured steps shows.
    firsts = [r["warmup_step_times"][0] for r in ranks if r.get("warmup_step_times")]
    return {
        "step_time_s": t,
        "tokens_per_step": n_tokens,
        "throughput_tokens_per_s": throughput,
        "throughput_samples_per_s": samples_per_step / t_step if t_step else None,
        "per_device_tokens_per_s": per_device,
        "data_prep_s": data_prep,
        "first_step_s": max(firsts) if len(firsts) == len(ranks) and ranks else None,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "losses": losses,
        "compute_method": method,
        "t_compute_s": t_compute,
        "t_compute_detail": t_compute_detail,
        "exposed_comm_ratio": exposed,
        "anatomy": anatomy,
        "comm_bytes_per_rank_per_step": volume,
        "comm_volume_method": comm_volume_method(pattern),
        "comm_measured": comm_measured,
        "volume_per_exposed_s": volume_per_exposed_s,
        "model_flops_per_step": spec.flops_per_token * n_tokens,
        "device_peak_flops": peak,
        "device_peak_precision": peak_kind if peak else None,
        "tf32": sorted(tf32_states, key=str)[0] if len(tf32_states) == 1 else None,
        "numerics": run_numerics(ranks),
        "mfu": mfu,
        "peak_rss_bytes": rank_max("memory", "peak_rss"),
        "minor_faults_per_step": max(
            (r["minor_faults_per_step"] for r in ranks if "minor_faults_per_step" in r), default=None
        ),
        "peak_allocated_bytes": rank_max("memory", "allocated_peak"),
        "peak_reserved_bytes": rank_max("memory", "reserved_peak"),
        "peak_rss_scope": next((r["memory"].get("peak_rss_scope") for r in ranks if r.get("memory")), None),
        "model_state_bytes_per_rank": measured_state,
        "model_state_bytes_analytic": analytic_state["total"],
        "model_state_vs_analytic": measured_state / analytic_state["total"] if measured_state else None,
        "cpu_oversubscribed": cpu_oversubscription(record),
    }
