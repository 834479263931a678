"""`harness plan`: what each node of a run would type and start, from the same launch plans the runner uses;
it writes nothing (the adapters' launch() is pure), so it works on a login node without the cluster."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from backends.base import LaunchPlan
from core.config import InvalidConfig
from core.process import REPO_ROOT
from harness.arguments import DEFAULT_MASTER_PORT, add_flags, add_run_arguments
from harness.run.nodes import check_run_id
from harness.run.options import run_request
from harness.run.record import traced_dir
from harness.run.runner import isolated_plans, measuring_config, new_run_id, node_plan
from harness.usage import EXIT_OK, UsageError


def node_command(argv: list[str], node_rank: int, run_id: str) -> list[str]:
    """The `harness run` command line for one node: the plan's own options, with this node's rank."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--node-rank", "--run-id"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return ["harness", "run", *out, "--node-rank", str(node_rank), "--run-id", run_id]


def plan_argv(argv: list[str]) -> list[str]:
    """The options given to `harness plan` (from its command line)."""
    return argv[argv.index("plan") + 1 :] if "plan" in argv else argv


def print_launch(plan: LaunchPlan, indent: str = "    ") -> None:
    for path, content in plan.files.items():
        print(f"{indent}file {path}:")
        print("".join(f"{indent}  | {line}\n" for line in content.splitlines()), end="")
    for proc in plan.processes:
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(proc.env.items()))
        print(f"{indent}env {env} \\\n{indent}  {shlex.join(proc.argv)}")


def print_settings(settings: dict) -> None:
    """The framework configuration the run will record (Backend.settings): an entry with a `summary` line
    (what it costs, e.g. tf-mwms's materialised attention) shows that line, any other its JSON."""
    if settings:
        print("settings (recorded as backend_info.settings):")
    for key, value in settings.items():
        summary = value.get("summary") if isinstance(value, dict) else None
        print(f"  {summary}" if summary else f"  {key}: {json.dumps(value, sort_keys=True)}")


def cmd_plan(args) -> int:
    request = run_request(args)
    world = request.world
    base = request.config(args.backend, world, check_devices=False, node_rank=0)
    backend = request.backend
    run_id = args.run_id or new_run_id(base)
    check_run_id(run_id, base, args.out)
    run_dir = (Path(args.out) / "logs" / run_id).resolve()
    topo = base.topology
    port = topo.master_port or DEFAULT_MASTER_PORT
    ok, reason = backend.availability(base.topology.python)
    print(
        f"plan: {backend.label(base)} · {base.model.workload} · {topo.nodes} node(s) x {topo.gpus_per_node} "
        f"rank(s) = {topo.world_size} ranks on {topo.device} · master {topo.master_addr}:{port} · "
        f"run id {run_id}"
    )
    if args.device == "auto":
        print(
            f"note: --device auto was resolved on this machine ({topo.device}); each node resolves it again "
            "when it runs, so plan for the target with --device cuda (or cpu): a plan made on a login node "
            "without GPUs describes a GPU run only when told"
        )
    if base.topology.nodes == 1 and not base.topology.master_port:
        print(f"(a one-node run picks a free port per run; {port} is shown)")
    if not ok:
        print(f"note: {backend.name} is unavailable on this machine: {reason}")
    print_settings(backend.settings(base))
    print(
        f"run dir: {run_dir} (shared by all nodes); "
        f"node 0 writes {Path(args.out).resolve() / (run_id + '.json')}"
    )
    for r in range(base.topology.nodes):
        cfg = measuring_config(backend, base.evolve(node_rank=r))
        host = (
            base.topology.hosts[r]
            if base.topology.hosts
            else ("this machine" if base.topology.nodes == 1 else f"node {r}")
        )
        print(f"\nnode {r} ({host}): run")
        print("  " + shlex.join(node_command(plan_argv(args.argv), r, run_id)))
        try:
            launch = node_plan(backend, cfg, run_dir, port)
            traced = (
                node_plan(backend, cfg.evolve(trace_launch="only"), traced_dir(run_dir), port)
                if cfg.role.trace_launch == "untraced"
                else None
            )
            isolated = (
                isolated_plans(backend, cfg, run_dir)
                if cfg.measurement.compute_method == "isolated" and world > 1
                else []
            )
        except (InvalidConfig, ValueError, OSError) as exc:  # an adapter that needs the cluster to plan
            raise UsageError(
                f"cannot plan node {r}: {backend.name}'s launch() failed here ({type(exc).__name__}: "
                f"{exc}); a plan runs launch() without the cluster and without a run dir"
            ) from None
        n = len(launch.processes)
        print(
            f"  which starts {n or 'no'} process(es) from {REPO_ROOT}"
            + (":" if n else " (this backend's launcher on node 0 starts this node's workers)")
        )
        print_launch(launch)
        if traced is not None:
            print(
                f"  then the collective trace, in a launch of its own that measures nothing "
                f"({backend.name}'s instrument costs time once enabled), which starts "
                f"{len(traced.processes) or 'no'} process(es)" + (":" if traced.processes else "")
            )
            print_launch(traced)
        if isolated:
            print(
                f"  then the isolated counterfactual, {len(isolated)} single-process worker(s) at once"
                + (", after node 0's launcher has exited" if backend.starts_remote_ranks and r else "")
                + ":"
            )
            for plan in isolated:
                print_launch(plan)
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="print each node's commands and environment for a run (dry run)")
    add_flags(p, "--backend", "--gpus", "--run-id")
    add_run_arguments(p)
    p.set_defaults(func=cmd_plan)
