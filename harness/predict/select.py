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
import subprocess
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
from core.process import available_cpus
from core.records import (
    SCHEMA_VERSION,
    git_commit,
    load_record,
    load_records,
    now_iso,
    run_config,
    write_atomic,
    write_record_atomic,
)
from harness import document as doc
from harness.analyze.metrics import summarize
from harness.analyze.summary import fmt_bytes
from harness.predict.calibration import Calibration, calibrate
from harness.predict.command import duration, shape_title, tokens_count, usd
from harness.predict.hardware import CORNERS, Profile, ProfileError, catalogue, load_profile, local_profile
from harness.predict.memory import ALLOCATOR_MARGIN, largest_fitting
from harness.predict.model import BAND_INPUTS, predict_point, step_at
from harness.run_args import spec_from_args
from harness.usage import EXIT_OK, UsageError, positive
from workloads.spec import OVERRIDES, PRESETS

EXIT_NOTHING = 1  # nothing meets the constraints: an answer, not an error
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
        "step_time_s": {
            "nominal": corners["nominal"]["step_time_s"],
            "low": min(corners[k]["step_time_s"] for k in CORNERS),
            "high": max(corners[k]["step_time_s"] for k in CORNERS),
        },
        "cost_usd": nominal["cost_usd"],
        "gpu_hours": nominal["gpu_hours"],
        "mfu": nominal["mfu"],
        "memory": c.memory,
        "headroom_bytes": (capacity * (1 - ALLOCATOR_MARGIN) - c.memory["total"]) if capacity else None,
    }


def ranked_table(rows: list[dict], top: int) -> doc.Table:
    """The first `top` ranked candidates, one row each: what the terminal and the documents show."""
    headers = ["#", "stack", "settings", "N", "micro x accum", "ckpt", "time to train (band)", "cost USD"]
    headers += ["headroom/rank", "MFU %", "P(fastest)", "Pareto"]
    cells = []
    for i, r in enumerate(rows[:top]):
        t = r["train_time_s"]
        cells.append(
            [
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
            ]
        )
    return doc.Table(headers, cells)


def confirmed_table(confirmed: list[dict]) -> doc.Table:
    """Predicted against measured, one row a confirmed candidate."""
    headers = ["#", "stack", "N", "predicted step (band)", "measured step", "error", "in band", "measured #"]
    return doc.Table(
        headers,
        [
            [
                str(i),
                c["label"],
                str(c["gpus"]),
                band_ms(c["predicted_step_s"]),
                f"{c['measured_step_s'] * 1e3:,.1f} ms" if c["measured_step_s"] else c["status"],
                f"{c['error']:+.0%}" if c["error"] is not None else "-",
                {True: "yes", False: "MISSED", None: "-"}[c["in_band"]],
                str(c["measured_rank"] or "-"),
            ]
            for i, c in enumerate(confirmed, 1)
        ],
    )


def print_table(title: str, table: doc.Table, stream=None) -> None:
    """A table on the terminal (rich), text columns left and figures right."""
    console = Console(file=stream or sys.stdout, width=220)
    shown = Table(title=title, title_justify="left")
    for col in table.headers:
        shown.add_column(col, justify="left" if col in ("stack", "settings") else "right")
    for row in table.rows:
        shown.add_row(*row)
    console.print(shown)


def print_answer(rows, front, excluded, header, top, stream=None) -> None:
    print_table(header, ranked_table(rows, top), stream)
    console = Console(file=stream or sys.stdout, width=220)
    console.print(
        "Pareto front (time vs cost): "
        + "; ".join(f"{r['label']} N={r['gpus']} {duration(r['train_time_s']['nominal'])}" for r in front)
    )
    console.print(f"excluded {len(excluded)}" + (":" if excluded else ""))
    for e in excluded:
        console.print(f"  {e['label']} N={e['gpus']}: {e['why']}")


def profile_from(hardware: str) -> Profile:
    try:
        return load_profile(hardware)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None


def cmd_select(args) -> int:
    started = time.perf_counter()
    records = load_records(args.calibrate, kind=None) if args.calibrate else []
    if args.hardware == "local" and not records:
        raise UsageError(
            "--hardware local needs --calibrate: each stack's commbench record (its collectives here) and a "
            "1-rank training run (its compute here)"
        )
    pricing = Pricing(args.hardware, records)
    spec = spec_from_args(args)
    stacks = args.stacks.split(",") if args.stacks else backend_names()
    for s in stacks:
        if s not in backend_names():
            raise UsageError(f"--stacks: unknown stack '{s}'; valid: {', '.join(backend_names())}")
    precisions = (
        args.precision.split(",") if args.precision else ["bf16" if pricing.device == "cuda" else "fp32"]
    )
    for p in precisions:
        if p not in PRECISIONS:
            raise UsageError(f"--precision: unknown precision '{p}'; valid: {', '.join(PRECISIONS)}")
    if args.budget is not None and args.gpu_hour_price is None:
        raise UsageError("--budget needs --gpu-hour-price (the cost is GPU-hours x price)")
    args.global_batch = args.global_batch or DEFAULT_GLOBAL_BATCH
    tokens = args.tokens or 20 * spec.n_params
    base, unpriced = base_configs(args, pricing, spec, precisions, stacks)
    if not base and not unpriced:
        raise UsageError(f"--global-batch {args.global_batch} divides over none of --gpus with whole nodes")
    cands = search(base, pricing, tokens, args.gpu_hour_price) + unpriced
    constrain(cands, args.deadline, args.budget)
    kept = sorted([c for c in cands if not c.dropped], key=lambda c: c.train_s)
    excluded = [
        {"label": c.label, "gpus": c.cfg.topology.world_size, "why": c.dropped, "lacks": c.lacks}
        for c in cands
        if c.dropped
    ]
    where = pricing.hardware if pricing.catalogued is None else pricing.catalogued.name
    header = (
        f"SELECTED (predicted, not measured): {shape_title(cands[0].cfg.model.workload, spec)}, "
        f"on {where}, "
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
    p = odds(top, pricing)
    rows = []
    for i, c in enumerate(kept):
        r = row(c, pricing.profile(c.cfg.backend).memory_bytes)
        r["setting"] = {k: c.cfg.backend_options[k] for k in sharding_settings(get_backend(c.cfg.backend))[0]}
        r["pareto"] = c in front
        r["p_fastest"] = float(p[i]) if i < len(top) else None
        r["calibrated"] = pricing.calibrated(c.cfg)
        r["run_argv"] = run_argv(c.cfg)
        rows.append(r)
    print_answer(rows, [rows[kept.index(c)] for c in front], excluded, header, args.top)
    confirmed = None
    if args.confirm:
        out = Path(args.out or "results") / "confirm"
        confirmed = confirm(rows[: args.confirm], out, args.confirm_steps)
        print_confirmed(confirmed)
    elapsed = time.perf_counter() - started
    for line in answer_lines(rows):
        print(line)
    print(f"selected among {len(cands)} candidates in {elapsed:.1f} s")
    sections = document(header, rows, excluded, confirmed, args.top)
    if args.markdown:
        write_atomic(Path(args.markdown), lambda tmp: tmp.write_text(doc.render_md(sections)))
    if args.html:
        write_atomic(Path(args.html), lambda tmp: tmp.write_text(doc.render_html(sections)))
    if args.out:
        record = {
            "schema_version": SCHEMA_VERSION,
            "kind": "selection",
            "run_id": f"select-{where}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
            "status": "ok",
            "inputs": {
                "argv": list(args.argv),
                "workload": cands[0].cfg.model.workload,
                "tokens": tokens,
                "global_batch": args.global_batch,
                "deadline_h": args.deadline,
                "budget_usd": args.budget,
                "gpu_hour_price_usd": args.gpu_hour_price,
                "allocator_margin": ALLOCATOR_MARGIN,
                "odds": {
                    "samples": ODDS_SAMPLES,
                    "seed": SEED,
                    "inputs": list(BAND_INPUTS),
                    "compute_drawn_per": "calibrated stack (label), else framework",
                },
                "hardware": {
                    name: pricing.profile(name).to_dict() for name in sorted({c.cfg.backend for c in kept})
                },
                "calibration_records": [r["run_id"] for r in records],
            },
            "ranked": rows,
            "pareto": [kept.index(c) for c in front],
            "excluded": excluded,
            "confirmed": confirmed,
            "environment": {"start_time": now_iso(), "git": git_commit(), "elapsed_s": elapsed},
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"{record['run_id']}.json"
        write_record_atomic(path, record)
        print(f"record: {path}")
    return EXIT_OK


def answer_lines(rows: list[dict]) -> list[str]:
    """The first lines of a document: the answer. The fastest candidate with its band and odds; the ones
    whose bands overlap its, named as not told apart; the cheapest where a price was given."""
    first = rows[0]
    t = first["train_time_s"]

    def what(r: dict) -> str:
        setting = ",".join(f"{k}={v}" for k, v in r["setting"].items())
        ckpt = ", activation checkpointing" if r["activation_checkpointing"] else ""
        return (
            f"{r['label']}{f' ({setting})' if setting else ''} on {r['gpus']} GPU(s), micro-batch "
            f"{r['micro_batch']} x {r['grad_accum']}{ckpt}, {r['precision']}"
        )

    odds_text = f", P(fastest) {first['p_fastest']:.0%}" if first.get("p_fastest") is not None else ""
    lines = [
        f"Fastest (predicted): {what(first)}: {duration(t['nominal'])} to train "
        f"({duration(t['low'])}–{duration(t['high'])}){odds_text}."
    ]
    close = [r for r in rows[1:] if r["train_time_s"]["low"] <= t["high"]]
    if close:
        lines.append(
            f"Not told apart from it (bands overlap): {len(close)} candidate(s), first "
            f"{what(close[0])}: {duration(close[0]['train_time_s']['nominal'])}."
        )
    priced = [r for r in rows if r["cost_usd"] is not None]
    if priced:
        cheapest = min(priced, key=lambda r: r["cost_usd"])
        lines.append(f"Cheapest: {what(cheapest)}: {cheapest['cost_usd']:,.0f} USD.")
    return lines


def band_ms(band: dict) -> str:
    return f"{band['nominal'] * 1e3:,.1f} ms ({band['low'] * 1e3:,.1f}–{band['high'] * 1e3:,.1f})"


def document(header: str, rows: list[dict], excluded: list[dict], confirmed: list[dict] | None, top: int):
    """The selection as report's Sections, for Markdown and HTML: the answer first, then the table, what
    was excluded and why, and predicted against measured where --confirm ran."""
    sections = [
        doc.Section("distbench select", 1, [*answer_lines(rows), header + "."]),
        doc.Section("Ranked (predicted, not measured)", 2, [ranked_table(rows, top)]),
        doc.Section("Excluded", 2, [f"{e['label']} N={e['gpus']}: {e['why']}" for e in excluded] or ["none"]),
    ]
    if confirmed:
        sections.append(doc.Section("Confirmed (measured here, briefly)", 2, [confirmed_table(confirmed)]))
    return sections


def run_argv(cfg: RunConfig) -> list[str]:
    """The `harness run` arguments that run candidate `cfg` as priced: its stack, ranks, shape, precision,
    micro-batch and accumulation, checkpointing, variant, and its options beyond what the variant sets."""
    backend = get_backend(cfg.backend)
    spec = cfg.model.spec
    argv = ["--backend", cfg.backend, "--gpus", str(cfg.topology.world_size), "--device", cfg.topology.device]
    if cfg.topology.nodes > 1:
        argv += ["--nodes", str(cfg.topology.nodes), "--gpus-per-node", str(cfg.topology.gpus_per_node)]
    argv += ["--vocab", str(spec.vocab_size), "--seq-len", str(spec.seq_len), "--d-model", str(spec.d_model)]
    argv += ["--layers", str(spec.n_layers), "--heads", str(spec.n_heads), "--ffn", str(spec.d_ff)]
    argv += ["--precision", cfg.model.precision, "--micro-batch", str(cfg.batch.micro_batch)]
    argv += ["--grad-accum", str(cfg.batch.grad_accum)]
    if cfg.topology.device == "cpu":
        argv += ["--threads-per-worker", str(cfg.topology.threads_per_worker)]
    if cfg.model.activation_checkpointing:
        argv.append("--activation-checkpointing")
    against = None
    if cfg.variant == "tuned":
        argv.append("--tuned")
        against = backend.Options(**{k: s.value for k, s in backend.tuned(cfg).items()})
    return argv + backend.Options.from_dict(cfg.backend_options).to_argv(against)


def confirm(rows: list[dict], out: Path, steps: int) -> list[dict]:
    """Each of the top candidates run briefly here (`harness run` with its run_argv), one after the other:
    the predicted step time and band against the measured one. A run that fails is recorded as a failed
    candidate, never dropped; then the candidates are ranked again on what was measured."""
    done = []
    for r in rows:
        argv = [*r["run_argv"], "--steps", str(steps), "--warmup", "2", "--compute-method", "none"]
        argv += ["--no-trace-comm", "--out", str(out), "--quiet"]
        before = set(out.glob("*.json")) if out.is_dir() else set()
        proc = subprocess.run([sys.executable, "-m", "harness", "run", *argv], capture_output=True, text=True)
        new = sorted(set(out.glob("*.json")) - before) if out.is_dir() else []
        record = load_record(new[0]) if len(new) == 1 else None
        predicted = r["step_time_s"]
        measured = None
        if record is not None and record["status"] == "ok":
            measured = float(summarize(record)["step_time_s"]["median"])
        entry = {
            "label": r["label"],
            "gpus": r["gpus"],
            "run_argv": r["run_argv"],
            "status": record["status"] if record else f"no record (exit {proc.returncode})",
            "record": str(new[0]) if len(new) == 1 else None,
            "predicted_step_s": predicted,
            "measured_step_s": measured,
            "in_band": None if measured is None else bool(predicted["low"] <= measured <= predicted["high"]),
            "error": None if measured is None else float(measured / predicted["nominal"] - 1),
            "why": None if measured is not None else (proc.stderr or proc.stdout).strip().splitlines()[-1:],
        }
        done.append(entry)
    ranked = sorted(
        range(len(done)), key=lambda i: done[i]["measured_step_s"] if done[i]["measured_step_s"] else math.inf
    )
    for rank, i in enumerate(ranked, 1):
        done[i]["measured_rank"] = rank if done[i]["measured_step_s"] is not None else None
    return done


def print_confirmed(confirmed: list[dict], stream=None) -> None:
    print_table("CONFIRMED (measured here, briefly)", confirmed_table(confirmed), stream)


def register(subparsers) -> None:
    p = subparsers.add_parser("select", help="rank stacks and settings for a model on a cluster, with odds")
    p.add_argument("--workload", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    for flag in OVERRIDES:
        p.add_argument(
            "--" + flag.replace("_", "-"), dest=flag, type=positive, help=f"override {OVERRIDES[flag]}"
        )
    p.add_argument(
        "--hardware",
        required=True,
        help=f"{', '.join(catalogue())}, a profile .yaml, or local (this machine, from --calibrate)",
    )
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
    p.add_argument(
        "--calibrate",
        nargs="+",
        metavar="RECORDS",
        help="record files or folders: 1-rank training runs calibrate each stack's compute; with "
        "--hardware local, each stack's commbench record gives its collectives here",
    )
    p.add_argument(
        "--threads-per-worker",
        type=positive,
        default=1,
        help="CPU profiles: threads per worker (calibration runs must have used the same; default 1)",
    )
    p.add_argument(
        "--confirm",
        type=positive,
        metavar="K",
        help="run the top K candidates briefly on this machine's devices, then show predicted against "
        "measured and rank them again (records under OUT/confirm)",
    )
    p.add_argument("--markdown", type=Path, metavar="FILE", help="also write the answer as Markdown")
    p.add_argument("--html", type=Path, metavar="FILE", help="also write the answer as one HTML file")
    p.add_argument(
        "--confirm-steps", type=positive, default=6, help="measured steps of each --confirm run (default 6)"
    )
    p.set_defaults(func=cmd_select)
