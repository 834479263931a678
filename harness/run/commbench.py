"""`harness commbench`: each stack's own collectives timed over message sizes, started by the same launchers
and device contract as training runs (multi-node included), written as records of kind "commbench".

The worker side is backends.commbench (its timing rules); the figures (algbw, busbw, the α-β fit) are
harness.analyze.collectives'.
"""

from __future__ import annotations

import math
import re
import sys

from rich.console import Console
from rich.table import Table

from backends import backend_names, get_backend
from backends.base import Backend
from core.commbench_spec import COLLECTIVE_OPS, COMMBENCH_DTYPES, CommbenchSpec
from core.config import DEVICES, InvalidConfig, RunConfig
from core.process import available_cpus
from core.records import run_config
from harness.analyze.summary import fmt_bytes
from harness.arguments import (
    Layout,
    add_flags,
    add_layout_arguments,
    add_stack_options,
    declared,
    foreign_flags,
    hooks_from_args,
    int_at_least,
    positive,
    worker_python,
)
from harness.run.devices import resolve_device
from harness.run.launch import stop_on_sigterm
from harness.run.nodes import check_run_id
from harness.run.options import check_out_dir, os_error_line
from harness.run.record import record_line
from harness.run.runner import execute, run_node
from harness.usage import EXIT_FAILED, EXIT_OK, UsageError, choice
from workloads.spec import PRESETS

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # binary, as nccl-tests reads -b/-e
# The names nccl-tests' binaries (all_reduce_perf, ...) and the issue use, besides COLLECTIVE_OPS' own.
OP_ALIASES = {op.replace("_", ""): op for op in COLLECTIVE_OPS}
DEFAULT_SIZES = "1K:64M"


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", text.strip(), re.IGNORECASE)
    if not m or int(m.group(1)) == 0:
        raise UsageError(f"--sizes: cannot read size '{text}'; expected e.g. 1024, 1K, 64M or 1G")
    return int(m.group(1)) * UNITS[m.group(2).upper()]


def parse_sizes(text: str, factor: int) -> list[int]:
    """'MIN:MAX' (every size from MIN multiplying by `factor` up to MAX, as nccl-tests' -b -e -f) or a
    comma-separated list."""
    if ":" in text:
        low, _, high = text.partition(":")
        first, last = parse_bytes(low), parse_bytes(high)
        if first > last:
            raise UsageError(f"--sizes {text}: the first size is larger than the last")
        return [first * factor**k for k in range(int(math.log(last / first, factor) + 1e-9) + 1)]
    return sorted({parse_bytes(t) for t in text.split(",") if t.strip()})


def whole_shares(sizes: list[int], world: int, element_bytes: int) -> list[int]:
    """Each size rounded down to a multiple of world x element bytes (nccl-tests rounds its counts the same
    way), so every rank's share of an all_gather, reduce_scatter or all_to_all is whole."""
    unit = world * element_bytes
    rounded = sorted({s - s % unit for s in sizes if s >= unit})
    if not rounded:
        raise UsageError(f"--sizes: every size is under {unit} B (ranks x element bytes); give larger ones")
    return rounded


def parse_ops(text: str | None, offered: tuple[str, ...], backend: str) -> tuple[str, ...]:
    if not text:
        return offered
    ops = []
    for name in (t.strip().lower() for t in text.split(",") if t.strip()):
        op = OP_ALIASES.get(name, name)
        choice(op, COLLECTIVE_OPS, "collective")
        if op not in offered:
            raise UsageError(
                f"{backend} offers no {op} here (its API on this device has: {', '.join(offered)})"
            )
        if op not in ops:
            ops.append(op)
    return tuple(ops)


def build_commbench_config(args, backend: Backend) -> RunConfig:
    """Validate the command line into the RunConfig of a commbench run of `backend`, the stack --backend
    names (UsageError on bad input)."""
    foreign_flags(args, [backend.name])
    choice(args.dtype, list(COMMBENCH_DTYPES), "dtype")
    choice(args.device, DEVICES, "device")
    given = Layout.read(args)
    n = given.world(args.gpus)
    if n < 2:
        raise UsageError("commbench needs at least 2 ranks (--gpus 2 or more): one has no one to talk to")
    layout = given.settings(n)
    if layout["nodes"] > 1 and not backend.multi_node:
        raise UsageError(f"backend {backend.name} runs on one node only; drop --nodes/--hosts")
    per_node = n // layout["nodes"]
    device = resolve_device(args.device, per_node)
    probe = RunConfig.build(
        backend=backend.name, workload="tiny", spec=PRESETS["tiny"], world_size=n, device=device
    )
    spec = CommbenchSpec(
        ops=parse_ops(args.ops, backend.collective_ops(probe), backend.name),
        sizes=tuple(whole_shares(parse_sizes(args.sizes, args.size_factor), n, COMMBENCH_DTYPES[args.dtype])),
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup_iters,
    )
    cfg = RunConfig.build(
        backend=backend.name,
        workload="tiny",  # no model is built; the field is required of every run config
        spec=PRESETS["tiny"],
        world_size=n,
        device=device,
        precision="bf16" if args.dtype == "bf16" else "fp32",
        steps=len(spec.ops) * len(spec.sizes),
        warmup=0,
        compute_method="none",
        threads_per_worker=args.threads_per_worker or max(1, available_cpus() // per_node),
        timeout_s=args.timeout,
        collective_timeout_s=args.collective_timeout,
        backend_options=backend.Options.from_args(args).to_dict(),
        python=worker_python(args, backend.name, [backend.name]),
        commbench=spec.to_dict(),
        **layout,
    )
    try:
        backend.validate(cfg)
    except InvalidConfig as exc:
        raise UsageError(str(exc)) from None
    return cfg


def gbps(x) -> str:
    return "n/a" if x is None else f"{x / 1e9:.3f}"


def print_commbench(record: dict, stream=None) -> None:
    """The per-size table of each op (times of the slowest rank), and its α-β fit."""
    console = Console(file=stream or sys.stdout, width=110)
    cfg, s = run_config(record), record["summary"]
    title = (
        f"commbench · {record['backend_info']['label']} ({record['backend_info']['api']}) · "
        f"{cfg.topology.world_size} x {cfg.topology.device} ranks · {cfg.commbench_spec.dtype} · "
        f"status {record['status']}"
    )
    if record["status"] != "ok" or "ops" not in s:
        error = record.get("error") or {}
        console.print(f"{title}\nno figures: {error.get('message') or s.get('error')}", markup=False)
        for line in error.get("log_tail") or []:
            console.print(f"  | {line}", markup=False, highlight=False)
        return
    console.print(title, markup=False)
    for op, entry in s["ops"].items():
        table = Table(title=op, title_justify="left")
        for col in ["size", "time µs (median)", "p10", "p90", "algbw GB/s", "busbw GB/s"]:
            table.add_column(col, justify="right")
        for p in entry["points"]:
            t = p["time_s"]
            row = [
                fmt_bytes(p["bytes"]),
                f"{t['median'] * 1e6:.1f}",
                f"{t['p10'] * 1e6:.1f}",
                f"{t['p90'] * 1e6:.1f}",
                gbps(p["algbw_Bps"]),
                gbps(p["busbw_Bps"]),
            ]
            table.add_row(*row)
        console.print(table)
        if fit := entry.get("fit"):
            console.print(
                f"  fit t = α + S·busfactor/β: α = {fit['alpha_s'] * 1e6:.1f} µs, "
                f"β = {gbps(fit['beta_busbw_Bps'])} GB/s (bus), "
                f"worst point off by {fit['max_rel_error']:.0%}",
                markup=False,
            )


def cmd_commbench(args) -> int:
    backend = get_backend(choice(args.backend, backend_names(), "backend"))
    cfg = build_commbench_config(args, backend)
    ok, reason = backend.availability(cfg.topology.python)
    if not ok:
        raise UsageError(f"backend {backend.name} is unavailable here: {reason}")
    check_run_id(args.run_id, cfg, args.out)
    check_out_dir(args.out)
    stop_on_sigterm()
    if cfg.topology.node_rank:
        node = run_node(backend, cfg, args.out / "logs" / args.run_id, sys.argv, hooks=hooks_from_args(args))
        print(
            f"node {cfg.topology.node_rank}: launcher exit codes {node['returncodes']}; "
            "node 0 writes the record"
        )
        done = not node["timed_out"] and all(rc == 0 for rc in node["returncodes"])
        return EXIT_OK if done else EXIT_FAILED
    bench = cfg.role.commbench
    if bench is None:  # build_commbench_config always sets it
        raise ValueError("a commbench run configuration without its commbench settings")
    print(
        f"commbench: {backend.name} on {cfg.topology.world_size} {cfg.topology.device} ranks, "
        f"{len(bench['ops'])} op(s) x {len(bench['sizes'])} size(s) x "
        f"{bench['iters']} calls",
        flush=True,
    )
    try:
        record = execute(backend, cfg, args.out, sys.argv, run_id=args.run_id, hooks=hooks_from_args(args))
    except OSError as exc:  # the results filesystem full, read-only or over quota; or a launcher's
        print(os_error_line(exc, args.out), file=sys.stderr)
        return EXIT_FAILED
    print_commbench(record)
    print(record_line(record, args.out / (record["run_id"] + ".json")))
    return EXIT_OK if record["status"] == "ok" and not record.get("unwritten") else EXIT_FAILED


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "commbench",
        help="time a stack's own collectives over message sizes (algbw/busbw as nccl-tests; α-β fit)",
    )
    add_flags(p, "--backend", "--gpus")
    p.add_argument(
        "--ops",
        help=f"comma-separated: {', '.join(OP_ALIASES)} (default: every one the stack's API offers here)",
    )
    p.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"MIN:MAX (times --size-factor each step) or a comma list; bytes, K/M/G binary "
        f"(default {DEFAULT_SIZES})",
    )
    p.add_argument("--size-factor", type=int_at_least(2, "an integer >= 2"), default=2)
    p.add_argument("--dtype", default="fp32", help=", ".join(COMMBENCH_DTYPES))
    p.add_argument("--iters", type=positive, default=20, help="timed calls per op and size")
    p.add_argument("--warmup-iters", type=int_at_least(0, "an integer >= 0"), default=5)
    add_flags(p, "--device", "--threads-per-worker", "--timeout", "--collective-timeout", "--out", "--run-id")
    # A commbench rank has no training steps: its fault's second field counts the (op, size) points.
    fault = declared("--inject-fault").but(
        metavar="RANK:POINT:KIND", help="make one rank fail at the POINT-th (op, size), counted from 0"
    )
    add_flags(p, fault)
    add_stack_options(p)
    add_flags(p, "--python")
    add_layout_arguments(p)
    p.set_defaults(func=cmd_commbench)
