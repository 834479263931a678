"""The candidates of `harness select`, priced, constrained and weighed: every registered stack x the sharding
settings its Options declare (an integer field with choices: ZeRO's stage, Paddle's sharding stage) x
activation checkpointing x precision x variant x N. At the fixed global batch each of these takes the largest
micro-batch whose memory fits (accumulation makes up the rest), and the predictor (harness.predict.model)
prices it; the deadline and budget drop what misses them; the Pareto front and the odds of being the fastest
weigh the rest. Stack knowledge stays in backends/: nothing here names one. Nothing here runs anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from backends import get_backend
from core.config import InvalidConfig, RunConfig
from core.process import available_cpus
from core.records import run_config
from harness.predict.calibration import Calibration, calibrate
from harness.predict.command import duration
from harness.predict.hardware import CORNERS, Profile, ProfileError, load_profile, local_profile
from harness.predict.memory import largest_fitting
from harness.predict.model import BAND_INPUTS, predict_point, step_at
from harness.usage import UsageError
from workloads.spec import PRESETS

VARIANTS = ("default", "tuned")
ODDS_TOP = 5  # the first this many candidates are given odds
ODDS_SAMPLES = 400
SEED = 0


def sharding_settings(backend) -> list[dict]:
    """The sharding settings a stack's Options declare: every integer field with choices (ZeRO's stage,
    Paddle's sharding stage), each value; a stack with none has one setting, its defaults."""
    fields = [
        f
        for f in dataclasses.fields(backend.Options)
        if f.metadata.get("choices") and all(isinstance(c, int) for c in f.metadata["choices"])
    ]
    if not fields:
        return [{}]
    return [
        dict(zip([f.name for f in fields], values))
        for values in itertools.product(*[f.metadata["choices"] for f in fields])
    ]


@dataclass
class Candidate:
    cfg: RunConfig
    label: str
    memory: dict
    prediction: dict | None = None
    dropped: str | None = None
    lacks: list = field(default_factory=list)

    @property
    def train_s(self) -> float:
        return self.prediction["corners"]["nominal"]["train_time_s"] if self.prediction else math.inf


class Pricing:
    """What prices a candidate: the hardware profile and the compute calibration. A catalogue profile is one
    for every stack; the local profile is one per stack, from that stack's commbench records in
    --calibrate (each stack's collectives are its own). Compute calibrates from --calibrate's 1-rank
    training runs of the candidate's stack label and precision (harness.predict.calibration.calibrate);
    the local profile knows no peak FLOP/s, so there a stack without such a run cannot be priced."""

    def __init__(self, hardware: str | Profile, records: list[dict] | None = None):
        """`hardware`: "local", a catalogue name or profile file, or a profile already loaded."""
        records = records or []
        self.hardware = hardware.name if isinstance(hardware, Profile) else hardware
        self.training = [r for r in records if r["kind"] == "training"]
        self.commbench = [r for r in records if r["kind"] == "commbench"]
        self.catalogued: Profile | None = (
            hardware
            if isinstance(hardware, Profile)
            else None
            if hardware == "local"
            else profile_from(hardware)
        )
        self.profiles: dict[str, Profile] = {}
        self.calibrations: dict[tuple, Calibration] = {}

    def profile(self, backend: str) -> Profile:
        """ProfileError where the local profile has no commbench record of the stack."""
        if self.catalogued is not None:
            return self.catalogued
        if backend not in self.profiles:
            self.profiles[backend] = local_profile(self.commbench, backend, available_cpus())
        return self.profiles[backend]

    def calibration(self, cfg: RunConfig) -> Calibration:
        key = (get_backend(cfg.backend).label(cfg), cfg.model.precision, cfg.topology.threads_per_worker)
        if key not in self.calibrations:
            self.calibrations[key] = calibrate(self.training, cfg, self.profile(cfg.backend))
        return self.calibrations[key]

    def calibrated(self, cfg: RunConfig) -> bool:
        return self.calibration(cfg).seconds_per_flop is not None

    @property
    def device(self) -> str:
        if self.catalogued is not None:
            return self.catalogued.device
        return "cuda" if any(run_config(r).topology.device == "cuda" for r in self.commbench) else "cpu"


def profile_from(hardware: str) -> Profile:
    try:
        return load_profile(hardware)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None


def base_configs(args, pricing: Pricing, spec, precisions, stacks) -> tuple[list[RunConfig], list[Candidate]]:
    """Every stack x sharding setting x checkpointing x precision x variant x N at micro-batch 1 (the
    micro-batch is chosen per candidate); and, dropped with the reason, the stacks the profile cannot price
    (the local profile without the stack's commbench record)."""
    out: list[RunConfig] = []
    unpriced: list[Candidate] = []
    for name in stacks:
        backend = get_backend(name)
        try:
            profile = pricing.profile(name)
        except ProfileError as exc:
            cfg = RunConfig.build(backend=name, workload="custom", spec=spec, world_size=max(args.gpus))
            unpriced.append(
                Candidate(cfg, backend.label(cfg), {}, dropped=f"not priced: {exc}", lacks=["profile"])
            )
            continue
        for setting, ckpt, precision, variant, n in itertools.product(
            sharding_settings(backend), (False, True), precisions, VARIANTS, args.gpus
        ):
            per_node = min(n, profile.gpus_per_node)
            if n % per_node or args.global_batch % n:
                continue
            cfg = RunConfig.build(
                backend=name,
                workload=args.workload if spec == PRESETS[args.workload] else "custom",
                spec=spec,
                world_size=n,
                device=profile.device,
                precision=precision,
                micro_batch=1,
                grad_accum=args.global_batch // n,
                activation_checkpointing=ckpt,
                scaling="strong",
                nodes=math.ceil(n / per_node),
                gpus_per_node=per_node,
                backend_options=backend.Options(**setting).to_dict(),
                threads_per_worker=args.threads_per_worker,
            )
            if variant == "tuned":
                tuned = {k: s.value for k, s in backend.tuned(cfg).items()}
                if not tuned:
                    continue  # the same as default
                cfg = cfg.evolve(
                    backend_options=backend.Options(**{**tuned, **setting}).to_dict(), variant="tuned"
                )
            out.append(cfg)
    return out, unpriced


def search(base: list[RunConfig], pricing: Pricing, tokens: float, price) -> list[Candidate]:
    """Each base configuration at the largest micro-batch that divides its share of the global batch and
    fits; priced by the predictor. One that fits at no micro-batch, that its adapter refuses, or whose
    compute no calibration prices, is dropped with the reason."""
    out = []
    for cfg in base:
        backend = get_backend(cfg.backend)
        profile = pricing.profile(cfg.backend)
        share = cfg.batch.grad_accum  # sequences per rank per step
        label = backend.label(cfg)
        try:
            backend.validate(cfg.evolve(hosts=[f"node{i}" for i in range(cfg.topology.nodes)]))
        except InvalidConfig as exc:
            out.append(Candidate(cfg, label, {}, dropped=f"not runnable: {exc}", lacks=["runnable"]))
            continue
        chosen, terms, why = largest_fitting(cfg, share, profile.memory_bytes)
        if chosen is None:
            out.append(
                Candidate(
                    cfg, label, terms, dropped=f"does not fit at micro-batch 1: {why}", lacks=["memory"]
                )
            )
            continue
        if profile.device == "cpu" and not pricing.calibrated(chosen):
            unused = len(pricing.calibration(chosen).notes)
            why = f"no 1-rank {chosen.model.precision} training record of {label} in --calibrate" + (
                f" ({unused} record(s) of other stacks, precisions, rank counts or threads)" if unused else ""
            )
            out.append(
                Candidate(chosen, label, terms, dropped=f"not calibrated: {why}", lacks=["calibration"])
            )
            continue
        try:
            prediction = predict_point(chosen, profile, pricing.calibration(chosen), tokens, price)
        except ProfileError as exc:
            raise UsageError(str(exc)) from None
        out.append(Candidate(chosen, label, terms, prediction))
    return out


def constrain(cands: list[Candidate], deadline_h: float | None, budget: float | None) -> None:
    for c in cands:
        if c.dropped:
            continue
        assert c.prediction is not None
        nominal = c.prediction["corners"]["nominal"]
        if deadline_h and nominal["train_time_s"] > deadline_h * 3600:
            c.lacks.append("deadline")
            c.dropped = f"misses the deadline: {duration(nominal['train_time_s'])} > {deadline_h:g} h"
        if budget is not None and nominal["cost_usd"] is not None and nominal["cost_usd"] > budget:
            c.lacks.append("budget")
            c.dropped = (c.dropped + "; " if c.dropped else "") + (
                f"over budget: {nominal['cost_usd']:,.0f} USD > {budget:,.0f}"
            )


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """Those no other is both faster and cheaper than (GPU-hours where no price is given)."""

    def cost(c):
        n = c.prediction["corners"]["nominal"]
        return n["cost_usd"] if n["cost_usd"] is not None else n["gpu_hours"]

    return [
        c
        for c in cands
        if not any(
            o is not c
            and o.train_s <= c.train_s
            and cost(o) <= cost(c)
            and (o.train_s, cost(o)) != (c.train_s, cost(c))
            for o in cands
        )
    ]


def compute_source(c: Candidate, pricing: Pricing) -> str:
    """Whose compute uncertainty a candidate shares: a calibrated stack's is its own runs' (its label), an
    uncalibrated one's is its framework's kernels at an assumed MFU (torch-ddp and torch-fsdp share it)."""
    if pricing.calibrated(c.cfg):
        return f"label:{c.label}"
    return f"framework:{get_backend(c.cfg.backend).framework}"


def odds(cands: list[Candidate], pricing: Pricing, samples: int = ODDS_SAMPLES, seed: int = SEED):
    """The probability each candidate is the fastest: the predictor's uncertain inputs (BAND_INPUTS) each
    drawn at one of its corners, uniformly. The cluster's (bandwidth, latency, overlap, stragglers, the
    empirical scale loss) are one draw for every candidate: what is slow on a cluster is slow for all. Compute
    is drawn once per source (compute_source): two stacks' calibration runs, or two frameworks' kernels, err
    apart, so two candidates whose compute bands overlap are not ranked as if they were apart. A tie shares
    the win equally."""
    rng = np.random.default_rng(seed)
    cluster = [name for name in BAND_INPUTS if name != "compute"]
    sources = [compute_source(c, pricing) for c in cands]
    shared = rng.integers(0, len(CORNERS), size=(samples, len(cluster)))
    compute = {src: rng.integers(0, len(CORNERS), size=samples) for src in sorted(set(sources))}
    plans = [get_backend(c.cfg.backend).schedule(c.cfg) for c in cands]
    cache: dict[tuple[int, tuple], float] = {}
    times = np.empty((samples, len(cands)))
    for s in range(samples):
        for j, c in enumerate(cands):
            key = (int(compute[sources[j]][s]), *(int(v) for v in shared[s]))
            if (j, key) not in cache:
                at = {"compute": CORNERS[key[0]], **{name: CORNERS[k] for name, k in zip(cluster, key[1:])}}
                profile, calib = pricing.profile(c.cfg.backend), pricing.calibration(c.cfg)
                step = step_at(c.cfg, profile, calib, plans[j], at)["step_s"]
                cache[(j, key)] = step / c.cfg.tokens_per_step  # seconds a token
            times[s, j] = cache[(j, key)]
    best = times.min(axis=1, keepdims=True)
    winners = np.isclose(times, best, rtol=1e-12, atol=0)
    return (winners / winners.sum(axis=1, keepdims=True)).mean(axis=0)
