"""`harness slurm`: the sbatch script that runs a distbench run or sweep on a Slurm cluster.

One task per node starts that node's harness with the multi-node options of `harness run` (see
harness.run.nodes), taken from Slurm's node list and SLURM_NODEID. Records land in --out in the submit
directory, on a filesystem every node shares; node 0's harness writes the run record there. What only
Slurm has is here: its time limit, fitted to the run's timeouts, and the CPUs and network settings the
job passes on; checking the job's command is harness.run.jobfile's, shared with `harness k8s`.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from backends import get_backend
from backends.base import network_settings
from core.process import REPO_ROOT
from harness.arguments import add_job_arguments, positive
from harness.run import sweep
from harness.run.jobfile import checked_command, strip_separator, write_output
from harness.run.runner import launches_in_turn
from harness.usage import EXIT_OK, UsageError

# Seconds a job needs beyond its runs' timeouts: starting the harness and the launchers, writing the
# record, and the early SIGTERM the script asks for (#SBATCH --signal=TERM@SIGTERM_LEAD_S).
SLURM_MARGIN_S = 120
SIGTERM_LEAD_S = 60
SLURM_TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def slurm_seconds(text: str) -> int:
    """A Slurm time limit (sbatch --time) in seconds."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    try:
        parts = [int(p) for p in rest.split(":")]
        day = int(days)
    except ValueError:
        raise UsageError(f"--time {text}: not a Slurm time limit; valid: {SLURM_TIME_FORMATS}") from None
    if "-" in text:  # D-HH[:MM[:SS]]
        if not 1 <= len(parts) <= 3:
            raise UsageError(f"--time {text}: not a Slurm time limit; valid: {SLURM_TIME_FORMATS}")
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        raise UsageError(f"--time {text}: not a Slurm time limit; valid: {SLURM_TIME_FORMATS}")
    seconds = ((day * 24 + h) * 60 + m) * 60 + s
    if seconds <= 0 or min(parts) < 0 or day < 0:
        raise UsageError(f"--time {text}: must be a positive time limit ({SLURM_TIME_FORMATS})")
    return seconds


def clock_text(seconds: float) -> str:
    seconds = int(seconds + 0.999)
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def sweep_measures_isolated(args) -> bool:
    """Whether any run of the sweep launches the isolated counterfactual: some N > 1 and, for some swept
    backend, --compute-method isolated or auto resolving to it (torch-ddp's and Paddle's auto is no_sync)."""
    if max(args.gpus) < 2 or args.compute_method == "none":
        return False
    for name in sweep.selected_backends(args.backends):
        backend = get_backend(name)
        methods = backend.compute_methods_for(backend.Options.from_args(args))
        if (methods[0] if args.compute_method == "auto" else args.compute_method) == "isolated":
            return True
    return False


def sweep_traces_apart(args) -> bool:
    """Whether any run of the sweep is traced in a launch of its own: some N > 1, tracing on, and a swept
    backend that traces apart (Backend.traces_in_own_launch)."""
    if max(args.gpus) < 2 or not args.trace_comm:
        return False
    return any(get_backend(name).traces_in_own_launch for name in sweep.selected_backends(args.backends))


def fit_time_limit(args, run_args, harness_args: list[str]) -> list[str]:
    """Make the job's time limit and the run's --timeout agree, before anything is submitted: the run's
    launches (its own, a traced one where the stack traces apart, and the isolated counterfactual's, each up
    to --timeout; harness.run.runner.launches_in_turn) plus SLURM_MARGIN_S must fit
    in --time. A --timeout given explicitly that cannot fit is refused; the default one is lowered to fit
    (returned as the run's options). A sweep is checked for one run (it resumes with --resume)."""
    limit = slurm_seconds(args.time)
    given = any(a.split("=", 1)[0] == "--timeout" for a in harness_args)
    timeout = run_args.timeout
    if args.command == "run":
        launches = launches_in_turn(get_backend(run_args.cfg.backend), run_args.cfg)
    else:  # its runs at N > 1 add the traced and isolated launches where a swept backend makes them
        launches = (
            1
            + sweep_traces_apart(run_args)
            + (run_args.isolated_repeats if sweep_measures_isolated(run_args) else 0)
        )
    needed = launches * timeout + SLURM_MARGIN_S
    if needed <= limit:
        return harness_args
    what = f"{launches} launch(es) x --timeout {timeout:.0f} s + {SLURM_MARGIN_S} s"
    what += " to start and write the record"
    if given or args.command == "sweep":
        raise UsageError(
            f"--time {args.time} ({limit} s) cannot hold the run: {what} = {needed:.0f} s; give --time >= "
            f"{clock_text(needed)} or a smaller --timeout"
        )
    fitted = (limit - SLURM_MARGIN_S) / launches
    if fitted < 60:
        raise UsageError(
            f"--time {args.time} ({limit} s) leaves {fitted:.0f} s per launch after {SLURM_MARGIN_S} s of "
            f"margin ({launches} launch(es)); give --time >= {clock_text(launches * 60 + SLURM_MARGIN_S)}"
        )
    return [*harness_args, "--timeout", f"{fitted:.0f}"]


# The least of the CPUs the job holds on each of its nodes, at job time.
JOB_CPUS = (
    'export DISTBENCH_CPUS=$(tr , "\\n" <<<"$SLURM_JOB_CPUS_PER_NODE" | sed "s/(.*//" | sort -n | head -n 1)'
)


def network_exports(environ=None) -> list[str]:
    """The network-interface settings (backends.base.NETWORK_SETTINGS) set where the job file is written,
    as lines that export them in the job unless the job's own environment (sbatch passes the submitting
    shell's) already sets them."""
    settings = network_settings(os.environ if environ is None else environ)
    if not settings:
        return []
    return [
        "# The network interface NCCL and Gloo use, as set where this file was written",
        *(f"export {k}=${{{k}:-{shlex.quote(v)}}}" for k, v in settings.items()),
    ]


def sbatch_script(args, harness_args: list[str]) -> str:
    """One task per node; each runs the harness for its node (SLURM_NODEID) with the allocation's hosts, the
    first host as master on a port derived from the job id (two jobs sharing a node do not collide)."""
    harness = [*shlex.split(args.harness), args.command, *harness_args]
    head = [
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={args.time}",
        # SIGTERM a minute before the limit: the harness stops its ranks and writes the record (as it does on
        # the SIGTERM at the limit, with KillWait's grace before SIGKILL)
        f"#SBATCH --signal=TERM@{SIGTERM_LEAD_S}",
        "#SBATCH --output=distbench-%j.out",
    ]
    if args.gpus_per_node and not args.cpu:
        head.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    head += [
        f"#SBATCH --{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("partition", "account", "cpus_per_task")
        if getattr(args, k)
    ]
    if not args.cpus_per_task:  # whole nodes: every CPU of each node for its harness and its ranks
        head.append("#SBATCH --exclusive")
    lines = [
        "#!/bin/bash",
        f"# distbench {args.command} on {args.nodes} node(s), written by `harness slurm`. "
        "Submit with: sbatch <this file>",
        *head,
        "set -euo pipefail",
        f"cd {shlex.quote(str(args.workdir))}",
        *network_exports(),
        "# Each node's one task (its harness, which shares the CPUs out among its ranks) gets every CPU the",
        "# job holds on the node: srun gives a task one CPU unless told, and since Slurm 22.05 it no longer",
        "# inherits sbatch's --cpus-per-task. The least over the nodes (SLURM_JOB_CPUS_PER_NODE: 64(x2),32).",
        f"export DISTBENCH_CPUS={args.cpus_per_task}" if args.cpus_per_task else JOB_CPUS,
    ]
    if args.command == "sweep":
        lines += [
            "# A sweep runs its launches one after another on this node; resubmit with --resume added to",
            "# finish one that was cut short (runs recorded ok are not run again).",
            f'srun --nodes=1 --ntasks=1 --cpus-per-task="$DISTBENCH_CPUS" {shlex.join(harness)}',
        ]
        return "\n".join(lines) + "\n"
    node_cmd = (
        f"exec {shlex.join(harness)} --nodes {args.nodes} --gpus-per-node {args.gpus_per_node} "
        '--hosts "$DISTBENCH_HOSTS" --master "$DISTBENCH_MASTER" --node-rank "$SLURM_NODEID" '
        '--run-id "$DISTBENCH_RUN_ID"'
    )
    lines += [
        "# Every node gets the same layout and run id; node ranks follow the order of the node list.",
        'export DISTBENCH_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
        'export DISTBENCH_MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
        ":$((20000 + SLURM_JOB_ID % 20000))",
        'export DISTBENCH_RUN_ID="slurm-$SLURM_JOB_ID"',
        "# Node 0's harness writes the run record once every node's ranks have written theirs.",
        f'srun --nodes={args.nodes} --ntasks-per-node=1 --cpus-per-task="$DISTBENCH_CPUS" '
        f"--kill-on-bad-exit=0 bash -c {shlex.quote(node_cmd)}",
    ]
    return "\n".join(lines) + "\n"


def cmd_slurm(args) -> int:
    harness_args = strip_separator(args.harness_args)
    run_args = checked_command(args.command, harness_args, args.nodes, args.gpus_per_node)
    harness_args = fit_time_limit(args, run_args, harness_args)
    args.cpu = getattr(run_args, "device", "auto") == "cpu"
    write_output(args.output, sbatch_script(args, harness_args))
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("slurm", help="write an sbatch script for a run (one task per node) or a sweep")
    add_job_arguments(p)
    p.add_argument(
        "--time",
        default="01:00:00",
        help="the job's time limit; it must hold the run's launches x --timeout plus 2 minutes (the "
        "default --timeout is lowered to fit; one given explicitly that does not fit is refused)",
    )
    p.add_argument("--job-name", default="distbench")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--cpus-per-task", type=positive, help="CPUs for each node's harness and its workers")
    p.add_argument(
        "--workdir", type=Path, default=REPO_ROOT, help="the repo on the cluster's shared filesystem"
    )
    p.add_argument(
        "--harness", default=".venv/bin/harness", help="the harness command there (from --workdir)"
    )
    p.add_argument("command", choices=("run", "sweep"))
    p.add_argument(
        "harness_args", nargs=argparse.REMAINDER, help="the options of `harness run` or `harness sweep`"
    )
    p.set_defaults(func=cmd_slurm)
