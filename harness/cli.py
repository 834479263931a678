"""`harness` command line: builds the parser from the command modules and dispatches. Nothing imports it.

Each command module defines `register(subparsers)` and sets `func` on its parsers; usage errors and exit
codes are harness.usage's.
"""

from __future__ import annotations

import importlib
import os
import sys

from harness.usage import EXIT_OK, EXIT_USAGE, Parser, UsageError

# Every command and the module that registers it, in the order `harness --help` lists them. Only the module
# of the command given is imported: the analysis and prediction modules import pandas and scipy, about
# 0.6 s that every `harness run` would otherwise pay. `harness --help` (or no command) imports them all.
COMMANDS = {
    "run": "harness.run.commands",
    "list": "harness.run.commands",
    "collect": "harness.run.commands",
    "commbench": "harness.run.commbench",
    "sweep": "harness.run.sweep",
    "report": "harness.analyze.report",
    "results": "harness.analyze.report",
    "compare": "harness.analyze.compare_command",
    "gate": "harness.gate.command",
    "baseline": "harness.analyze.baseline",
    "history": "harness.analyze.history",
    "check": "harness.analyze.check",
    "trace": "harness.analyze.trace",
    "plan": "harness.run.plan",
    "slurm": "harness.run.slurm",
    "k8s": "harness.run.kubeflow",
    "doctor": "harness.run.doctor",
    "env": "harness.run.environment",
    "predict": "harness.predict.command",
    "select": "harness.select.command",
}


def make_parser(command: str | None = None) -> Parser:
    """The parser of `command` alone when it is one (its module imported), else of every command."""
    parser = Parser(prog="harness", description="distbench: one model, six distributed-training stacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(argv=None) -> int:
    code = EXIT_OK
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = make_parser(argv[0] if argv else None).parse_args(argv)
        args.argv = argv
        code = args.func(args)
        sys.stdout.flush()  # a reader that hung up shows here, not as a traceback at exit
        return code
    except UsageError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("harness: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `harness plan ... | head`: the reader had enough; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail
        return code
