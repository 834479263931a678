"""The run record: ONE JSON record of a run, built from what its ranks left in the run dir (their event
streams, logs and the nodes' markers), written for every outcome (ok | failed | crashed | oom | timeout),
atomically, under `out_dir`.

Apart from harness.run.runner, which launches the ranks, because the record comes from files alone: node 0
writes it after its launch (runner.execute), `harness collect` writes it for a run whose node 0 was stopped,
and tests assemble records from hand-made ranks the same way (assemble_record is pure). Here the ranks'
event streams (core.events) are folded into rank records, a failed run's cause is told from its effects
(classify), what the ranks had measured before a late failure is kept, and the summary is computed by
harness.analyze.metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import socket
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from backends import all_backends
from backends.base import Backend
from backends.loop import TRACE_LOST
from core.config import RunConfig
from core.events import MEASURED, RESULT, events_path, rank_record, read_events
from core.hooks import TestHooks
from core.process import available_cpus
from core.records import SCHEMA_VERSION, git_commit, now_iso, write_record_atomic
from harness.analyze.metrics import summarize
from harness.run.launch import LaunchResult
from harness.run.nodes import absent_nodes, merged_launch, read_markers, wait_for_nodes

LOG_TAIL_LINES = 30


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def gather_ranks(run_dir: Path, world: int, checkpoint: str = RESULT) -> dict[int, dict]:
    """The rank records the ranks' event streams give (core.events.rank_record): each rank's result, or
    with checkpoint MEASURED what it had measured before or after its collective trace. A rank whose
    stream holds no such event is left out."""
    ranks = {}
    for r in range(world):
        record = rank_record(read_events(events_path(run_dir, r)), checkpoint)
        if record is not None:
            ranks[r] = record
    return ranks


def trace_lost(rank: dict) -> bool:
    """Whether a rank's record is the one it wrote before its trace (the trace never finished)."""
    return ((rank.get("comm_trace") or {}).get("reason") or "").startswith(TRACE_LOST)


def measured_before_failure(
    result: LaunchResult, ranks: dict[int, dict], measured: dict[int, dict], rank_ids
) -> dict[int, dict] | None:
    """The ranks to keep when a run failed only after every rank had measured: each rank's final record
    where it is ok, else the last record it wrote before that: with its trace where the rank died tearing
    down, else from before its trace, whose trace then says it was lost and how the rank ended. None where
    any rank failed before that (its measured steps are incomplete), or the run was timed out or stopped
    from outside (then nothing about it is trusted)."""
    if result.timed_out or result.stopped:
        return None
    kept = {}
    for r in rank_ids:
        final = ranks.get(r)
        if final and final.get("status") == "ok":
            kept[r] = final
        elif r in measured:
            trace = measured[r].get("comm_trace") or {}
            if not trace_lost(measured[r]):  # it died tearing down, its trace done (or its stack has none)
                kept[r] = measured[r]
                continue
            how = (final or {}).get("error") or "it exited without a record (killed, or died in native code)"
            how = how.strip().splitlines()[0][:200]  # the whole error is in the rank's log
            kept[r] = {**measured[r], "comm_trace": {**trace, "reason": f"{trace['reason']}: {how}"}}
        else:
            return None
    return kept


# How a rank's error says it failed because of another rank rather than on its own (matched
# case-insensitively): it gave up waiting in a collective, or lost its connection. These are the words of
# what every stack's ranks talk through (the OS's sockets, gloo, NCCL); each framework's own wording is its
# adapter's (Backend.peer_timeout_texts, peer_lost_texts).
PEER_TIMEOUT = ("timed out", "timeout")
PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "socket closed",
)


@functools.cache
def peer_failure_texts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(timeout, lost) words: the transports' and every registered stack's. A rank's record does not name
    its stack, and each stack's words are its framework's own (an error class, a library's message), so
    matching against all of them classifies every stack's ranks as matching against their own would."""
    stacks = all_backends()
    return (
        PEER_TIMEOUT + tuple(t for b in stacks for t in b.peer_timeout_texts),
        PEER_LOST + tuple(t for b in stacks for t in b.peer_lost_texts),
    )


def failure_kind(rec: dict) -> str | None:
    """'stopped' (SIGTERM from outside), 'timeout'/'lost' (waited on a peer), or None: failed on its own."""
    if rec.get("terminated"):
        return "stopped"
    text = (rec.get("error") or "").lower()
    timeout, lost = peer_failure_texts()
    if any(m in text for m in timeout):
        return "timeout"
    return "lost" if any(m in text for m in lost) else None


def classify(
    result: LaunchResult, ranks: dict[int, dict], world: int, run_dir: Path
) -> tuple[str, dict | None]:
    """The run's status and, if it failed, the rank that caused it and its last log lines.

    Ranks fail in a cascade, so the cause is told from the effects: a rank stopped from outside or whose
    error says it waited for a peer is an effect. In order: the run's own timeout (its kill causes every
    other symptom); the earliest rank that failed on its own (failed/oom); ranks that gave up waiting in a
    collective: timeout, blaming the rank they waited for (one that was busy elsewhere, or left no record);
    a rank that left no record (killed, segfault, OOM killer): crashed.
    """
    missing = [r for r in range(world) if r not in ranks]
    failed = [r for r in sorted(ranks) if ranks[r].get("status") != "ok"]
    unfinished = sorted(missing + failed)
    kind = {r: failure_kind(ranks[r]) for r in failed}

    def first(rs):
        return min(rs, key=lambda r: ranks[r].get("failed_at", float("inf")))

    def result_for(status, r, message, **extra):
        tail = log_tail(run_dir / f"rank{r}.log") if r is not None else []
        return status, {
            "rank": r,
            "message": message,
            **extra,
            "log_tail": tail or log_tail(run_dir / "launcher.log"),
        }

    if result.stopped:  # the harness was stopped from outside (a scheduler's time limit, scancel, kill)
        return result_for(
            "timeout",
            None,
            f"the harness was stopped after {result.elapsed_s:.0f} s by {result.stopped}; ranks "
            f"{unfinished} had not finished",
            unfinished_ranks=unfinished,
            stopped_by=result.stopped,
        )
    if result.timed_out:  # who hung is not knowable from outside: every rank waits on the hung one
        return result_for(
            "timeout",
            unfinished[0] if len(unfinished) == 1 else None,
            f"run exceeded its timeout after {result.elapsed_s:.0f} s; ranks {unfinished} had not finished",
            unfinished_ranks=unfinished,
        )
    own = [r for r in failed if kind[r] is None]
    if own:
        r = first(own)
        return result_for(ranks[r]["status"], r, ranks[r].get("error"))
    waited = [r for r in failed if kind[r] == "timeout"]
    if waited:
        culprits = [r for r in failed if kind[r] == "stopped"] + missing
        return result_for(
            "timeout",
            (culprits or waited)[0],
            f"rank(s) {waited} gave up waiting in a collective for rank(s) {culprits or '?'} "
            f"({ranks[first(waited)].get('error')})",
            unfinished_ranks=unfinished,
        )
    if missing:
        return result_for(
            "crashed",
            missing[0],
            f"rank(s) {missing} exited without a record (killed, or died in "
            f"native code); launcher exit codes {result.returncodes}",
        )
    if failed:
        r = first(failed)
        return result_for(ranks[r]["status"], r, ranks[r].get("error"))
    return "ok", None


def traced_dir(run_dir: Path) -> Path:
    """Where a stack that traces in a launch of its own (Backend.traces_in_own_launch) runs that launch."""
    return run_dir / "traced"


def with_own_launch_traces(ranks: dict[int, dict], run_dir: Path, world: int) -> dict[int, dict]:
    """The measuring launch's ranks, each with the trace its rank took in the traced launch, or, where
    that launch recorded none, a trace that says so."""
    traced = gather_ranks(traced_dir(run_dir), world)
    lost = {"method": None, "reason": f"the traced launch recorded no trace; see {traced_dir(run_dir)}"}
    return {
        r: {**rank, "comm_trace": (traced.get(r) or {}).get("comm_trace") or lost}
        for r, rank in ranks.items()
    }


def isolated_dir(run_dir: Path, index: int, repeat: int) -> Path:
    return run_dir / (f"isolated{index}" if repeat == 0 else f"isolated{index}-r{repeat}")


# The series of an isolated worker's anatomy steps (backends.loop.training_phases), joined over its launches.
ANATOMY_SERIES = ("anatomy_step_times", "forward_times", "backward_times", "optimizer_step_times")


def gather_isolated(
    run_dir: Path, cfg: RunConfig, markers: list[dict | None]
) -> tuple[list[dict], str | None]:
    """One record per isolated worker k, its launches' steps joined (each launch's median kept, so the
    spread between launches shows)."""
    errors = [m["isolated_error"] for m in markers if m and m.get("isolated_error")]
    records = []
    for k in range(cfg.topology.world_size):
        launched = [
            gather_ranks(isolated_dir(run_dir, k, r), 1).get(0)
            for r in range(cfg.measurement.isolated_repeats)
        ]
        launches = [rec for rec in launched if rec is not None and rec.get("status") == "ok"]
        if errors or len(launches) < len(launched):
            return [], "; ".join(
                errors
            ) or f"isolated counterfactual records missing or failed; see {run_dir}"
        merged = dict(launches[0])
        for key in ("step_times", *ANATOMY_SERIES):
            merged[key] = [t for rec in launches for t in rec.get(key) or []]
        merged["launch_median_step_times"] = [statistics.median(rec["step_times"]) for rec in launches]
        records.append(merged)
    return records, None


def environment(cfg: RunConfig, ranks: list[dict], argv: list[str], started: str | None) -> dict:
    first = next((r for r in ranks if r.get("versions")), {})
    devices = sorted({r["device"] for r in ranks if r.get("device")})
    return {
        "device_type": cfg.topology.device,
        "device_kind": devices[0] if len(devices) == 1 else (", ".join(devices) or None),
        "device_names": [r.get("device") for r in ranks],
        "hostnames": sorted({r["host"] for r in ranks if r.get("host")}),
        "world_size": cfg.topology.world_size,
        "threads_per_worker": cfg.topology.threads_per_worker,
        "process_settings": first.get("process_settings"),  # as rank 0 got them
        "harness_host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpus_available": available_cpus(),  # what this node's workers may use (affinity, cgroup quota)
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": first.get("versions", {}),
        "git": git_commit(),
        "command_line": argv,
        "start_time": started,
        "end_time": now_iso(),
    }


def write_record(
    backend: Backend,
    cfg: RunConfig,
    out_dir: Path,
    run_id: str,
    wait: bool = True,
    sweep: dict | None = None,
    annotations: dict | None = None,
) -> dict:
    """Node 0: gather every node's ranks (waiting for the nodes still running unless `wait` is False),
    classify, and write the ONE run record (with `annotations` at its top level)."""
    run_dir = Path(out_dir) / "logs" / run_id
    markers = wait_for_nodes(run_dir, cfg) if wait else read_markers(run_dir, cfg.topology.nodes)
    result = merged_launch(markers)
    ranks = gather_ranks(run_dir, cfg.topology.world_size)
    status, error = classify(result, ranks, cfg.topology.world_size, run_dir)
    if error and len(ranks) < cfg.topology.world_size and (absent := absent_nodes(markers)):
        error["message"] += "; " + absent
    incident = None
    if status != "ok" and error is not None and not cfg.role.commbench:  # a failure comes with its error
        measured = gather_ranks(run_dir, cfg.topology.world_size, MEASURED)
        kept = measured_before_failure(result, ranks, measured, range(cfg.topology.world_size))
        if kept is not None:  # every rank had measured: the failure came after, recorded as such
            culprit = error.get("rank")
            lost = trace_lost(kept[culprit]) if culprit in kept else any(map(trace_lost, kept.values()))
            phase = "collective trace" if lost else "teardown"
            ranks, incident = kept, {"phase": phase, "status": status, **error}
            status, error = "ok", None

    if status == "ok" and cfg.role.trace_launch == "untraced":
        ranks = with_own_launch_traces(ranks, run_dir, cfg.topology.world_size)
    isolated: list[dict] = []
    comm_error: str | None = None
    if status == "ok" and cfg.measurement.compute_method == "isolated" and cfg.topology.world_size > 1:
        isolated, comm_error = gather_isolated(run_dir, cfg, markers)
    node0 = markers[0] or {}
    rank_list = [ranks[r] for r in sorted(ranks)]
    assemble = assemble_commbench_record if cfg.role.commbench else assemble_record
    record = assemble(
        backend,
        cfg,
        run_id,
        rank_list,
        status=status,
        error=error,
        isolated_ranks=isolated,
        comm_error=comm_error,
        incident=incident,  # a commbench record takes none (assemble_commbench_record drops it)
        launch={
            "returncodes": result.returncodes,
            "elapsed_s": result.elapsed_s,
            "log_dir": str(run_dir),
            "nodes": markers,
        },
        environment=environment(cfg, rank_list, node0.get("argv", []), node0.get("started")),
        sweep=sweep,
        test_hooks=TestHooks.read(run_dir).to_dict(),
    )
    return save_record({**record, **(annotations or {})}, Path(out_dir) / f"{run_id}.json")


def save_record(record: dict, path: Path) -> dict:
    """Write the record atomically to `path`. Where that fails (the results filesystem full, read-only, or
    over quota) nothing half-written is left there and no earlier record is touched: the record is kept in
    the temp dir instead, and `record["unwritten"]` says why and where, for the command to report."""
    try:
        write_record_atomic(path, record)
    except OSError as exc:
        kept = Path(tempfile.gettempdir()) / "distbench-unwritten" / path.name
        record["unwritten"] = {"path": str(path), "error": exc.strerror or str(exc), "kept_at": str(kept)}
        try:
            write_record_atomic(kept, record)
        except OSError as again:
            record["unwritten"]["kept_at"] = None
            record["unwritten"]["error"] += f"; not kept either ({again.strerror or again})"
    return record


def record_line(record: dict, path: Path) -> str:
    """Where the record is, or why it is not where asked."""
    lost = record.get("unwritten")
    if not lost:
        return f"record: {path}"
    where = f"kept at {lost['kept_at']}" if lost["kept_at"] else "not kept anywhere"
    return f"record: NOT written to {lost['path']} ({lost['error']}); {where}"


def tuned_settings(backend: Backend, cfg: RunConfig) -> dict:
    """A tuned run's tuned set as applied: each setting's value in this run (a flag given by hand wins over
    the tuned value, and says so), its source, and whether it changes the floating-point result. Empty for
    a default run."""
    if cfg.variant != "tuned":
        return {}
    options = cfg.backend_options
    return {
        name: {**setting.to_dict(), "value": options.get(name), "tuned_value": setting.value}
        for name, setting in backend.tuned(cfg).items()
    }


def assemble_record(
    backend: Backend,
    cfg: RunConfig,
    run_id: str,
    ranks: list[dict],
    *,
    status: str = "ok",
    error: dict | None = None,
    isolated_ranks: Sequence[dict] = (),
    comm_error: str | None = None,
    incident: dict | None = None,
    launch: dict | None = None,
    environment: dict | None = None,
    sweep: dict | None = None,
    test_hooks: dict | None = None,
) -> dict:
    """THE run record, from the raw rank records and what the runner saw; pure, so tests build records the
    same way the runner does. The summary is computed by harness.analyze.metrics from the raw records.
    `incident`: a failure after every rank had measured (a rank that died while tracing), which leaves the
    run ok and is recorded as what happened (phase, rank, message, last log lines). `test_hooks`: the
    hooks the workers ran with (core.hooks), None in real use, at the top level so that a faulted or
    slowed run is never taken for a real one."""
    comm = {"t_compute_method": cfg.measurement.compute_method if cfg.topology.world_size > 1 else "none"}
    if comm_error:
        comm["error"] = comm_error
    record = {
        "schema_version": SCHEMA_VERSION,
        "kind": "training",
        "run_id": run_id,
        "status": status,
        "test_hooks": test_hooks,
        "error": error,
        "incident": incident,
        "config": cfg.to_dict(),
        "backend_info": {
            "label": backend.label(cfg),
            "framework": backend.framework,
            "launcher": backend.launcher,
            "sharding": backend.sharding(cfg),
            "precision_scheme": backend.precision_scheme(cfg),
            "comm_pattern": dataclasses.asdict(backend.comm_pattern(cfg)),
            "settings": backend.settings(cfg),
            "variant": cfg.variant,
            "tuned": tuned_settings(backend, cfg),
        },
        "launch": launch or {},
        "comm": comm,
        "ranks": list(ranks),
        "isolated_ranks": list(isolated_ranks),
        "environment": environment or {},
        "sweep": sweep,
    }
    try:
        record["summary"] = summarize(record)
    except Exception as exc:  # noqa: BLE001 - the raw ranks are the result; never lose them to an analysis bug
        record["summary"] = {"error": f"{type(exc).__name__}: {exc}"}
    return record


def assemble_commbench_record(
    backend: Backend,
    cfg: RunConfig,
    run_id: str,
    ranks: list[dict],
    *,
    status: str = "ok",
    error: dict | None = None,
    launch: dict | None = None,
    environment: dict | None = None,
    sweep: dict | None = None,
    test_hooks: dict | None = None,
    **_training_only,
) -> dict:
    """THE record of a `harness commbench` run (kind "commbench"): the raw per-rank call times, what ran
    them, and the figures harness.analyze.collectives derives from them."""
    record = {
        "schema_version": SCHEMA_VERSION,
        "kind": "commbench",
        "run_id": run_id,
        "status": status,
        "test_hooks": test_hooks,
        "error": error,
        "config": cfg.to_dict(),
        "backend_info": {
            "label": backend.commbench_label(cfg),
            "framework": backend.framework,
            "launcher": backend.launcher,
            "api": backend.collective_api,
        },
        "launch": launch or {},
        "ranks": list(ranks),
        "environment": environment or {},
        "sweep": sweep,
    }
    try:
        # imported here: its pandas and scipy would cost every training run's start about 0.2 s
        from harness.analyze.collectives import summarize_commbench

        record["summary"] = summarize_commbench(record) if status == "ok" else {}
    except Exception as exc:  # noqa: BLE001 - the raw ranks are the result; never lose them to an analysis bug
        record["summary"] = {"error": f"{type(exc).__name__}: {exc}"}
    return record
