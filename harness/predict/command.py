"""`harness predict`: the figures of a configuration at rank counts not measured, each with its band.

Reads records (`--calibrate`: training runs for compute, commbench runs for this machine's collectives) and
writes nothing unless `--out` is given; then one record of kind "prediction" per rank count, with every
input, which `harness report` draws dashed beside measured points and never folds into their statistics.
"""

from __future__ import annotations

import math
import sys
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from backends import get_backend
from core.config import BatchConfig, RunConfig
from core.process import available_cpus
from core.records import SCHEMA_VERSION, git_commit, load_records, now_iso, write_record_atomic
from harness.analyze.summary import fmt_bytes
from harness.arguments import Flag, RunRequest, add_flags, add_stack_options, declared, positive, validated
from harness.arguments.flags import SHAPE_FLAGS
from harness.arguments.parsers import gpu_counts
from harness.predict import margin
from harness.predict.calibration import calibrate
from harness.predict.hardware import CORNERS, ProfileError, catalogue, load_profile, local_profile
from harness.predict.memory import largest_fitting
from harness.predict.model import predict_point, scaling_ratio
from harness.predict.published_check import check as published_check
from harness.usage import EXIT_OK, UsageError
from workloads.spec import PRESETS


def batch_at(args, n: int) -> tuple[int, int]:
    """(micro-batch, accumulation) at n ranks. With --global-batch: --micro-batch fixed and the
    accumulation derived; or --grad-accum fixed and the micro-batch derived; or neither, micro-batch 1 and
    the whole share accumulated, for configs() to raise to the largest micro-batch that fits. Without:
    --micro-batch (default 8) and --grad-accum (default 1), the same at every n (weak scaling)."""
    if not args.global_batch:
        return args.micro_batch or BatchConfig.micro_batch, args.grad_accum or 1
    if args.micro_batch and args.grad_accum:
        raise UsageError(
            "with --global-batch give --micro-batch or --grad-accum, not both: the other is derived"
        )
    per_micro = n * (args.micro_batch or args.grad_accum or 1)
    if args.global_batch % per_micro:
        given = (
            f"--micro-batch {args.micro_batch}"
            if args.micro_batch
            else f"--grad-accum {args.grad_accum or 1}"
        )
        raise UsageError(
            f"--global-batch {args.global_batch} is not divisible by gpus x ({given}) = {per_micro}: "
            f"valid: a global batch that {n} ranks share in whole micro-batches"
        )
    if args.micro_batch:
        return args.micro_batch, args.global_batch // per_micro
    if args.grad_accum:
        return args.global_batch // per_micro, args.grad_accum
    return 1, args.global_batch // n


def configs(args, profile) -> list[RunConfig]:
    """One RunConfig per rank count, read from the command line as a run's is (harness.arguments) and
    validated by the adapter as a run's would be."""
    request = RunRequest(args)
    backend, spec = request.backend, request.spec
    precision = args.precision or ("bf16" if profile.device == "cuda" else "fp32")
    out = []
    for n in args.gpus:
        micro, accum = batch_at(args, n)
        per_node = min(n, profile.gpus_per_node)
        if n % per_node:
            raise UsageError(
                f"--gpus {n} does not fill whole nodes of {per_node} ({profile.name}): give at most "
                f"{per_node} or a multiple of it"
            )
        cfg = request.assemble(  # a tuned variant: the stack's tuned set at this N, as `harness run --tuned`
            backend,
            "tuned" if args.tuned else "default",
            # a shape the spec flags changed is no preset: named custom here and in the record
            workload=args.workload if spec == PRESETS[args.workload] else "custom",
            spec=spec,
            world_size=n,
            device=profile.device,
            precision=precision,
            micro_batch=micro,
            grad_accum=accum,
            threads_per_worker=args.threads_per_worker,
            scaling="strong" if args.global_batch else "weak",
            nodes=math.ceil(n / per_node),
            gpus_per_node=per_node,
        )
        if args.global_batch and not args.micro_batch and not args.grad_accum:
            # strong scaling as users run it: the largest micro-batch that fits, accumulation for the rest
            # (none fitting: micro-batch 1, which the prediction's memory verdict then reports)
            fitted, _, _ = largest_fitting(cfg, args.global_batch // n, profile.memory_bytes)
            cfg = fitted or cfg
        # as a run's would be, less where its nodes are: a launch needs hosts, a prediction none
        validated(backend, cfg.evolve(hosts=[f"node{i}" for i in range(cfg.topology.nodes)]))
        out.append(cfg)
    return out


def band(corners: dict, key: str, scale: float = 1.0, spec: str = "{:.3g}") -> str:
    values = [corners[c][key] for c in CORNERS]
    if any(v is None for v in values):
        return "n/a"
    nominal, low, high = values[1] * scale, min(values) * scale, max(values) * scale
    return f"{spec.format(nominal)} ({spec.format(low)}–{spec.format(high)})"


def duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s"


def print_table(points: list[dict], header: str, stream=None) -> None:
    console = Console(file=stream or sys.stdout, width=200)
    table = Table(title=header, title_justify="left")
    columns = (
        "N",
        "nodes",
        "step s",
        "tokens/s/device",
        "speedup",
        "efficiency %",
        "exposed comm %",
        "MFU %",
        "memory/rank",
        "fits",
        "time to train",
        "cost USD",
    )
    for col in columns:
        table.add_column(col, justify="right")
    for p in points:
        c = p["prediction"]["corners"]
        fit = p["prediction"]["fits"]
        table.add_row(
            str(p["world_size"]),
            str(p["nodes"]),
            band(c, "step_time_s"),
            band(c, "per_device_tokens_per_s", spec="{:,.0f}"),
            band(c, "speedup"),
            band(c, "scaling_efficiency", 100, "{:.1f}"),
            band(c, "exposed_comm_ratio", 100, "{:.1f}"),
            band(c, "mfu", 100, "{:.1f}"),
            fmt_bytes(c["nominal"]["memory"]["total"]),
            fit["verdict"],
            duration(c["nominal"]["train_time_s"]),
            band(c, "cost_usd", spec="{:,.0f}") if c["nominal"]["cost_usd"] is not None else "-",
        )
    console.print(table)
    for p in points:
        if p["prediction"]["fits"]["verdict"] != "yes":
            fit = p["prediction"]["fits"]
            console.print(f"N={p['world_size']}: fits {fit['verdict']}: {fit['why']}")


def print_explanation(point: dict, stream=None) -> None:
    """`--explain N`: one rank count's nominal step, term by term, and the input that moves its band most."""
    console = Console(file=stream or sys.stdout, width=200)
    prediction = point["prediction"]
    line = prediction["timeline"]
    step = line["step_s"]
    table = Table(
        title=f"EXPLAINED (predicted, nominal corner): N={point['world_size']} ({point['nodes']} node(s)), "
        f"step {step:.4g} s",
        title_justify="left",
    )
    table.add_column("part of the step")
    for col in ("s", "% of step", "calls", "bytes", "on the wire s"):
        table.add_column(col, justify="right")
    table.add_column("NCCL (algorithm/protocol)")
    terms = line["terms"]
    for name, seconds in line["parts"].items():
        term = terms.get(name.removeprefix("exposed "))
        extra = ["", "", "", ""]
        if term:
            extra = [f"{term['calls']:,}", fmt_bytes(term["bytes"]), f"{term['busy_s']:.4g}"]
            extra.append(", ".join(term["nccl"]))
        table.add_row(name, f"{seconds:.4g}", f"{100 * seconds / step:.1f}", *extra)
    hidden = [k for k, t in terms.items() if t["exposed_s"] <= 0]
    console.print(table)
    if hidden:
        console.print(f"hidden behind compute: {', '.join(hidden)}")
    if line["dominant"]:
        share = line["parts"][line["dominant"]] / step
        console.print(f"beyond compute the largest: {line['dominant']} ({100 * share:.1f}% of the step)")
    band = prediction["band"]
    spread = sorted(band["inputs"].items(), key=lambda kv: -kv[1]["spread_s"])
    console.print(
        "band: each input alone at its fast and slow ends (the others nominal) moves the step by "
        + "; ".join(f"{k} {v['fast_step_s']:.4g}–{v['slow_step_s']:.4g} s" for k, v in spread)
        + f"; {band['dominant']} dominates the band"
    )
    scale = prediction["empirical_scale_loss"]
    console.print(
        f"{margin.LABEL} (not modelled: fitted on published runs): the slow end loses "
        f"{scale['per_doubling']:.2%} of per-device throughput a doubling of N beyond a node "
        f"({scale['doublings_beyond_node']:.3g} here): " + margin.coverage_line()
    )


def print_scaling_ratio(small: RunConfig, large: RunConfig, ratio: dict) -> None:
    """The per-device throughput kept from the smallest N to the largest, with the band every combination
    of the inputs' ends gives (how a published scaling result reads)."""
    worst = ", ".join(f"{k} {v}" for k, v in ratio["low_at"].items())
    print(
        f"per-device tokens/s at N={large.topology.world_size} over N={small.topology.world_size}: "
        f"{ratio['nominal']:.3f} ({ratio['low']:.3f}–{ratio['high']:.3f} over every combination of the "
        f"inputs' ends, the low end less the {margin.LABEL} over {ratio['doublings_beyond_node']:.3g} "
        f"doubling(s); lowest with {worst}); alone, {ratio['dominant']} moves it most"
    )


def prediction_record(cfg: RunConfig, prediction: dict, profile, calib, inputs: dict) -> dict:
    """A record of kind "prediction": the configuration, every input, and the figures at every corner."""
    backend = get_backend(cfg.backend)
    label = backend.label(cfg)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "prediction",
        "run_id": f"predict-{label}-{profile.name}-n{cfg.topology.world_size}-{stamp}-{uuid.uuid4().hex[:6]}",
        "status": "ok",
        "error": None,
        "config": cfg.to_dict(),
        "backend_info": {"label": label, "framework": backend.framework, "sharding": backend.sharding(cfg)},
        "ranks": [],
        "summary": prediction,
        "inputs": {**inputs, "hardware": profile.to_dict(), "calibration": calib.to_dict()},
        "environment": {"start_time": now_iso(), "git": git_commit(), "argv": inputs["argv"]},
    }


def cmd_predict(args) -> int:
    started = time.perf_counter()
    records = load_records(args.calibrate, kind=None) if args.calibrate else []
    try:
        if args.hardware == "local":
            profile = local_profile(
                [r for r in records if r["kind"] == "commbench"], args.backend, available_cpus()
            )
        else:
            profile = load_profile(args.hardware)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    cfgs = configs(args, profile)
    if args.explain is not None and args.explain not in args.gpus:
        raise UsageError(
            f"--explain {args.explain}: not a rank count of --gpus; valid: {', '.join(map(str, args.gpus))}"
        )
    training = [r for r in records if r["kind"] == "training"]
    calib = calibrate(training, cfgs[0], profile)
    if profile.device == "cpu" and not calib.seconds_per_flop:
        raise UsageError(
            "the local profile needs a 1-rank training record of this backend and precision in --calibrate "
            "(no peak FLOP/s is known for a CPU)" + (f"; {'; '.join(calib.notes)}" if calib.notes else "")
        )
    tokens = args.tokens or 20 * cfgs[0].model.spec.n_params
    points = []
    for cfg in cfgs:
        try:
            explained = args.out is not None or args.explain == cfg.topology.world_size
            prediction = predict_point(cfg, profile, calib, tokens, args.gpu_hour_price, band=explained)
        except ProfileError as exc:
            raise UsageError(str(exc)) from None
        points.append(
            {
                "world_size": cfg.topology.world_size,
                "nodes": cfg.topology.nodes,
                "prediction": prediction,
                "cfg": cfg,
            }
        )
    label = get_backend(cfgs[0].backend).label(cfgs[0])
    method = points[0]["prediction"]["corners"]["nominal"]["compute_method"]
    header = (
        f"PREDICTED (not measured): {label}, {shape_title(cfgs[0].model.workload, cfgs[0].model.spec)}, "
        f"{cfgs[0].model.precision}, on {profile.name}"
        + (f" ({profile.description})" if profile.name == "local" else "")
        + f"; compute: {method}; training on {tokens:.3g} tokens "
        f"(6PT = {6 * cfgs[0].model.spec.n_params * tokens:.3g} FLOPs); nominal (fast–slow corner)"
    )
    print_table(points, header)
    # How the model held on published runs of this stack (none for a CPU's local profile: those are GPU
    # clusters); with each record, so a budget read from it carries the caveat.
    checked = published_check(cfgs[0], args.gpus) if profile.device == "cuda" else None
    if checked:
        print(f"published check: {checked['verdict']}")
        for p in points:
            p["prediction"]["published_check"] = checked
    if args.explain is not None:
        (point,) = [p for p in points if p["world_size"] == args.explain]
        print_explanation(point)
        if len(cfgs) > 1:
            print_scaling_ratio(cfgs[0], cfgs[-1], scaling_ratio(cfgs[0], cfgs[-1], profile, calib))
    if calib.fit:
        runs = ", ".join(calib.fit["runs"])
        print(f"compute calibrated by {calib.fit['method']}: {calib.fit['description']} ({runs})")
    for note in calib.notes:
        print(f"note: {note}")
    if args.out:
        inputs = {
            "argv": list(args.argv),
            "tokens": tokens,
            "gpu_hour_price_usd": args.gpu_hour_price,
            "schedule": points[0]["prediction"]["schedule"],
            "calibration_records": [r["run_id"] for r in records],
        }
        Path(args.out).mkdir(parents=True, exist_ok=True)
        for p in points:
            record = prediction_record(p["cfg"], p["prediction"], profile, calib, inputs)
            write_record_atomic(Path(args.out) / f"{record['run_id']}.json", record)
            print(f"record: {Path(args.out) / (record['run_id'] + '.json')}")
    print(f"predicted {len(points)} rank count(s) in {time.perf_counter() - started:.2f} s")
    return EXIT_OK


def shape_title(workload: str, spec) -> str:
    """'1b (1,316.0M params)', or for a custom shape its dimensions too, so no preset's name is on it."""
    params = f"{spec.n_params / 1e6:,.1f}M params"
    if workload != "custom":
        return f"{workload} ({params})"
    return (
        f"custom ({params}: {spec.n_layers} layers, d_model {spec.d_model}, {spec.n_heads} heads, "
        f"ffn {spec.d_ff}, seq {spec.seq_len}, vocab {spec.vocab_size})"
    )


# Where `harness predict` defines a flag of `harness run` otherwise, and why (tests/test_arguments.py holds
# every other shared flag to one definition).
# It prices what a cluster trains in: bf16 on a GPU profile; on a CPU (the local profile) fp32, what a run
# here, which calibrates it, trains in by default. So the default is decided once the profile is known.
PRECISION = declared("--precision").but(
    default=None, help="fp32, bf16, fp16 (default: bf16 on a GPU profile, fp32 on a CPU's local profile)"
)
# It chooses what a run derives: at each N the largest micro-batch that fits the profile's memory.
GLOBAL_BATCH = declared("--global-batch").but(
    help="global batch (strong scaling): at each N the largest micro-batch that fits the profile's "
    "memory, or --micro-batch, and gradient accumulation for the rest"
)
# Rank counts: one prediction per N.
GPUS = declared("--gpus").but(type=gpu_counts, required=True, help="rank counts, e.g. 8,32,128,1024")
# One calibration prices every N: its workers' threads must be the calibration run's, which a run's
# default (cores over the ranks) would change with N.
THREADS = declared("--threads-per-worker").but(
    default=1, help="local profile: CPU threads per worker (calibration runs must have used the same)"
)
# A prediction writes nothing unless asked.
OUT = declared("--out").but(default=None, help="write one prediction record per rank count into this folder")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "predict",
        help="predict step time, throughput, exposed communication and memory at other GPU counts",
    )
    shape: tuple[str | Flag, ...] = ("--workload", *SHAPE_FLAGS, PRECISION, "--micro-batch", GLOBAL_BATCH)
    add_flags(p, "--backend", *shape, "--grad-accum", "--activation-checkpointing", "--tuned", GPUS)
    add_flags(
        p,
        "--hardware",
        "--calibrate",
        THREADS,
        "--tokens",
        "--gpu-hour-price",
        OUT,
        profiles=", ".join(catalogue()),
    )
    p.add_argument(
        "--explain",
        type=positive,
        metavar="N",
        help="for one of the rank counts: the step's timeline (compute, each exposed communication term, "
        "the overlap's slowdown, stragglers) and the input that dominates the band",
    )
    add_stack_options(p)
    p.set_defaults(func=cmd_predict)
