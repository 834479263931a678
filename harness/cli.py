"""`harness` command line: builds the parser from the command modules and dispatches. Nothing imports it.

Each command module defines `register(subparsers)` and sets `func` on its parsers; usage errors and exit
codes are harness.usage's.
"""

from __future__ import annotations

import os
import sys

from harness.analyze import baseline, compare, history, report
from harness.predict import command as predict
from harness.run import commands, commbench, doctor, plan, schedulers, sweep
from harness.usage import EXIT_OK, EXIT_USAGE, Parser, UsageError

COMMAND_MODULES = (
    commands,
    commbench,
    sweep,
    report,
    compare,
    baseline,
    history,
    plan,
    schedulers,
    doctor,
    predict,
)


def make_parser() -> Parser:
    parser = Parser(prog="harness", description="distbench: one model, six distributed-training stacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv=None) -> int:
    code = EXIT_OK
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = make_parser().parse_args(argv)
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
