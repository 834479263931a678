"""`harness run`, `harness list` and `harness collect`: one run end to end, what can run here, and the record
of a multi-node run whose nodes shared no filesystem."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from backends import all_backends, get_backend, interpreter
from core.config import RunConfig
from harness.analyze.summary import print_summary
from harness.arguments import add_flags, add_run_arguments, hooks_from_args
from harness.arguments.parsers import FILL
from harness.run.environment import install_command
from harness.run.launch import stop_on_sigterm
from harness.run.nodes import check_run_id
from harness.run.options import check_out_dir, os_error_line, run_request
from harness.run.progress import RunDisplay
from harness.run.record import record_line, write_record
from harness.run.runner import execute, run_node
from harness.usage import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from workloads.spec import PRESETS


def cmd_run(args) -> int:
    request = run_request(args, fills=True)
    cfg = request.config(args.backend, request.world)
    backend = request.backend
    ok, reason = backend.availability(cfg.topology.python)
    if not ok:
        print(f"harness: error: backend {backend.name} is unavailable here: {reason}", file=sys.stderr)
        return EXIT_USAGE
    check_run_id(args.run_id, cfg, args.out)
    check_out_dir(args.out)
    choice = None
    if args.micro_batch == FILL:  # before anything of the run launches: a refusal is a usage error
        from harness.run import fill  # here: the memory model's libraries would slow every run's start

        cfg, choice = fill.choose(cfg, lambda trial: fill.probe_run(trial, cfg.measurement.timeout_s))
        print(f"micro-batch max: {choice['chosen']} (predicted {choice['predicted']}, probed)")
    stop_on_sigterm()
    if cfg.topology.node_rank:  # another node's harness only runs its launcher; node 0 writes the record
        node = run_node(backend, cfg, args.out / "logs" / args.run_id, sys.argv, hooks=hooks_from_args(args))
        # ranks_ok: every rank of the node had measured, even if one then died while tracing (an incident)
        done = not node["timed_out"] and not node.get("stopped") and node["ranks_ok"]
        print(
            f"node {cfg.topology.node_rank}: launcher exit codes {node['returncodes']}"
            f"{' (timed out)' if node['timed_out'] else ''}; "
            f"node 0 writes the record {args.out / (args.run_id + '.json')}"
        )
        return EXIT_OK if done else EXIT_FAILED
    with RunDisplay(live=sys.stdout.isatty() and not args.quiet) as display:
        try:
            record = execute(
                backend,
                cfg,
                args.out,
                sys.argv,
                run_id=args.run_id,
                display=display,
                hooks=hooks_from_args(args),
                annotations={"micro_batch_choice": choice} if choice else None,
            )
        except OSError as exc:  # the results filesystem full, read-only or over quota; or a launcher's
            print(os_error_line(exc, args.out), file=sys.stderr)
            return EXIT_FAILED
        display.finish(record, tail_lines=0)  # the summary shows the failing rank's lines
    print_summary(record)
    print(record_line(record, args.out / (record["run_id"] + ".json")))
    if record.get("unwritten"):
        return EXIT_FAILED
    if args.tensorboard:
        # imported here: tensorboard's protobufs and pandas would cost every run's start about 0.25 s
        from harness.analyze.export import write_tensorboard

        for folder in write_tensorboard([record], args.tensorboard):
            print(f"tensorboard: {folder}")
    return EXIT_OK if record["status"] == "ok" else EXIT_FAILED


def cmd_list(args) -> int:
    """Each backend with the interpreter its workers run under (where that choice came from in the table,
    the paths under it) and, asked of that interpreter, whether the stack is installed there and its
    versions; for each one that is not, the command that installs it there."""
    console = Console(width=120)
    table = Table(title="backends")
    for col in ("backend", "framework", "launcher", "python", "available"):
        table.add_column(col)
    pythons: dict[str, str] = {}
    to_install: dict[str, str] = {}  # backend -> the command that installs its stack
    for b in all_backends():
        try:
            python, source = interpreter.configured(b.name, b.framework)
        except interpreter.InterpreterError as exc:
            table.add_row(b.name, b.framework, b.launcher, interpreter.env_var(b.name), f"no: {exc}")
            continue
        pythons[source] = python
        ok, reason = b.availability(python)
        if ok:
            versions = interpreter.facts(python, b.requires, versions=True).versions
            known = ", ".join(f"{m} {v}" for m, v in versions.items() if v)
            reason = f" ({known})" if known else ""
        elif command := install_command(b, python):
            to_install[b.name] = command
        table.add_row(b.name, b.framework, b.launcher, source, f"yes{reason}" if ok else f"no: {reason}")
    console.print(table)
    print("interpreters: " + "; ".join(f"{source} = {python}" for source, python in pythons.items()))
    if to_install:
        print("not available here; the one command that installs each:")
        width = max(map(len, to_install))
        for name, command in to_install.items():
            print(f"  {name:<{width}}  {command}")
    table = Table(title="workloads")
    for col in ("workload", "parameters", "layers", "d_model", "heads", "seq_len", "vocab", "FLOPs/token"):
        table.add_column(col, justify="right")
    for name, s in PRESETS.items():
        table.add_row(
            name,
            f"{s.n_params:,}",
            str(s.n_layers),
            str(s.d_model),
            str(s.n_heads),
            str(s.seq_len),
            str(s.vocab_size),
            f"{s.flops_per_token:.3g}",
        )
    console.print(table)
    return EXIT_OK


def cmd_collect(args) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        raise UsageError(f"{run_dir}: not a run dir (no config.json); expected OUT/logs/<run_id>")
    for other in args.more:
        if not Path(other).is_dir():
            raise UsageError(f"{other}: no such directory")
        shutil.copytree(
            other,
            run_dir,
            dirs_exist_ok=True,
            ignore=lambda d, names, top=Path(other): ["config.json"] if Path(d) == top else [],
        )
    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    out_dir = run_dir.parent.parent
    record = write_record(get_backend(cfg.backend), cfg, out_dir, run_dir.name, wait=False)
    print_summary(record)
    print(record_line(record, out_dir / (record["run_id"] + ".json")))
    if record.get("unwritten"):
        return EXIT_FAILED
    return EXIT_OK if record["status"] == "ok" else EXIT_FAILED


def register(subparsers) -> None:
    run = subparsers.add_parser("run", help="launch one run and write its record")
    add_flags(run, "--backend", "--gpus", "--run-id")
    add_run_arguments(run)
    run.set_defaults(func=cmd_run)
    subparsers.add_parser("list", help="backends (with availability) and workloads").set_defaults(
        func=cmd_list
    )
    p = subparsers.add_parser(
        "collect",
        help="write a multi-node run's record from its run dir(s), e.g. "
        "after copying the nodes' run dirs together",
    )
    p.add_argument("run_dir", type=Path, help="OUT/logs/<run_id> on node 0 (the record goes to OUT)")
    p.add_argument(
        "more", nargs="*", type=Path, help="other nodes' copies of the run dir, merged into it first"
    )
    p.set_defaults(func=cmd_collect)
