"""`harness select`: which stack and settings for this model on that cluster, ranked, with the odds that each
of the first few is really the fastest; and, with --confirm, the first few run here briefly. The flags, and
the record of a selection.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from backends import backend_names, get_backend
from core.config import PRECISIONS
from core.records import SCHEMA_VERSION, git_commit, load_records, now_iso, write_record_atomic
from harness.arguments import add_document_arguments, add_flags, run_argv, spec_from_args, write_documents
from harness.arguments.flags import SHAPE_FLAGS
from harness.arguments.parsers import gpu_range, hours, positive, usd
from harness.predict.command import THREADS, shape_title
from harness.predict.hardware import catalogue
from harness.predict.memory import ALLOCATOR_MARGIN
from harness.predict.model import BAND_INPUTS
from harness.select.confirmation import confirm
from harness.select.presentation import (
    answer_lines,
    document,
    print_answer,
    print_closest,
    print_confirmed,
    row,
)
from harness.select.search import (
    ODDS_SAMPLES,
    ODDS_TOP,
    SEED,
    Candidate,
    Pricing,
    base_configs,
    constrain,
    odds,
    pareto,
    search,
    sharding_settings,
)
from harness.usage import EXIT_OK, UsageError
from workloads.spec import ModelSpec

EXIT_NOTHING = 1  # nothing meets the constraints: an answer, not an error
DEFAULT_GLOBAL_BATCH = 512


@dataclass
class Inputs:
    """What the flags ask, checked once: the calibration records, what prices a candidate, the model, the
    stacks and precisions searched, and the tokens to train on."""

    records: list[dict]
    pricing: Pricing
    spec: ModelSpec
    stacks: list[str]
    precisions: list[str]
    tokens: float

    @property
    def hardware(self) -> str:
        """The profile's name, as the header and the record's id say it."""
        catalogued = self.pricing.catalogued
        return self.pricing.hardware if catalogued is None else catalogued.name


def read_inputs(args) -> Inputs:
    """The flags as the search takes them, or a UsageError naming the first that is wrong. Sets
    args.global_batch's default, which base_configs reads."""
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
    return Inputs(records, pricing, spec, stacks, precisions, args.tokens or 20 * spec.n_params)


def candidates(args, inputs: Inputs) -> list[Candidate]:
    """Every candidate, priced and held to the deadline and budget: those dropped say why."""
    base, unpriced = base_configs(args, inputs.pricing, inputs.spec, inputs.precisions, inputs.stacks)
    if not base and not unpriced:
        raise UsageError(f"--global-batch {args.global_batch} divides over none of --gpus with whole nodes")
    cands = search(base, inputs.pricing, inputs.tokens, args.gpu_hour_price) + unpriced
    constrain(cands, args.deadline, args.budget)
    return cands


def excluded_rows(cands: list[Candidate]) -> list[dict]:
    return [
        {"label": c.label, "gpus": c.cfg.topology.world_size, "why": c.dropped, "lacks": c.lacks}
        for c in cands
        if c.dropped
    ]


def ranked_rows(kept: list[Candidate], front: list[Candidate], pricing: Pricing) -> list[dict]:
    """The candidates that meet every constraint, fastest first, as the record's rows: the prediction, the
    sharding setting searched, Pareto membership, the odds of the first ODDS_TOP, whether the compute is
    calibrated, and the `harness run` arguments that run each."""
    top = kept[:ODDS_TOP]
    p_fastest = odds(top, pricing)
    rows = []
    for i, c in enumerate(kept):
        r = row(c, pricing.profile(c.cfg.backend).memory_bytes)
        r["setting"] = {k: c.cfg.backend_options[k] for k in sharding_settings(get_backend(c.cfg.backend))[0]}
        r["pareto"] = c in front
        r["p_fastest"] = float(p_fastest[i]) if i < len(top) else None
        r["calibrated"] = pricing.calibrated(c.cfg)
        r["run_argv"] = run_argv(c.cfg)
        rows.append(r)
    return rows


def record_inputs(args, inputs: Inputs, kept: list[Candidate]) -> dict:
    """The record's inputs: what was asked, and what the answer rests on (the margin, the odds' draws, each
    ranked stack's profile, the calibration runs)."""
    return {
        "argv": list(args.argv),
        "workload": kept[0].cfg.model.workload,
        "tokens": inputs.tokens,
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
            name: inputs.pricing.profile(name).to_dict() for name in sorted({c.cfg.backend for c in kept})
        },
        "calibration_records": [r["run_id"] for r in inputs.records],
    }


def write_selection_record(out: Path, record: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{record['run_id']}.json"
    write_record_atomic(path, record)
    return path


def cmd_select(args) -> int:
    started = time.perf_counter()
    inputs = read_inputs(args)
    cands = candidates(args, inputs)
    kept = sorted([c for c in cands if not c.dropped], key=lambda c: c.train_s)
    excluded = excluded_rows(cands)
    header = (
        f"SELECTED (predicted, not measured): {shape_title(cands[0].cfg.model.workload, inputs.spec)}, "
        f"on {inputs.hardware}, {inputs.tokens:.3g} tokens, global batch {args.global_batch}; "
        f"{len(cands)} candidates, {len(kept)} meet every constraint"
    )
    if not kept:
        print_closest(header, cands)
        return EXIT_NOTHING
    front = pareto(kept)
    rows = ranked_rows(kept, front, inputs.pricing)
    print_answer(rows, [rows[kept.index(c)] for c in front], excluded, header, args.top)
    confirmed = None
    if args.confirm:
        confirmed = confirm(rows[: args.confirm], Path(args.out or "results") / "confirm", args.confirm_steps)
        print_confirmed(confirmed)
    elapsed = time.perf_counter() - started
    for line in answer_lines(rows):
        print(line)
    print(f"selected among {len(cands)} candidates in {elapsed:.1f} s")
    sections = document(header, rows, excluded, confirmed, args.top, with_figures=bool(args.html))
    write_documents(args, sections, label="selection")
    if args.out:
        record = {
            "schema_version": SCHEMA_VERSION,
            "kind": "selection",
            "run_id": f"select-{inputs.hardware}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
            "status": "ok",
            "inputs": record_inputs(args, inputs, kept),
            "ranked": rows,
            "pareto": [kept.index(c) for c in front],
            "excluded": excluded,
            "confirmed": confirmed,
            "environment": {"start_time": now_iso(), "git": git_commit(), "elapsed_s": elapsed},
        }
        print(f"record: {write_selection_record(Path(args.out), record)}")
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("select", help="rank stacks and settings for a model on a cluster, with odds")
    add_flags(p, "--workload", *SHAPE_FLAGS)
    add_flags(p, "--hardware", "--calibrate", "--tokens", "--gpu-hour-price", profiles=", ".join(catalogue()))
    p.add_argument("--gpus", type=gpu_range, required=True, help="rank counts: 8,16,32 or 8-256")
    p.add_argument("--deadline", type=hours, help="hours the training may take")
    p.add_argument("--budget", type=usd, help="USD the training may cost (needs --gpu-hour-price)")
    p.add_argument("--global-batch", type=positive, help=f"sequences a step (default {DEFAULT_GLOBAL_BATCH})")
    p.add_argument("--precision", help=f"comma-separated, of {', '.join(PRECISIONS)} (default bf16 on a GPU)")
    p.add_argument("--stacks", help=f"comma-separated, of {', '.join(backend_names())} (default all)")
    p.add_argument("--top", type=positive, default=15, help="rows of the table shown (default 15)")
    p.add_argument("--out", type=Path, help="write the selection record into this folder")
    add_flags(p, THREADS)  # one calibration prices every N, as in `harness predict`
    p.add_argument(
        "--confirm",
        type=positive,
        metavar="K",
        help="run the top K candidates briefly on this machine's devices, then show predicted against "
        "measured and rank them again (records under OUT/confirm)",
    )
    add_document_arguments(p)
    p.add_argument(
        "--confirm-steps", type=positive, default=6, help="measured steps of each --confirm run (default 6)"
    )
    p.set_defaults(func=cmd_select)
