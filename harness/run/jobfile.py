"""What the job-file writers share: `harness slurm` (harness.run.slurm) and `harness k8s`
(harness.run.kubeflow) both check here, before anything is submitted, the harness command a job will run,
with the multi-node layout the job adds to it (see harness.run.nodes), and write the file the same way.

Apart from either writer because it is the part that knows `harness run` and `harness sweep`, not a
scheduler.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.run import commands, sweep
from harness.run.nodes import LAYOUT_FLAGS
from harness.run.options import run_request
from harness.usage import Parser, UsageError


def command_parser() -> Parser:
    """The parsers of `harness run` and `harness sweep`, to check a job's command here."""
    parser = Parser(prog="harness")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    commands.register(sub)
    sweep.register(sub)
    return parser


def checked_command(command: str, harness_args: list[str], nodes: int, per_node: int):
    """Parse the harness command the job will run, with the layout the job adds, so bad input fails here
    and not on the cluster. Returns the parsed args."""
    given = [a.split("=", 1)[0] for a in harness_args]
    for flag in LAYOUT_FLAGS:
        if flag in given:
            raise UsageError(f"{flag} is set by the job from the scheduler's allocation: leave it out")
    if command == "sweep" and nodes > 1:
        raise UsageError(
            "a sweep runs within one node (--nodes 1): every run of a multi-node sweep would need "
            "its own agreed run id; submit one `harness slurm ... run` job per configuration instead"
        )
    layout = (
        [
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            str(per_node),
            "--node-rank",
            "0",
            "--master",
            "127.0.0.1:29500",
            "--hosts",  # the job gives every node's host (--hosts "$DISTBENCH_HOSTS" or the operator's)
            ",".join(f"node{i}" for i in range(nodes)),
            "--run-id",
            "check",
        ]
        if command == "run"
        else []
    )
    args = command_parser().parse_args([command, *harness_args, *layout])
    if command == "run":
        request = run_request(args)
        args.cfg = request.config(args.backend, request.world, check_devices=False)
    elif max(args.gpus) > per_node:
        raise UsageError(f"the sweep's largest N ({max(args.gpus)}) exceeds --gpus-per-node {per_node}")
    return args


def strip_separator(argv: list[str]) -> list[str]:
    return argv[1:] if argv[:1] == ["--"] else argv


def write_output(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    Path(path).write_text(text)
    print(f"wrote {path}", file=sys.stderr)
