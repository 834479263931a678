"""The prediction of one configuration at one rank count: compute, the collectives replayed against it on one
communication stream, memory per rank, and what training on T tokens takes.

Every figure is evaluated at three corners of its inputs (hardware.CORNERS: the fast ends of every range,
the nominal values, the slow ends); a figure's band is its value at the fast and slow corners.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import norm

from backends import get_backend
from backends.base import parameter_numels
from backends.schedule import Message, Schedule, Steps
from core.config import RunConfig
from core.records import run_config
from harness.analyze.metrics import summarize
from harness.predict import margin
from harness.predict.hardware import CORNERS, Profile, ProfileError, pick

# Assumed when no calibration run is given (labelled so): model FLOPs utilisation of forward+backward,
# [low, nominal, high]; dense transformer training at 1-10B parameters reports 30-55% (torchtitan, Megatron).
ASSUMED_MFU = (0.30, 0.40, 0.50)
# AdamW bytes moved per parameter and step: fp32 param, grad, two moments read; param, moments written;
# a "master" scheme also writes the low-precision copy, an "fp32-master" one the fp32 module's.
OPTIMIZER_BYTES_PER_PARAM = {"fp32": 28, "autocast": 28, "master": 30, "fp32-master": 32}
# That is one fused kernel's traffic. torch's foreach AdamW (its default on a GPU: _multi_tensor_adam with
# decoupled weight decay) makes eight passes over fp32 tensors: params *= 1 - lr*wd (8 B), exp_avg.lerp_
# (12), exp_avg_sq *= beta2 (8), addcmul_ (12), sqrt into a new tensor (8), its div_ (8) and add_ (8),
# params.addcdiv_ (16): 80 B a parameter, 52 more than fused.
FOREACH_EXTRA_BYTES_PER_PARAM = 52
# Activations per layer per sequence position, in units of d_model x element bytes (Korthikanti et al.
# 2022, "Reducing Activation Recomputation in Large Transformer Models", 34·s·b·h bytes at 2-byte
# elements = 17 elements; attention scores are not stored, as SDPA's fused kernels recompute them).
ACTIVATION_ELEMENTS_PER_LAYER = 17
ASSUMED_ACTIVATION_FACTOR = (0.8, 1.0, 1.25)
NORMAL_P10_P90 = 2 * 1.2816  # p90 - p10 of a normal distribution, in σ


def expected_slowest(world: int) -> float:
    """E[max of `world` standard normals] (Blom's approximation; 0.56 at 2, 3.0 at 512): ranks that meet
    in a collective every step wait for the slowest, so a step is the mean compute plus this many σ of a
    rank's step-to-step variation (the bias harness.analyze.metrics.rank_median_max avoids when measuring
    compute, and which a synchronised step really pays)."""
    return float(norm.ppf((world - 0.375) / (world + 0.25))) if world > 1 else 0.0


@dataclass
class Calibration:
    """What measured records tell the model: forward+backward seconds per FLOP and optimizer seconds per
    parameter at the fast/nominal/slow corners (None: assumed), the activation factor, and provenance."""

    seconds_per_flop: tuple | None = None
    optimizer_seconds_per_param: tuple | None = None
    activation_factor: tuple = ASSUMED_ACTIVATION_FACTOR
    step_cv: float | None = None  # a rank's step-to-step variation (σ / median), from the runs' p10-p90
    # Per-GPU throughput lost per doubling of N beyond a node at the slow end, fitted on published runs
    # (harness.predict.margin): empirical, not modelled; 0 gives the model's own band.
    empirical_scale_loss: float = 0.0
    sources: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def segment_flops(cfg: RunConfig, steps: Steps) -> np.ndarray:
    """FLOPs of each segment per rank: a block's matmuls and attention, the head's vocabulary projection,
    backward twice forward (plus a forward again under activation checkpointing); the embedding is a
    lookup."""
    spec, tokens = cfg.model.spec, cfg.batch.micro_batch * cfg.model.spec.seq_len
    head = 2 * spec.d_model * spec.vocab_size
    block = (spec.flops_per_token / 3 - head) / spec.n_layers
    out = []
    for s in steps.list:
        per_token = {"embed": 0.0, "head": head}.get(s.unit, block)
        if s.phase == "backward":
            per_token *= 2 + (1 if cfg.model.activation_checkpointing and s.unit.startswith("block") else 0)
        if s.phase == "optimizer":
            per_token = 0.0
        out.append(per_token * tokens)
    return np.array(out)


def local_parameters(cfg: RunConfig, sharding: str) -> float:
    """Parameters whose optimizer step one rank runs: 1/N of them once the optimizer state is sharded."""
    return cfg.model.spec.n_params / (cfg.topology.world_size if sharding != "none" else 1)


def replay(durations, messages: list[Message], comm_time) -> dict:
    """Compute segments in order on one stream, collectives in the order they become ready on another (one
    at a time, as NCCL serialises a communicator's calls). A segment waits for the messages it needs."""
    n = len(durations)
    start, end = np.zeros(n), np.zeros(n)
    done: dict[int, float] = {}  # message index -> when its collective ends, once issued
    intervals, comm_free, clock, scheduled = [], 0.0, 0.0, 0

    def ready(m):
        return (end[m.after] if m.after >= 0 else 0.0) + m.delay_s

    order = sorted(range(len(messages)), key=lambda i: (messages[i].after, i))

    spans: dict[int, tuple[float, float]] = {}  # message index -> (start, end) on the comm stream

    def issue(upto):  # every message ready at the end of segment `upto` or earlier
        nonlocal comm_free, scheduled
        batch = []
        while scheduled < len(order) and messages[order[scheduled]].after <= upto:
            batch.append(order[scheduled])
            scheduled += 1
        for i in sorted(batch, key=lambda i: (ready(messages[i]), i)):
            t0 = max(comm_free, ready(messages[i]))
            comm_free = t0 + comm_time(messages[i])
            done[i] = comm_free
            intervals.append((t0, comm_free))
            spans[i] = (t0, comm_free)

    needed: dict[int, list[int]] = {}
    for i, m in enumerate(messages):
        if m.before is not None:
            needed.setdefault(m.before, []).append(i)
    for k in range(n):
        issue(k - 1)
        wait = max((done[i] for i in needed.get(k, [])), default=0.0)
        start[k] = max(clock, wait)
        end[k] = clock = start[k] + durations[k]
    issue(n)
    step = max(clock, comm_free)
    overlapped = overlap(intervals, list(zip(start, end)))
    # Where compute stands idle (waiting for a collective, or the step's tail after the last segment), the
    # collectives then on the wire are the exposed time, each charged for its own share of it.
    before = [float(end[k - 1]) if k else 0.0 for k in range(n)]
    idle = [(before[k], float(start[k])) for k in range(n) if start[k] > before[k]]
    if step > clock:
        idle.append((float(clock), float(step)))
    exposed = shares(spans, idle)
    return {
        "step_s": step,
        "compute_s": float(np.sum(durations)),
        "comm_busy_s": sum(b - a for a, b in intervals),
        "overlapped_s": overlapped,
        "exposed_by_message": exposed,
        "busy_by_message": {i: b - a for i, (a, b) in spans.items()},
    }


def shares(spans: dict[int, tuple[float, float]], idle: list[tuple[float, float]]) -> dict[int, float]:
    """Each span's time inside the sorted, disjoint `idle` intervals, in one pass over both: the spans are
    one stream's calls, disjoint and in time order (a pair per span would be quadratic in the calls, and a
    large model issues thousands a step)."""
    out, j = {}, 0
    for i, (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        while j < len(idle) and idle[j][1] <= a:
            j += 1
        total, k = 0.0, j
        while k < len(idle) and idle[k][0] < b:
            total += max(0.0, min(b, idle[k][1]) - max(a, idle[k][0]))
            k += 1
        out[i] = total
    return out


def overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Total time two sorted lists of disjoint intervals share, in one pass over both (the collectives of
    one communication stream against the compute segments of one stream)."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        (a, b), (c, d) = first[i], second[j]
        total += max(0.0, min(b, d) - max(a, c))
        if b < d:
            i += 1
        else:
            j += 1
    return total


def activation_bytes(cfg: RunConfig, element_bytes: int) -> dict:
    """Activations of one micro-batch kept for backward, and the logits' fp32 copies for the loss."""
    spec = cfg.model.spec
    tokens = cfg.batch.micro_batch * spec.seq_len
    layer = ACTIVATION_ELEMENTS_PER_LAYER * tokens * spec.d_model * element_bytes
    if (
        cfg.model.activation_checkpointing
    ):  # each block's input kept, one block's activations during recompute
        blocks = spec.n_layers * tokens * spec.d_model * element_bytes + layer
    else:
        blocks = spec.n_layers * layer
    logits = tokens * spec.vocab_size * (element_bytes + 8)  # logits, fp32 softmax and its gradient
    return {"blocks": blocks, "logits": logits}


def memory(cfg: RunConfig, factor: float, plan: Schedule | None = None) -> dict:
    """Bytes per rank: model state by sharding (the spec's rule, as the summary's analytic value), the
    parameters a sharded stack gathers for the block it computes and the one it prefetches, the buffers
    communication keeps, and activations (scaled by the activation factor). `plan`: cfg's schedule, where
    the caller has it."""
    backend = get_backend(cfg.backend)
    sharding = backend.sharding(cfg)
    plan = plan or backend.schedule(cfg)
    element = 4 if cfg.model.precision == "fp32" else 2
    state = backend.model_state_bytes(cfg)["total"]
    numels = parameter_numels(cfg)
    blocks = [0] * cfg.model.spec.n_layers
    for name, n in numels.items():
        if name.startswith("blocks."):
            blocks[int(name.split(".")[1])] += n
    largest_block = max(blocks)
    gathered = 0.0
    if sharding == "parameters" and cfg.topology.world_size > 1:
        root = cfg.model.spec.n_params - sum(n for name, n in numels.items() if name.startswith("blocks."))
        # the blocks the stack's schedule keeps whole from forward to backward (FSDP2 without
        # reshard_after_forward; ZeRO-3's within stage3_max_reuse_distance), at its start all at once;
        # else two blocks in flight (the one computed and the one prefetched); the root; one block's full
        # gradient
        kept = sum(blocks[i] for i in plan.kept_blocks)
        in_flight = 0 if len(plan.kept_blocks) == cfg.model.spec.n_layers else 2 * largest_block
        # gathered in the dtype the stack gathers in (FSDP2's param_dtype; fp32 under DeepSpeed's autocast)
        gather = next(t.dtype_bytes for t in plan.terms if t.op == "all_gather")
        gathered = (kept + in_flight + root) * gather + largest_block * 4
    buffers = 0.0
    if sharding == "none" and cfg.topology.world_size > 1:
        buffers = cfg.model.spec.n_params * 4  # DDP/Paddle buckets and TF's pack are a copy of the gradients
    act = activation_bytes(cfg, element)
    activations = factor * (act["blocks"] + act["logits"])
    terms = {
        "model_state": state,
        "gathered_parameters": gathered,
        "comm_buffers": buffers,
        "activations": activations,
    }
    return {**terms, "total": sum(terms.values())}


def compute_durations(cfg: RunConfig, steps: Steps, profile: Profile, calib: Calibration, corner: str):
    """Seconds of every segment at this corner, and how they were obtained."""
    flops = segment_flops(cfg, steps)
    k = CORNERS.index(corner)
    sharding = get_backend(cfg.backend).sharding(cfg)
    if calib.seconds_per_flop:
        seconds = flops * calib.seconds_per_flop[k]
        method = "measured"
    else:
        peak = profile.peak_flops.get(cfg.model.precision)
        if not peak:
            raise ProfileError(
                f"profile {profile.name} has no peak FLOP/s for {cfg.model.precision} "
                "and no calibration run was given"
            )
        seconds = flops / (peak * pick(ASSUMED_MFU, corner))
        method = "assumed MFU"
    params = local_parameters(cfg, sharding)
    if calib.optimizer_seconds_per_param:
        seconds[-1] = params * calib.optimizer_seconds_per_param[k]
    elif calib.seconds_per_flop:  # calibrated without optimizer times: the optimizer is in the FLOP rate
        seconds[-1] = 0.0
    elif hbm := profile.hbm(corner):
        backend = get_backend(cfg.backend)
        scheme = backend.precision_scheme(cfg)
        if cfg.model.precision == "fp32" and scheme != "fp32-master":
            scheme = "fp32"
        per_param = OPTIMIZER_BYTES_PER_PARAM[scheme]
        if backend.optimizer_kernel(cfg) == "foreach":
            per_param += FOREACH_EXTRA_BYTES_PER_PARAM
        seconds[-1] = params * per_param / hbm
    return seconds, method


# The inputs whose ranges make a prediction's band, each taken at its own corner when the band is explained
# (`sensitivity`): which one moves the step most is what a user should pin down first.
INPUTS = ("compute", "bandwidth", "latency", "overlap", "stragglers")
# Beyond the modelled inputs, the empirical margin (harness.predict.margin): nothing at the fast and nominal
# corners, Calibration.empirical_scale_loss per doubling beyond a node at the slow one.
BAND_INPUTS = (*INPUTS, margin.LABEL)


def step_at(cfg: RunConfig, profile: Profile, calib: Calibration, plan: Schedule, at: dict[str, str]) -> dict:
    """One step's timeline with each input at its own corner (`at`: input -> corner)."""
    steps = Steps(cfg)
    messages = plan.messages
    durations, method = compute_durations(cfg, steps, profile, calib, at["compute"])
    world = cfg.topology.world_size

    # A step issues many calls of a few (op, size): each priced once (the explanation reads the pairs)
    pairs: dict[tuple[str, float], tuple[str | None, float]] = {}

    def price(m: Message) -> float:
        key = (m.op, m.size_bytes)
        if key not in pairs:
            pairs[key] = profile.priced(m.op, m.size_bytes, world, at["bandwidth"], at["latency"])
        return pairs[key][1]

    result = replay(durations, messages, price)
    slowdown = pick(profile.overlap_slowdown, at["overlap"], larger_is_faster=False)
    cv = calib.step_cv if calib.step_cv is not None else pick(profile.step_cv, at["stragglers"], False)
    straggler = cv * result["compute_s"] * expected_slowest(world)
    step = result["step_s"] + slowdown * result["overlapped_s"] + straggler
    scale_loss = 0.0
    if at.get(margin.LABEL) == "slow":
        beyond = margin.doublings_beyond_node(world, profile.gpus_per_node)
        scale_loss = step * (1 / margin.factor(calib.empirical_scale_loss, beyond) - 1)
    step += scale_loss
    return {
        "step_s": step,
        "durations": durations,
        "method": method,
        "result": result,
        "slowdown_s": slowdown * result["overlapped_s"],
        "straggler_s": straggler,
        "scale_loss_s": scale_loss,
        "messages": messages,
        "pairs": pairs,
    }


def timeline(cfg: RunConfig, point: dict) -> dict:
    """Where the step's time goes: compute by phase, each term's exposed communication (the collectives on
    the wire while compute stands idle, charged by their share), the overlap's slowdown and the wait for
    the slowest rank; and how NCCL would run each term's calls (its algorithm/protocol on this profile)."""
    steps = Steps(cfg)
    phases: dict[str, float] = {}
    for seg, seconds in zip(steps.list, point["durations"]):
        phases[seg.phase] = phases.get(seg.phase, 0.0) + float(seconds)
    result = point["result"]
    terms: dict[str, dict] = {}
    for i, m in enumerate(point["messages"]):
        entry = terms.setdefault(
            f"{m.op} of {m.what}", {"calls": 0, "bytes": 0.0, "busy_s": 0.0, "exposed_s": 0.0, "nccl": set()}
        )
        entry["calls"] += 1
        entry["bytes"] += m.size_bytes
        entry["busy_s"] += result["busy_by_message"].get(i, 0.0)
        entry["exposed_s"] += result["exposed_by_message"].get(i, 0.0)
        pair = point["pairs"][(m.op, m.size_bytes)][0]
        if pair:
            entry["nccl"].add(pair)
    for entry in terms.values():
        entry["nccl"] = sorted(entry["nccl"])
    waiting = result["step_s"] - result["compute_s"] - sum(t["exposed_s"] for t in terms.values())
    parts = {f"compute: {k}": v for k, v in phases.items()}
    parts |= {f"exposed {k}": t["exposed_s"] for k, t in terms.items() if t["exposed_s"] > 0}
    if waiting > 1e-12:  # compute waited for a call not yet on the wire (a modelled delay)
        parts["exposed: waiting for a delayed call"] = waiting
    parts["overlap slowdown"] = point["slowdown_s"]
    parts["stragglers (slowest of N)"] = point["straggler_s"]
    exposed = {k: v for k, v in parts.items() if not k.startswith("compute")}
    return {
        "step_s": point["step_s"],
        "parts": parts,
        "terms": terms,
        "dominant": max(exposed, key=exposed.__getitem__) if exposed else None,
    }


def sensitivity(cfg: RunConfig, profile: Profile, calib: Calibration, plan: Schedule) -> dict:
    """Each input alone at its fast and slow corners, the others nominal: the step's spread it causes."""
    nominal = dict.fromkeys(INPUTS, "nominal")
    out = {}
    for name in BAND_INPUTS:
        fast = step_at(cfg, profile, calib, plan, {**nominal, name: "fast"})["step_s"]
        slow = step_at(cfg, profile, calib, plan, {**nominal, name: "slow"})["step_s"]
        out[name] = {"fast_step_s": fast, "slow_step_s": slow, "spread_s": slow - fast}
    return {"inputs": out, "dominant": max(out, key=lambda k: out[k]["spread_s"])}


def scaling_ratio(small: RunConfig, large: RunConfig, profile: Profile, calib: Calibration) -> dict:
    """Per-device tokens/s at the larger rank count over the smaller, as a published scaling result states
    it: nominal, and its band over every combination of the inputs' ends (each input fast or slow, the
    same at both N: one cluster, its unknowns unknown alike), which is wider than the corners' (where
    fast compute, which exposes communication, never meets slow communication), its low end less the
    empirical scale loss over the doublings between the two N; the ends' combinations, and each modelled
    input alone at its ends with the others nominal (which one moves the ratio most)."""
    plans = {id(c): get_backend(c.backend).schedule(c) for c in (small, large)}

    def ratio(at: dict[str, str]) -> float:
        per_device = [
            c.tokens_per_step / step_at(c, profile, calib, plans[id(c)], at)["step_s"] / c.topology.world_size
            for c in (small, large)
        ]
        return per_device[1] / per_device[0]

    nominal = dict.fromkeys(INPUTS, "nominal")
    combos = {
        combo: ratio(dict(zip(INPUTS, combo)))
        for combo in itertools.product(("fast", "slow"), repeat=len(INPUTS))
    }
    low, high = min(combos, key=combos.__getitem__), max(combos, key=combos.__getitem__)
    alone = {
        name: sorted((ratio({**nominal, name: "fast"}), ratio({**nominal, name: "slow"}))) for name in INPUTS
    }
    value = ratio(nominal)
    # the empirical margin only lowers the slow end, by a factor apart from every modelled input's
    doublings = margin.doublings_beyond_node(
        large.topology.world_size, profile.gpus_per_node
    ) - margin.doublings_beyond_node(small.topology.world_size, profile.gpus_per_node)
    return {
        "nominal": value,
        "low": min(combos[low], value) * margin.factor(calib.empirical_scale_loss, doublings),
        "doublings_beyond_node": doublings,
        "high": max(combos[high], value),
        "low_at": dict(zip(INPUTS, low)),
        "high_at": dict(zip(INPUTS, high)),
        "alone": alone,
        "dominant": max(alone, key=lambda k: alone[k][1] - alone[k][0]),
    }


def predict_point(
    cfg: RunConfig,
    profile: Profile,
    calib: Calibration,
    tokens: float,
    price: float | None,
    band: bool = False,
):
    """Every figure at every corner for one configuration (world_size ranks), the N=1 reference of the
    same per-rank work for speedup, and the nominal step's timeline; with `band`, which input moves the
    step most (ten replays more)."""
    plan = get_backend(cfg.backend).schedule(cfg)
    messages, how = plan.messages, plan.description
    one = cfg.evolve(world_size=1, nodes=1, gpus_per_node=1)
    spec = cfg.model.spec
    out: dict[str, Any] = {"corners": {}, "schedule": how, "messages_per_step": len(messages)}
    for corner in CORNERS:
        point = step_at(cfg, profile, calib, plan, dict.fromkeys(BAND_INPUTS, corner))
        result, step, straggler = point["result"], point["step_s"], point["straggler_s"]
        single, _ = compute_durations(one, Steps(one), profile, calib, corner)
        t_one = float(np.sum(single))
        tokens_per_step = cfg.tokens_per_step
        throughput = tokens_per_step / step
        one_throughput = one.tokens_per_step / t_one
        per_device = throughput / cfg.topology.world_size
        k = CORNERS.index(corner)
        mem = memory(cfg, calib.activation_factor[k], plan)
        peak = profile.peak_flops.get(cfg.model.precision)
        train_s = tokens / throughput
        out["corners"][corner] = {
            "step_time_s": step,
            "t_compute_s": result["compute_s"],
            "comm_busy_s": result["comm_busy_s"],
            "comm_overlapped_s": result["overlapped_s"],
            "straggler_wait_s": straggler,
            # the empirical scale loss is not communication: it is left out of the exposed share
            "exposed_comm_ratio": max(0.0, (step - point["scale_loss_s"] - result["compute_s"]) / step),
            "throughput_tokens_per_s": throughput,
            "per_device_tokens_per_s": per_device,
            "speedup": throughput / one_throughput,
            "scaling_efficiency": throughput / one_throughput / cfg.topology.world_size,
            "mfu": spec.flops_per_token * per_device / peak if peak else None,
            "memory": mem,
            "train_time_s": train_s,
            "gpu_hours": train_s * cfg.topology.world_size / 3600,
            "cost_usd": train_s * cfg.topology.world_size / 3600 * price if price else None,
            "compute_method": point["method"],
        }
        if corner == "nominal":
            out["timeline"] = timeline(cfg, point)
    if band:
        out["band"] = sensitivity(cfg, profile, calib, plan)
    out["empirical_scale_loss"] = {
        "per_doubling": calib.empirical_scale_loss,
        "doublings_beyond_node": margin.doublings_beyond_node(cfg.topology.world_size, profile.gpus_per_node),
    }
    nominal = out["corners"]["nominal"]["memory"]
    out["fits"] = fits(nominal, out["corners"]["slow"]["memory"], profile)
    out["train_flops"] = 6 * spec.n_params * tokens
    return out


def fits(nominal: dict, slow: dict, profile: Profile) -> dict:
    """Whether a rank's memory fits the device, and which term dominates when it does not."""
    if not profile.memory_bytes:
        return {"verdict": "unknown", "why": f"profile {profile.name} states no device memory"}
    terms = {k: v for k, v in nominal.items() if k != "total"}
    dominant = max(terms, key=terms.__getitem__)
    capacity = profile.memory_bytes
    if nominal["total"] > capacity:
        verdict = "no"
    elif slow["total"] > capacity:
        verdict = "tight"
    else:
        verdict = "yes"
    return {
        "verdict": verdict,
        "capacity_bytes": capacity,
        "dominant": dominant,
        "dominant_bytes": terms[dominant],
        "why": f"{dominant.replace('_', ' ')} dominates ({terms[dominant] / 2**30:.1f} GiB of "
        f"{nominal['total'] / 2**30:.1f} GiB; device {capacity / 2**30:.1f} GiB)",
    }


def calibrate(records: list[dict], cfg: RunConfig, profile: Profile) -> Calibration:
    """Compute from the ok training records of the same stack (label) at one rank on the profile's device
    (same device name, or CPU for the local profile) and precision: the step time less the optimizer time,
    per FLOP of forward+backward, and the optimizer time per parameter. Records that do not match are named
    in the notes, never used. The slow end carries the empirical scale-loss margin of the published rows."""
    calib = Calibration(empirical_scale_loss=margin.per_doubling())
    if profile.device == "cuda":
        fit_activation_factor(records, calib)
    label = get_backend(cfg.backend).label(cfg)
    candidates = []
    for r in records:
        rc = run_config(r)
        why = None
        if r["status"] != "ok":
            why = f"status {r['status']}"
        elif (r.get("backend_info") or {}).get("label") != label:
            why = f"{(r.get('backend_info') or {}).get('label')}, not {label}"
        elif rc.topology.world_size != 1:
            why = f"{rc.topology.world_size} ranks (compute calibrates from a 1-rank run)"
        elif rc.model.precision != cfg.model.precision:
            why = f"precision {rc.model.precision}"
        elif profile.device == "cpu" and rc.topology.device != "cpu":
            why = "not a CPU run"
        elif profile.device == "cpu" and rc.topology.threads_per_worker != cfg.topology.threads_per_worker:
            why = (
                f"{rc.topology.threads_per_worker} threads per worker, not {cfg.topology.threads_per_worker}"
            )
        elif profile.device == "cuda" and (r["ranks"][0].get("device") != profile.device_name):
            why = f"device {r['ranks'][0].get('device')} is not {profile.device_name}"
        if why:
            calib.notes.append(f"{r['run_id']}: not used ({why})")
        else:
            candidates.append(r)
    if not candidates:
        return calib
    # One shape: seconds per FLOP differ between model sizes, so runs of other shapes are not mixed in (the
    # newest run's shape is taken; the prediction scales it by FLOPs to the shape asked for).
    newest = max(candidates, key=lambda r: (r.get("environment") or {}).get("start_time") or "")

    def shape(record: dict) -> tuple:
        model = run_config(record).model
        return model.spec, model.activation_checkpointing

    for r in candidates:
        if shape(r) != shape(newest):
            calib.notes.append(f"{r['run_id']}: not used (another shape than {newest['run_id']})")
    candidates = [r for r in candidates if shape(r) == shape(newest)]
    # Repeats (separate launches) of the same run: the median of their median steps, the band from the
    # lowest p10 to the highest p90, as launches on a shared machine differ by more than steps within one.
    flops, nominal, fast, slow, optimizer, cvs = 0.0, [], [], [], [], []
    for record in candidates:
        rc = run_config(record)
        summary = summarize(record)
        opt = [
            t for r in record["ranks"] if r.get("status") == "ok" for t in r.get("optimizer_step_times") or []
        ]
        t_opt = float(np.median(opt)) if opt else 0.0
        flops = float(np.sum(segment_flops(rc, Steps(rc))))
        step = summary["step_time_s"]
        nominal.append((step["median"] - t_opt) / flops)
        cvs.append((step["p90"] - step["p10"]) / NORMAL_P10_P90 / step["median"])
        fast.append((step["p10"] - t_opt) / flops)
        slow.append((step["p90"] - t_opt) / flops)
        if opt:
            optimizer.append(t_opt / rc.model.spec.n_params)
        else:
            calib.notes.append(
                f"{record['run_id']}: no optimizer times recorded; the optimizer scales with FLOPs"
            )
        calib.sources.append(
            {
                "run_id": record["run_id"],
                "backend": get_backend(rc.backend).label(rc),
                "step_time_s": step["median"],
                "optimizer_s": t_opt,
                "threads_per_worker": rc.topology.threads_per_worker,
            }
        )
    calib.seconds_per_flop = (min(fast), float(np.median(nominal)), max(slow))
    calib.step_cv = float(np.median(cvs))
    if len(optimizer) == len(candidates):
        calib.optimizer_seconds_per_param = (float(np.median(optimizer)),) * 3
    elif optimizer:  # some runs timed it, some did not: count it within the FLOP rate for all of them
        calib.notes.append("optimizer times in some calibration runs only: counted within the FLOP rate")
        return calibrate([r for r in records if not has_optimizer_times(r)], cfg, profile)
    return calib


def fit_activation_factor(records: list[dict], calib: Calibration) -> None:
    """The one activation factor, fitted to measured GPU peaks: for each ok GPU training record with an
    allocator peak (any stack, any N), (peak - every modelled term but activations) / modelled
    activations; their median, with the smallest and largest as the band. The allocator's peak is the
    only fair measure (a CPU's RSS holds the framework runtime)."""
    ratios = []
    for r in records:
        if r.get("status") != "ok" or run_config(r).topology.device != "cuda":
            continue
        peak = summarize(r)["peak_allocated_bytes"]
        if not peak:
            continue
        rc = run_config(r)
        modelled = memory(rc, 1.0)
        if modelled["activations"] > 0:
            ratios.append((peak - (modelled["total"] - modelled["activations"])) / modelled["activations"])
            calib.sources.append({"run_id": r["run_id"], "activation_factor": ratios[-1]})
    if ratios:
        calib.activation_factor = (min(ratios), float(np.median(ratios)), max(ratios))
        calib.notes.append(f"activation factor fitted to {len(ratios)} measured allocator peak(s)")


def has_optimizer_times(record: dict) -> bool:
    return any(r.get("optimizer_step_times") for r in record.get("ranks", []) if r.get("status") == "ok")
