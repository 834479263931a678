"""`harness` command line. Bad input: one line on stderr naming the valid choices, exit 2."""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from backends import all_backends, backend_names, get_backend
from backends.base import FAULT_KINDS
from harness.config import COMPUTE_METHODS, DEVICES, PRECISIONS, RunConfig
from workloads.spec import OVERRIDES, PRESETS, resolve

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2

# Modules that add sub-commands: each defines `register(subparsers)` and sets `func` on its parsers.
COMMAND_MODULES = [
    "harness.sweep",
    "harness.report",
    "harness.compare",
    "harness.baseline",
    "harness.history",
    "harness.multinode",
    "harness.schedulers",
    "harness.doctor",
]
DEFAULT_OUT = Path("results")


class UsageError(Exception):
    """Bad input: reported as one line, exit 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def visible_gpus() -> list[str]:
    """GPU names from nvidia-smi (no framework import in the harness), honouring CUDA_VISIBLE_DEVICES."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    names = [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = names[:len([v for v in visible.split(",") if v.strip()])]
    return names


def resolve_device(requested: str, n: int) -> str:
    gpus = visible_gpus()
    device = ("cuda" if gpus else "cpu") if requested == "auto" else requested
    if device == "cuda" and n > len(gpus):
        raise UsageError(f"--gpus {n} but {len(gpus)} GPU(s) visible; use --gpus <= {len(gpus)} or --device cpu")
    return device


def choice(value: str, valid, what: str) -> str:
    if value not in valid:
        raise UsageError(f"unknown {what} '{value}'; valid: {', '.join(valid)}")
    return value


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def fraction(text: str) -> float:
    """0.05 or 5%: a relative threshold or a significance level, strictly between 0 and 1."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.05 or 5%, got '{text}'") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a value between 0 and 1 (exclusive), got {text}")
    return value


def fault_spec(text: str) -> dict:
    try:
        rank, step, kind = text.split(":")
        fault = {"rank": int(rank), "step": int(step), "kind": kind}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:STEP:KIND, got '{text}'") from None
    if kind not in FAULT_KINDS:
        raise argparse.ArgumentTypeError(f"unknown fault kind '{kind}'; valid: {', '.join(FAULT_KINDS)}")
    return fault


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `sweep` (everything that defines the work and how it is measured)."""
    p.add_argument("--workload", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    for flag in OVERRIDES:
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=positive, help=f"override the preset's {OVERRIDES[flag]}")
    p.add_argument("--precision", default="fp32", help=f"{', '.join(PRECISIONS)}")
    p.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)} (auto: cuda if a GPU is visible)")
    p.add_argument("--micro-batch", type=positive, help="sequences per rank per micro-step (default 8)")
    p.add_argument("--global-batch", type=positive, help="global batch; micro-batch = global / (gpus x accum)")
    p.add_argument("--grad-accum", type=positive, default=1)
    p.add_argument("--steps", type=positive, default=20, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run first and excluded from statistics")
    p.add_argument("--compute-steps", type=int, default=5, help="sync-off steps for t_compute (no_sync method)")
    p.add_argument("--compute-method", default="auto", help=f"{', '.join(COMPUTE_METHODS)}: how t_compute is measured")
    p.add_argument("--threads-per-worker", type=positive, help="CPU threads per worker (default: cores / gpus)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--data", help="flat uint16 token file (memory-mapped) instead of synthetic tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the whole run is killed")
    p.add_argument("--collective-timeout", type=float, help="seconds a collective waits for a dead or hung peer "
                   "before the ranks give up (default: --timeout)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for run records")
    testing = p.add_argument_group("testing (never for real measurements)")
    testing.add_argument("--inject-fault", metavar="RANK:STEP:KIND", type=fault_spec,
                         help=f"make one rank fail; KIND: {', '.join(FAULT_KINDS)}")
    testing.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep added to every step")
    testing.add_argument("--dump-weights", action="store_true", help="rank 0 saves its final weights in the log dir")
    for backend in all_backends():
        backend.add_arguments(p)
    from harness.multinode import add_node_arguments
    add_node_arguments(p)


def build_config(args, backend_name: str, n: int, threads: int | None = None, check_devices: bool = True,
                 node_rank: int | None = None) -> RunConfig:
    """Validate CLI input into a RunConfig (raises UsageError with the valid choices). `check_devices`
    False: for a plan made elsewhere, do not require the GPUs to be visible here."""
    from harness.multinode import node_layout
    backend = get_backend(choice(backend_name, backend_names(), "backend"))
    choice(args.workload, list(PRESETS), "workload")
    choice(args.precision, PRECISIONS, "precision")
    choice(args.device, DEVICES, "device")
    choice(args.compute_method, COMPUTE_METHODS, "compute method")
    try:
        spec = resolve(args.workload, **{k: getattr(args, k) for k in OVERRIDES})
    except ValueError as exc:
        raise UsageError(f"invalid workload: {exc}") from None
    if args.micro_batch and args.global_batch:
        raise UsageError("give --micro-batch or --global-batch, not both")
    micro = args.micro_batch or RunConfig.micro_batch
    if args.global_batch:
        if args.global_batch % (n * args.grad_accum):
            raise UsageError(f"--global-batch {args.global_batch} is not divisible by gpus x grad-accum = {n * args.grad_accum}")
        micro = args.global_batch // (n * args.grad_accum)
    if args.data and not Path(args.data).is_file():
        raise UsageError(f"--data {args.data}: no such file")
    method, methods = args.compute_method, backend.compute_methods_for(backend.options(args))
    if method == "auto":
        method = methods[0]
    elif method not in (*methods, "none"):
        raise UsageError(f"backend {backend.name} cannot use compute method '{method}'; valid: {', '.join(methods)}, none")
    layout = node_layout(args, n, node_rank)
    if layout["nodes"] > 1 and not backend.multi_node:
        raise UsageError(f"backend {backend.name} runs on one node only; drop --nodes/--hosts")
    per_node = n // layout["nodes"]
    device = resolve_device(args.device, per_node) if check_devices or args.device == "auto" else args.device
    cores = os.cpu_count() or 1
    return RunConfig(
        backend=backend.name, workload=args.workload, spec=spec, gpus=n, device=device,
        precision=args.precision, micro_batch=micro, grad_accum=args.grad_accum, steps=args.steps,
        warmup=args.warmup, compute_steps=args.compute_steps, compute_method=method,
        threads_per_worker=threads or args.threads_per_worker or max(1, cores // per_node), seed=args.seed,
        data_path=str(Path(args.data).resolve()) if args.data else None,
        activation_checkpointing=args.activation_checkpointing,
        scaling="strong" if args.global_batch else "weak", timeout_s=args.timeout,
        collective_timeout_s=getattr(args, "collective_timeout", None), **layout,
        backend_options=backend.options(args),
        fault=args.inject_fault, step_delay_s=args.step_delay, dump_weights=args.dump_weights,
    )


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024


def fmt(x, spec="{:.3g}") -> str:
    return "n/a" if x is None else spec.format(x)


def print_summary(record: dict, stream=sys.stdout) -> None:
    """A short human summary of one run record."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    cfg, s, env = record["config"], record["summary"], record["environment"]
    console = Console(file=stream, width=100)
    title = (f"{record['backend_info']['label']} · {cfg['workload']} · {cfg['gpus']} x {cfg['device']} "
             f"workers · {cfg['precision']} · status {record['status']}")
    table = Table(title=title, show_header=False, title_justify="left")
    t = s["step_time_s"]
    rows = [
        ("device", f"{env['device_kind']} ({cfg['threads_per_worker']} thread(s)/worker)" if cfg["device"] == "cpu" else str(env["device_kind"])),
        ("global batch", f"{cfg['micro_batch']} x {cfg['grad_accum']} accum x {cfg['gpus']} ranks = {cfg['micro_batch'] * cfg['grad_accum'] * cfg['gpus']} seq x {cfg['spec']['seq_len']} tok"),
        ("step time (median [p10, p90])", f"{fmt(t['median'] and t['median'] * 1e3, '{:.1f}')} ms [{fmt(t['p10'] and t['p10'] * 1e3, '{:.1f}')}, {fmt(t['p90'] and t['p90'] * 1e3, '{:.1f}')}] over {t['n']} steps"),
        ("throughput", f"{fmt(s['throughput_tokens_per_s'], '{:,.0f}')} tokens/s ({fmt(s['per_device_tokens_per_s'], '{:,.0f}')} per device)"),
        ("loss first -> last", f"{fmt(s['loss_first'], '{:.4f}')} -> {fmt(s['loss_last'], '{:.4f}')}"),
        ("exposed comm ratio", f"{fmt(s['exposed_comm_ratio'], '{:.1%}')} (t_compute {fmt(s['t_compute_s'] and s['t_compute_s'] * 1e3, '{:.1f}')} ms by {s['compute_method']})"),
        ("comm per rank per step", f"{fmt_bytes(s['comm_bytes_per_rank_per_step'])} ({s['comm_volume_method']}); implied busbw {fmt_bytes(s['implied_busbw_bytes_per_s'])}/s"),
        ("peak memory per rank", f"RSS {fmt_bytes(s['peak_rss_bytes'])}; allocated {fmt_bytes(s['peak_allocated_bytes'])}; reserved {fmt_bytes(s['peak_reserved_bytes'])}"),
        ("model state per rank", f"{fmt_bytes(s['model_state_bytes_per_rank'])} measured vs {fmt_bytes(s['model_state_bytes_analytic'])} analytic"),
        ("MFU", fmt(s["mfu"], "{:.1%}") + ("" if s["mfu"] is not None else " (device peak unknown)")),
        ("data wait", f"{fmt(s['data_wait_s'] and s['data_wait_s'] * 1e3, '{:.2f}')} ms per step"),
        ("host page faults", f"{fmt(s.get('minor_faults_per_step'), '{:,.1f}')} minor faults per step (slowest rank)"),
    ]
    if record.get("error"):
        err = record["error"]
        rows.append(("error", f"rank {err.get('rank')}: {err.get('message')}"))
    for k, v in rows:
        table.add_row(escape(k), escape(v))
    console.print(table)
    if record.get("error") and record["error"].get("log_tail"):
        console.print(f"[bold]last log lines of rank {record['error'].get('rank')}:[/bold]")
        console.print("\n".join(record["error"]["log_tail"]), markup=False, highlight=False)


def cmd_run(args) -> int:
    from harness.multinode import check_run_id, requested_world
    from harness.runner import execute, run_node
    cfg = build_config(args, args.backend, requested_world(args))
    backend = get_backend(cfg.backend)
    ok, reason = backend.availability()
    if not ok:
        print(f"harness: error: backend {backend.name} is unavailable here: {reason}", file=sys.stderr)
        return EXIT_USAGE
    check_run_id(args.run_id, cfg, args.out)
    if cfg.node_rank:  # another node's harness only runs its launcher; node 0 writes the record
        node = run_node(backend, cfg, args.out / "logs" / args.run_id, sys.argv)
        done = not node["timed_out"] and all(rc == 0 for rc in node["returncodes"])
        print(f"node {cfg.node_rank}: launcher exit codes {node['returncodes']}{' (timed out)' if node['timed_out'] else ''}; "
              f"node 0 writes the record {args.out / (args.run_id + '.json')}")
        return EXIT_OK if done else EXIT_FAILED
    record = execute(backend, cfg, args.out, sys.argv, run_id=args.run_id)
    print_summary(record)
    print(f"record: {args.out / (record['run_id'] + '.json')}")
    return EXIT_OK if record["status"] == "ok" else EXIT_FAILED


def cmd_list(args) -> int:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=120)
    table = Table(title="backends")
    for col in ("backend", "framework", "launcher", "available"):
        table.add_column(col)
    for b in all_backends():
        ok, reason = b.availability()
        table.add_row(b.name, b.framework, b.launcher, "yes" if ok else f"no: {reason}")
    console.print(table)
    table = Table(title="workloads")
    for col in ("workload", "parameters", "layers", "d_model", "heads", "seq_len", "vocab", "FLOPs/token"):
        table.add_column(col, justify="right")
    for name, s in PRESETS.items():
        table.add_row(name, f"{s.n_params:,}", str(s.n_layers), str(s.d_model), str(s.n_heads), str(s.seq_len),
                      str(s.vocab_size), f"{s.flops_per_token:.3g}")
    console.print(table)
    return EXIT_OK


def make_parser() -> Parser:
    parser = Parser(prog="harness", description="distbench: one model, six distributed-training stacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    run = sub.add_parser("run", help="launch one run and write its record")
    run.add_argument("--backend", required=True, help=", ".join(backend_names()))
    run.add_argument("--gpus", type=positive, help="ranks in all: GPUs, or CPU workers without a GPU (default: "
                     "nodes x --gpus-per-node, else 1)")
    run.add_argument("--run-id", help="this run's id; a multi-node run needs the same one on every node")
    add_run_arguments(run)
    run.set_defaults(func=cmd_run)
    sub.add_parser("list", help="backends (with availability) and workloads").set_defaults(func=cmd_list)
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv=None) -> int:
    try:
        args = make_parser().parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130
