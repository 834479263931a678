"""The step model: the prediction of one configuration at one rank count. Compute segments priced by
calibration or an assumed MFU, the stack's collectives priced by the hardware profile and replayed against
them (replay.py), stragglers and the empirical margin, memory per rank (memory.py), and what training on T
tokens takes; the band's inputs one at a time, and a published scaling ratio.

Every figure is evaluated at three corners of its inputs (hardware.CORNERS: the fast ends of every range,
the nominal values, the slow ends); a figure's band is its value at the fast and slow corners.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from scipy.stats import norm

from backends import get_backend
from backends.schedule import Message, Schedule, Steps
from core.config import RunConfig
from harness.predict import margin
from harness.predict.calibration import Calibration, segment_flops
from harness.predict.hardware import CORNERS, Profile, ProfileError, pick
from harness.predict.memory import fits, memory
from harness.predict.replay import replay

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


def expected_slowest(world: int) -> float:
    """E[max of `world` standard normals] (Blom's approximation; 0.56 at 2, 3.0 at 512): ranks that meet
    in a collective every step wait for the slowest, so a step is the mean compute plus this many σ of a
    rank's step-to-step variation (the bias harness.analyze.metrics.rank_median_max avoids when measuring
    compute, and which a synchronised step really pays)."""
    return float(norm.ppf((world - 0.375) / (world + 0.25))) if world > 1 else 0.0


def local_parameters(cfg: RunConfig, sharding: str) -> float:
    """Parameters whose optimizer step one rank runs: 1/N of them once the optimizer state is sharded."""
    return cfg.model.spec.n_params / (cfg.topology.world_size if sharding != "none" else 1)


def compute_durations(cfg: RunConfig, steps: Steps, profile: Profile, calib: Calibration, corner: str):
    """Seconds of every segment at this corner, and how they were obtained. Calibrated, a step of
    accumulation a is a × (fixed per micro-batch + per FLOP × a micro-batch's FLOPs) over its forward and
    backward segments, and the optimizer plus the fixed cost per step in the last (calibration.split_step)."""
    flops = segment_flops(cfg, steps)
    k = CORNERS.index(corner)
    sharding = get_backend(cfg.backend).sharding(cfg)
    if calib.seconds_per_flop:
        seconds = flops * calib.seconds_per_flop[k]
        if calib.fixed_per_micro_batch_s:
            # each micro-batch's fixed cost spread over its forward and backward segments by their FLOPs
            passes = np.array([s.phase != "optimizer" for s in steps.list])
            per_micro = flops[passes].sum() / cfg.batch.grad_accum
            seconds[passes] += calib.fixed_per_micro_batch_s[k] * flops[passes] / per_micro
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
    if calib.seconds_per_flop and calib.fixed_per_step_s:
        # what the step costs once whatever its size beyond the optimizer (the anatomy's "other"), priced
        # at its end with the optimizer: not 1/N where the optimizer is sharded
        seconds[-1] += calib.fixed_per_step_s[k]
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
    # how the compute was calibrated: which fit, from which runs (calibration.split_step)
    out["calibration_fit"] = calib.fit
    return out
