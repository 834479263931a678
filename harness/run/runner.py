"""One run end to end: launch this node's workers, then its share of the isolated counterfactual, then on
node 0 have harness.run.record write ONE run record.

The ranks' event streams stay with their logs in out_dir/logs/<run_id>/. A multi-node run has one harness
per node, each launching its own ranks into that shared run dir; node 0 writes the record (see
harness.run.nodes). What the record holds, and how a failed run is classified, is harness.run.record's.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

from backends.base import Backend, LaunchPlan
from backends.loop import anatomy_steps
from core.config import RunConfig
from core.events import MEASURED, events_path
from core.hooks import NO_HOOKS, TestHooks
from core.process import REPO_ROOT, free_port
from core.records import now_iso, write_atomic, write_json_atomic
from harness.run.devices import isolated_devices, node_devices
from harness.run.launch import LaunchResult, run_processes
from harness.run.nodes import finish_node, node_log, ranks_launched, start_node, wait_for_ranks
from harness.run.progress import NO_DISPLAY, NoDisplay, RunDisplay
from harness.run.record import gather_ranks, isolated_dir, measured_before_failure, traced_dir, write_record


def new_run_id(cfg: RunConfig) -> str:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    what = "commbench" if cfg.role.commbench else cfg.model.workload
    return f"{stamp}-{cfg.backend}-{what}-n{cfg.topology.world_size}-{uuid.uuid4().hex[:6]}"


def node_plan(backend: Backend, cfg: RunConfig, run_dir: Path, port: int) -> LaunchPlan:
    """What THIS node starts for its ranks: the adapter's launch on the devices the runner gives them."""
    return backend.launch(cfg, run_dir, port, node_devices(cfg))


def isolated_plans(backend: Backend, cfg: RunConfig, run_dir: Path, repeat: int = 0) -> list[LaunchPlan]:
    """What THIS node starts for one launch of the isolated counterfactual: one single-process worker per
    local rank, each on the device and data shard of the rank it stands for, in its own dir and config."""
    plans = []
    for k in range(cfg.first_local_rank, cfg.first_local_rank + cfg.topology.gpus_per_node):
        iso = cfg.evolve(isolated_index=k)
        iso_dir = isolated_dir(run_dir, k, repeat)
        plan = backend.launch(iso, iso_dir, free_port(), isolated_devices(cfg, k))
        plan.files[iso_dir / "config.json"] = iso.to_json()
        plans.append(plan)
    return plans


def ranks_launches(backend: Backend, cfg: RunConfig) -> int:
    """The launches of the run's ranks, one after the other: the one that measures, and the traced one
    where the stack traces in a launch of its own."""
    return 1 + (measuring_config(backend, cfg).role.trace_launch == "untraced")


def launches_in_turn(backend: Backend, cfg: RunConfig) -> int:
    """The launches a run makes one after another, each up to --timeout: its ranks' (ranks_launches), then
    the isolated counterfactual's repeats."""
    isolated = cfg.measurement.compute_method == "isolated" and cfg.topology.world_size > 1
    return ranks_launches(backend, cfg) + (cfg.measurement.isolated_repeats if isolated else 0)


def write_files(files: dict[Path, str]) -> None:
    for path, content in files.items():
        write_atomic(path, lambda tmp, content=content: tmp.write_text(content))


def measuring_config(backend: Backend, cfg: RunConfig) -> RunConfig:
    """The config of the launch that measures: for a stack whose trace instrument costs time once enabled
    (Backend.traces_in_own_launch), one that traces nothing, the trace being taken by run_traced."""
    traced = cfg.measurement.trace_comm and cfg.measurement.trace_steps and cfg.topology.world_size > 1
    if backend.traces_in_own_launch and traced and not cfg.role.commbench:
        return cfg.evolve(trace_launch="untraced")
    return cfg


def launch_node(backend: Backend, cfg: RunConfig, run_dir: Path, hooks: TestHooks = NO_HOOKS) -> LaunchResult:
    """Start THIS node's launcher (the whole run on one node) and wait for it. Every node writes the same
    config.json (the run's, as node 0 sees it), atomically, since on a shared filesystem they share it, and
    the test hooks where any is set."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", cfg.evolve(node_rank=0).to_dict())
    hooks.write(run_dir)
    plan = node_plan(backend, cfg, run_dir, cfg.topology.master_port or free_port())
    write_files(plan.files)
    return run_processes(
        plan.processes,
        node_log(run_dir, cfg, "launcher"),
        cfg.measurement.timeout_s,
        cwd=REPO_ROOT,
        leftovers=plan.leftovers,
    )


def run_isolated(
    backend: Backend,
    cfg: RunConfig,
    run_dir: Path,
    display: RunDisplay | NoDisplay = NO_DISPLAY,
    hooks: TestHooks = NO_HOOKS,
) -> str | None:
    """The isolated counterfactual: N independent single-process workers started at the same time, each
    on the data shard of one rank, so they contend for the machines as the real run does but never talk;
    launched measurement.isolated_repeats times, one launch after the other, since launch-to-launch variation
    (process placement, allocator state) is as large as the effect measured. Each node runs the workers
    standing for its own ranks; returns an error message if they failed."""
    workers_hooks = isolated_hooks(backend, cfg, hooks)
    for repeat in range(cfg.measurement.isolated_repeats):
        plans = isolated_plans(backend, cfg, run_dir, repeat)
        display.phase(
            "isolated counterfactual",
            events=events_path(isolated_dir(run_dir, cfg.first_local_rank, repeat), 0),
            total=cfg.measurement.warmup
            + cfg.measurement.steps
            + anatomy_steps(cfg.evolve(isolated_index=0), can_skip_grad_sync=False),
            detail=f"(launch {repeat + 1}/{cfg.measurement.isolated_repeats})",
        )
        for plan in plans:
            write_files(plan.files)
        for k in range(cfg.first_local_rank, cfg.first_local_rank + cfg.topology.gpus_per_node):
            workers_hooks.write(isolated_dir(run_dir, k, repeat))
        result = run_processes(
            [proc for plan in plans for proc in plan.processes],
            node_log(run_dir, cfg, "isolated"),
            cfg.measurement.timeout_s,
            cwd=REPO_ROOT,
            leftovers=[pattern for plan in plans for pattern in plan.leftovers],
        )
        if not result.ok:
            return (
                f"isolated counterfactual launch {repeat + 1} failed on node {cfg.topology.node_rank} "
                f"(exit codes "
                f"{result.returncodes}); see {run_dir}"
            )
    return None


def isolated_hooks(backend: Backend, cfg: RunConfig, hooks: TestHooks) -> TestHooks:
    """The test hooks of an isolated worker. A delayed optimizer stands for optimizer work over the
    parameters a rank steps: an isolated worker of a stack that shards its optimizer steps all P where a
    rank steps P/N, so it sleeps N times the delay, as t_compute's discount assumes of real optimizer work."""
    if backend.sharding(cfg) == "none":
        return hooks
    return hooks.scaled("optimizer", cfg.topology.world_size)


def run_traced(
    backend: Backend,
    cfg: RunConfig,
    run_dir: Path,
    display: RunDisplay | NoDisplay = NO_DISPLAY,
) -> None:
    """The collective trace in a launch of its own, after the one that measured: the warm-up, then the
    traced steps (backends.loop.training_phases), into traced_dir, without the test hooks (a fault or delay
    injected into the measured steps is no part of it). Its failure costs the record its trace only:
    write_record says so in each rank's comm_trace."""
    traced = cfg.evolve(trace_launch="only")
    display.phase(
        "collective trace (a launch of its own)",
        events=events_path(traced_dir(run_dir), 0),
        total=cfg.measurement.warmup + cfg.measurement.trace_steps,
    )
    launch_node(backend, traced, traced_dir(run_dir))


def execute(
    backend: Backend,
    cfg: RunConfig,
    out_dir: Path,
    argv: list[str],
    sweep: dict | None = None,
    run_id: str | None = None,
    display: RunDisplay | NoDisplay = NO_DISPLAY,
    hooks: TestHooks = NO_HOOKS,
    annotations: dict | None = None,
) -> dict:
    """Run node 0's share of `cfg` (all of a one-node run), then write the run record to
    out_dir/<run_id>.json and return it; another node's harness calls run_node (node 0 writes the record).
    `sweep` ({"id", "repeat"}) ties the run to the sweep that launched it; None for a single `harness run`.
    `display` is told each phase. `hooks`: test hooks for the workers (core.hooks), never in real use.
    `annotations`: what the command decided before the run, for the record's top level (how `--micro-batch
    max` chose, harness.run.fill)."""
    if cfg.topology.nodes > 1 and not run_id:
        raise ValueError("a multi-node run needs a run id every node agrees on; a random one would split it")
    if cfg.topology.node_rank != 0:
        raise ValueError("execute() runs node 0; another node calls run_node and writes no record")
    run_id = run_id or new_run_id(cfg)
    cfg = measuring_config(backend, cfg)
    run_node(backend, cfg, Path(out_dir) / "logs" / run_id, argv, display, hooks)
    display.phase("writing the record")
    return write_record(backend, cfg, Path(out_dir), run_id, sweep=sweep, annotations=annotations)


def run_node(
    backend: Backend,
    cfg: RunConfig,
    run_dir: Path,
    argv: list[str],
    display: RunDisplay | NoDisplay = NO_DISPLAY,
    hooks: TestHooks = NO_HOOKS,
) -> dict:
    """Launch this node's ranks, then where the stack traces in a launch of its own that launch, then its
    share of the isolated counterfactual; returns its node marker."""
    run_dir = run_dir.absolute()  # the workers start in the package's folder, `--out` is the user's
    cfg = measuring_config(backend, cfg)
    marker = start_node(cfg, run_dir, argv, now_iso())
    display.phase("launching", events=events_path(run_dir, 0))
    result = launch_node(backend, cfg, run_dir, hooks)
    per_node = cfg.topology.world_size // cfg.topology.nodes
    node_ranks = (  # the ranks this node's launcher ran: every rank where node 0's starts them all
        range(cfg.topology.world_size)
        if backend.starts_remote_ranks and cfg.topology.node_rank == 0
        else range(cfg.topology.node_rank * per_node, (cfg.topology.node_rank + 1) * per_node)
    )
    measured = result.ok or (
        measured_before_failure(
            result,
            gather_ranks(run_dir, cfg.topology.world_size),
            gather_ranks(run_dir, cfg.topology.world_size, MEASURED),
            node_ranks,
        )
        is not None
    )
    if measured and result.ok and cfg.role.trace_launch == "untraced":  # before the ranks count as done
        run_traced(backend, cfg, run_dir, display)  # (a launcher that starts other nodes' ranks runs it)
    marker = ranks_launched(run_dir, marker, result, measured)
    isolated_error = None
    if measured and cfg.measurement.compute_method == "isolated" and cfg.topology.world_size > 1:
        # Where node 0's launcher runs this node's ranks too, they may still be running: wait for them.
        if backend.starts_remote_ranks and cfg.topology.node_rank != 0:  # and its traced launch after them
            launches = ranks_launches(backend, cfg)
            isolated_error = wait_for_ranks(run_dir, 0, launches * cfg.measurement.timeout_s)
        isolated_error = isolated_error or run_isolated(backend, cfg, run_dir, display, hooks)
    return finish_node(run_dir, marker, result, isolated_error)
