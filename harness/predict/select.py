"""`harness select`: which stack and settings for this model on that cluster, ranked, with the odds that each
of the first few is really the fastest.

Every registered stack x the sharding settings its Options declare (an integer field with choices: ZeRO's
stage, Paddle's sharding stage) x activation checkpointing x precision x variant x N. At the fixed global
batch each of these takes the largest micro-batch whose memory fits (accumulation makes up the rest), and
the predictor (harness.predict.model) prices it. Stack knowledge stays in backends/: nothing here names one.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from backends import backend_names, get_backend
from core.config import PRECISIONS, InvalidConfig, RunConfig
from core.records import SCHEMA_VERSION, git_commit, now_iso, write_record_atomic
from harness.analyze.summary import fmt_bytes
from harness.predict.command import duration, shape_title, tokens_count, usd
from harness.predict.hardware import CORNERS, ProfileError, catalogue, load_profile
from harness.predict.model import INPUTS, Calibration, memory, predict_point, step_at
from harness.run_args import spec_from_args
from harness.usage import EXIT_OK, UsageError, positive
from workloads.spec import OVERRIDES, PRESETS

EXIT_NOTHING = 1  # nothing meets the constraints: an answer, not an error
# What the caching allocator and the framework's runtime take beyond the modelled terms: a fraction of the
# device kept free (fragmentation, the CUDA context, NCCL's own buffers, cuBLAS workspaces).
ALLOCATOR_MARGIN = 0.10
MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)  # tried largest first: the largest that fits is taken
VARIANTS = ("default", "tuned")
DEFAULT_GLOBAL_BATCH = 512
ODDS_TOP = 5
ODDS_SAMPLES = 400
SEED = 0


def gpu_range(text: str) -> list[int]:
    """8,16,32 or 8-256 (the powers of two from 8 to 256)."""
    try:
        if "-" in text:
            low, high = (int(v) for v in text.split("-", 1))
            if low < 1 or high < low:
                raise ValueError
            values = [low]
            while values[-1] * 2 <= high:
                values.append(values[-1] * 2)
        else:
            values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected rank counts such as 8,16,32 or 8-256, got '{text}'"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive rank counts, got '{text}'")
    return sorted(set(values))


def hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected hours such as 48, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected positive hours, got '{text}'")
    return value


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


def peak_memory(cfg: RunConfig, factor: float = 1.0, plan=None) -> dict:
    """Bytes per rank: the predictor's terms (model state as the stack holds it, gathered parameters and
    prefetch, communication buffers, activations) and the attention a stack materialises where its
    settings say so (backend.settings()["attention"]: TF's (B,H,T,T) logits)."""
    backend = get_backend(cfg.backend)
    terms = memory(cfg, factor, plan)
    terms.pop("total")
    attention = (backend.settings(cfg) or {}).get("attention") or {}
    terms["materialised_attention"] = float(attention.get("bytes_held_for_backward", 0))
    return {**terms, "total": sum(terms.values())}


def fit_check(terms: dict, capacity: float | None, margin: float = ALLOCATOR_MARGIN) -> str | None:
    """None when the terms fit the device less the allocator margin; else why not, naming the term that
    broke it (the one whose addition, in order, first passes the usable memory)."""
    if not capacity:
        return None
    usable = capacity * (1 - margin)
    running = 0.0
    for name, value in terms.items():
        if name == "total":
            continue
        running += value
        if running > usable:
            return (
                f"{name.replace('_', ' ')} ({fmt_bytes(value)}) breaks it: "
                f"{fmt_bytes(terms['total'])} a rank > {fmt_bytes(usable)} usable "
                f"({fmt_bytes(capacity)} less {margin:.0%} allocator margin)"
            )
    return None


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


def base_configs(args, profile, spec, precisions, stacks) -> list[RunConfig]:
    """Every stack x sharding setting x checkpointing x precision x variant x N at micro-batch 1 (the
    micro-batch is chosen per candidate)."""
    out = []
    for name in stacks:
        backend = get_backend(name)
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
            )
            if variant == "tuned":
                tuned = {k: s.value for k, s in backend.tuned(cfg).items()}
                if not tuned:
                    continue  # the same as default
                cfg = cfg.evolve(
                    backend_options=backend.Options(**{**tuned, **setting}).to_dict(), variant="tuned"
                )
            out.append(cfg)
    return out


def search(base: list[RunConfig], profile, calib: Calibration, tokens: float, price) -> list[Candidate]:
    """Each base configuration at the largest micro-batch that divides its share of the global batch and
    fits; priced by the predictor. One that fits at no micro-batch, or that its adapter refuses, is dropped
    with the reason."""
    out = []
    for cfg in base:
        backend = get_backend(cfg.backend)
        share = cfg.batch.grad_accum  # sequences per rank per step
        label = backend.label(cfg)
        try:
            backend.validate(cfg.evolve(hosts=[f"node{i}" for i in range(cfg.topology.nodes)]))
        except InvalidConfig as exc:
            out.append(Candidate(cfg, label, {}, dropped=f"not runnable: {exc}", lacks=["runnable"]))
            continue
        chosen: RunConfig | None = None
        why: str | None = None
        terms: dict = {}
        for micro in MICRO_BATCHES:
            if share % micro:
                continue
            trial = cfg.evolve(micro_batch=micro, grad_accum=share // micro)
            terms = peak_memory(trial)
            why = fit_check(terms, profile.memory_bytes)
            if why is None:
                chosen = trial
                break
        if chosen is None:
            out.append(
                Candidate(
                    cfg, label, terms, dropped=f"does not fit at micro-batch 1: {why}", lacks=["memory"]
                )
            )
            continue
        try:
            prediction = predict_point(chosen, profile, calib, tokens, price)
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


def odds(cands: list[Candidate], profile, calib: Calibration, samples: int = ODDS_SAMPLES, seed: int = SEED):
    """The probability each candidate is the fastest: the predictor's uncertain inputs (INPUTS: compute,
    bandwidth, latency, overlap, stragglers) each drawn at one of its corners, uniformly, the same draw
    for every candidate (one cluster: what is slow is slow for all); a tie shares the win equally."""
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(CORNERS), size=(samples, len(INPUTS)))
    plans = [get_backend(c.cfg.backend).schedule(c.cfg) for c in cands]
    cache: dict[tuple[int, tuple], float] = {}
    times = np.empty((samples, len(cands)))
    for s, draw in enumerate(draws):
        key = tuple(int(v) for v in draw)
        at = {name: CORNERS[k] for name, k in zip(INPUTS, key)}
        for j, c in enumerate(cands):
            if (j, key) not in cache:
                step = step_at(c.cfg, profile, calib, plans[j], at)["step_s"]
                cache[(j, key)] = step / c.cfg.tokens_per_step  # seconds a token
            times[s, j] = cache[(j, key)]
    best = times.min(axis=1, keepdims=True)
    winners = np.isclose(times, best, rtol=1e-12, atol=0)
    return (winners / winners.sum(axis=1, keepdims=True)).mean(axis=0)


def row(c: Candidate, capacity) -> dict:
    assert c.prediction is not None
    corners = c.prediction["corners"]
    nominal = corners["nominal"]
    times = [corners[k]["train_time_s"] for k in CORNERS]
    return {
        "label": c.label,
        "backend": c.cfg.backend,
        "variant": c.cfg.variant,
        "backend_options": c.cfg.backend_options,
        "precision": c.cfg.model.precision,
        "activation_checkpointing": c.cfg.model.activation_checkpointing,
        "gpus": c.cfg.topology.world_size,
        "nodes": c.cfg.topology.nodes,
        "micro_batch": c.cfg.batch.micro_batch,
        "grad_accum": c.cfg.batch.grad_accum,
        "train_time_s": {"nominal": times[1], "low": min(times), "high": max(times)},
        "cost_usd": nominal["cost_usd"],
        "gpu_hours": nominal["gpu_hours"],
        "mfu": nominal["mfu"],
        "memory": c.memory,
        "headroom_bytes": (capacity * (1 - ALLOCATOR_MARGIN) - c.memory["total"]) if capacity else None,
    }


def print_answer(rows, front, excluded, header, top, stream=None) -> None:
    console = Console(file=stream or sys.stdout, width=220)
    table = Table(title=header, title_justify="left")
    for col in (
        "#",
        "stack",
        "settings",
        "N",
        "micro x accum",
        "ckpt",
        "time to train (band)",
        "cost USD",
        "headroom/rank",
        "MFU %",
        "P(fastest)",
        "Pareto",
    ):
        table.add_column(col, justify="right" if col not in ("stack", "settings") else "left")
    for i, r in enumerate(rows[:top]):
        t = r["train_time_s"]
        table.add_row(
            str(i + 1),
            r["label"],
            ",".join(f"{k}={v}" for k, v in r["setting"].items()) or "-",
            str(r["gpus"]),
            f"{r['micro_batch']} x {r['grad_accum']}",
            "on" if r["activation_checkpointing"] else "off",
            f"{duration(t['nominal'])} ({duration(t['low'])}–{duration(t['high'])})",
            f"{r['cost_usd']:,.0f}" if r["cost_usd"] is not None else "-",
            fmt_bytes(r["headroom_bytes"]) if r["headroom_bytes"] is not None else "-",
            f"{100 * r['mfu']:.1f}" if r["mfu"] else "-",
            f"{100 * r['p_fastest']:.0f}%" if r.get("p_fastest") is not None else "",
            "*" if r["pareto"] else "",
        )
    console.print(table)
    console.print(
        "Pareto front (time vs cost): "
        + "; ".join(f"{r['label']} N={r['gpus']} {duration(r['train_time_s']['nominal'])}" for r in front)
    )
    console.print(f"excluded {len(excluded)}" + (":" if excluded else ""))
    for e in excluded:
        console.print(f"  {e['label']} N={e['gpus']}: {e['why']}")


def profile_from(args):
    try:
        return load_profile(args.hardware)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None


def cmd_select(args) -> int:
    started = time.perf_counter()
    profile = profile_from(args)
    spec = spec_from_args(args)
    stacks = args.stacks.split(",") if args.stacks else backend_names()
    for s in stacks:
        if s not in backend_names():
            raise UsageError(f"--stacks: unknown stack '{s}'; valid: {', '.join(backend_names())}")
    precisions = (
        args.precision.split(",") if args.precision else ["bf16" if profile.device == "cuda" else "fp32"]
    )
    for p in precisions:
        if p not in PRECISIONS:
            raise UsageError(f"--precision: unknown precision '{p}'; valid: {', '.join(PRECISIONS)}")
    if args.budget is not None and args.gpu_hour_price is None:
        raise UsageError("--budget needs --gpu-hour-price (the cost is GPU-hours x price)")
    args.global_batch = args.global_batch or DEFAULT_GLOBAL_BATCH
    tokens = args.tokens or 20 * spec.n_params
    calib = Calibration()
    base = base_configs(args, profile, spec, precisions, stacks)
    if not base:
        raise UsageError(f"--global-batch {args.global_batch} divides over none of --gpus with whole nodes")
    cands = search(base, profile, calib, tokens, args.gpu_hour_price)
    constrain(cands, args.deadline, args.budget)
    kept = sorted([c for c in cands if not c.dropped], key=lambda c: c.train_s)
    excluded = [
        {"label": c.label, "gpus": c.cfg.topology.world_size, "why": c.dropped, "lacks": c.lacks}
        for c in cands
        if c.dropped
    ]
    header = (
        f"SELECTED (predicted, not measured): {shape_title(base[0].model.workload, spec)}, "
        f"on {profile.name}, "
        f"{tokens:.3g} tokens, global batch {args.global_batch}; {len(cands)} candidates, {len(kept)} meet "
        "every constraint"
    )
    if not kept:
        closest = (
            sorted([c for c in cands if c.prediction], key=lambda c: c.train_s)[:5]
            or sorted(cands, key=lambda c: c.memory.get("total", math.inf))[:5]
        )
        print(f"{header}\nnothing meets the constraints; the closest:")
        for c in closest:
            print(f"  {c.label} N={c.cfg.topology.world_size}: lacks {', '.join(c.lacks)} ({c.dropped})")
        return EXIT_NOTHING
    front = pareto(kept)
    top = kept[:ODDS_TOP]
    p = odds(top, profile, calib)
    rows = []
    for i, c in enumerate(kept):
        r = row(c, profile.memory_bytes)
        r["setting"] = {k: c.cfg.backend_options[k] for k in sharding_settings(get_backend(c.cfg.backend))[0]}
        r["pareto"] = c in front
        r["p_fastest"] = float(p[i]) if i < len(top) else None
        rows.append(r)
    print_answer(rows, [rows[kept.index(c)] for c in front], excluded, header, args.top)
    elapsed = time.perf_counter() - started
    print(f"selected among {len(cands)} candidates in {elapsed:.1f} s")
    if args.out:
        record = {
            "schema_version": SCHEMA_VERSION,
            "kind": "selection",
            "run_id": f"select-{profile.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
            "status": "ok",
            "inputs": {
                "argv": list(args.argv),
                "workload": base[0].model.workload,
                "tokens": tokens,
                "global_batch": args.global_batch,
                "deadline_h": args.deadline,
                "budget_usd": args.budget,
                "gpu_hour_price_usd": args.gpu_hour_price,
                "allocator_margin": ALLOCATOR_MARGIN,
                "odds": {"samples": ODDS_SAMPLES, "seed": SEED, "inputs": list(INPUTS)},
                "hardware": profile.to_dict(),
            },
            "ranked": rows,
            "pareto": [kept.index(c) for c in front],
            "excluded": excluded,
            "environment": {"start_time": now_iso(), "git": git_commit(), "elapsed_s": elapsed},
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"{record['run_id']}.json"
        write_record_atomic(path, record)
        print(f"record: {path}")
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("select", help="rank stacks and settings for a model on a cluster, with odds")
    p.add_argument("--workload", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    for flag in OVERRIDES:
        p.add_argument(
            "--" + flag.replace("_", "-"), dest=flag, type=positive, help=f"override {OVERRIDES[flag]}"
        )
    p.add_argument("--hardware", required=True, help=f"{', '.join(catalogue())} or a profile .yaml")
    p.add_argument("--gpus", type=gpu_range, required=True, help="rank counts: 8,16,32 or 8-256")
    p.add_argument("--tokens", type=tokens_count, help="tokens to train on (default 20 x parameters)")
    p.add_argument("--deadline", type=hours, help="hours the training may take")
    p.add_argument("--budget", type=usd, help="USD the training may cost (needs --gpu-hour-price)")
    p.add_argument("--gpu-hour-price", type=usd, help="USD per GPU-hour")
    p.add_argument("--global-batch", type=positive, help=f"sequences a step (default {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--precision", help=f"comma-separated, of {', '.join(PRECISIONS)} (default bf16 on a GPU)")
    p.add_argument("--stacks", help=f"comma-separated, of {', '.join(backend_names())} (default all)")
    p.add_argument("--top", type=positive, default=15, help="rows of the table shown (default 15)")
    p.add_argument("--out", type=Path, help="write the selection record into this folder")
    p.set_defaults(func=cmd_select)
