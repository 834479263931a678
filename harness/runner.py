"""One run end to end: launch the workers, gather their rank records, write ONE run record.

The record is written for every outcome (ok | failed | crashed | oom | timeout), atomically, under
`out_dir`; per-rank logs stay in out_dir/logs/<run_id>/. A multi-node run has one harness per node, each
launching its own ranks into that shared run dir; node 0 writes the record (see harness.multinode).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import uuid
from pathlib import Path

from backends.base import REPO_ROOT, Backend, free_port
from harness.config import RunConfig
from harness.launch import LaunchResult, run_processes
from harness.metrics import summarize
from harness.multinode import (absent_nodes, finish_node, merged_launch, node_log, read_markers, start_node,
                               wait_for_nodes)
from harness.records import SCHEMA_VERSION, write_json_atomic

LOG_TAIL_LINES = 30


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(cfg: RunConfig) -> str:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{cfg.backend}-{cfg.workload}-n{cfg.gpus}-{uuid.uuid4().hex[:6]}"


def git_commit() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def gather_ranks(run_dir: Path, world: int) -> dict[int, dict]:
    ranks = {}
    for r in range(world):
        path = run_dir / f"rank{r}.json"
        if path.exists():
            ranks[r] = json.loads(path.read_text())
    return ranks


# How a rank's error says it failed because of another rank rather than on its own (each framework words it
# differently; matched case-insensitively): it gave up waiting in a collective, or lost its connection.
PEER_TIMEOUT = ("timed out", "timeout", "deadline exceeded", "deadlineexceeded")
PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
             "communicator was aborted", "horovod has been shut down", "socket closed", "unavailableerror",
             "collective ops is aborted")


def failure_kind(rec: dict) -> str | None:
    """'stopped' (SIGTERM from outside), 'timeout'/'lost' (waited on a peer), or None: failed on its own."""
    if rec.get("terminated"):
        return "stopped"
    text = (rec.get("error") or "").lower()
    if any(m in text for m in PEER_TIMEOUT):
        return "timeout"
    return "lost" if any(m in text for m in PEER_LOST) else None


def classify(result: LaunchResult, ranks: dict[int, dict], world: int, run_dir: Path) -> tuple[str, dict | None]:
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
        return status, {"rank": r, "message": message, **extra,
                        "log_tail": tail or log_tail(run_dir / "launcher.log")}

    if result.timed_out:  # who hung is not knowable from outside: every rank waits on the hung one
        return result_for("timeout", unfinished[0] if len(unfinished) == 1 else None,
                          f"run exceeded its timeout after {result.elapsed_s:.0f} s; ranks {unfinished} had not finished",
                          unfinished_ranks=unfinished)
    own = [r for r in failed if kind[r] is None]
    if own:
        r = first(own)
        return result_for(ranks[r]["status"], r, ranks[r].get("error"))
    waited = [r for r in failed if kind[r] == "timeout"]
    if waited:
        culprits = [r for r in failed if kind[r] == "stopped"] + missing
        return result_for("timeout", (culprits or waited)[0],
                          f"rank(s) {waited} gave up waiting in a collective for rank(s) {culprits or '?'} "
                          f"({ranks[first(waited)].get('error')})", unfinished_ranks=unfinished)
    if missing:
        return result_for("crashed", missing[0], f"rank(s) {missing} exited without a record (killed, or died in "
                          f"native code); launcher exit codes {result.returncodes}")
    if failed:
        r = first(failed)
        return result_for(ranks[r]["status"], r, ranks[r].get("error"))
    return "ok", None


def launch_node(backend: Backend, cfg: RunConfig, run_dir: Path) -> LaunchResult:
    """Start THIS node's launcher (the whole run on one node) and wait for it. Every node writes the same
    config.json (the run's, as node 0 sees it), atomically, since on a shared filesystem they share it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", dataclasses.replace(cfg, node_rank=0).to_dict())
    return run_processes(backend.launch(cfg, run_dir, cfg.master_port or free_port()),
                         node_log(run_dir, cfg, "launcher"), cfg.timeout_s, cwd=REPO_ROOT)


def run_isolated(backend: Backend, cfg: RunConfig, run_dir: Path) -> str | None:
    """The isolated counterfactual: N independent single-process workers started at the same time, each
    on the data shard of one rank, so they contend for the machines as the real run does but never talk.
    Each node runs the workers standing for its own ranks; returns an error message if they failed."""
    processes = []
    first = cfg.node_rank * cfg.procs_per_node
    for k in range(first, first + cfg.procs_per_node):
        iso = dataclasses.replace(cfg, isolated_index=k)
        d = run_dir / f"isolated{k}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(iso.to_json())
        launched = backend.launch(iso, d, free_port())
        if cfg.device == "cuda":  # each single-process worker gets its own GPU, as its rank would have
            for proc in launched:
                proc.env["CUDA_VISIBLE_DEVICES"] = local_gpu(k - first)
        processes += launched
    result = run_processes(processes, node_log(run_dir, cfg, "isolated"), cfg.timeout_s, cwd=REPO_ROOT)
    return None if result.ok else f"isolated counterfactual failed on node {cfg.node_rank} (exit codes {result.returncodes}); see {run_dir}"


def local_gpu(index: int) -> str:
    """The id to put in CUDA_VISIBLE_DEVICES for this node's `index`-th GPU, honouring an existing mask."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[index] if visible else str(index)


def gather_isolated(run_dir: Path, cfg: RunConfig, markers: list[dict | None]) -> tuple[list[dict], str | None]:
    errors = [m["isolated_error"] for m in markers if m and m.get("isolated_error")]
    records = [gather_ranks(run_dir / f"isolated{k}", 1).get(0) for k in range(cfg.gpus)]
    if errors or any(r is None or r.get("status") != "ok" for r in records):
        return [], "; ".join(errors) or f"isolated counterfactual records missing or failed; see {run_dir}"
    return records, None


def environment(cfg: RunConfig, ranks: list[dict], argv: list[str], started: str) -> dict:
    first = next((r for r in ranks if r.get("versions")), {})
    devices = sorted({r["device"] for r in ranks if r.get("device")})
    return {
        "device_type": cfg.device,
        "device_kind": devices[0] if len(devices) == 1 else (", ".join(devices) or None),
        "device_names": [r.get("device") for r in ranks],
        "hostnames": sorted({r["host"] for r in ranks if r.get("host")}),
        "world_size": cfg.gpus,
        "threads_per_worker": cfg.threads_per_worker,
        "process_settings": first.get("process_settings"),  # as rank 0 got them
        "harness_host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": first.get("versions", {}),
        "git": git_commit(),
        "command_line": argv,
        "start_time": started,
        "end_time": now_iso(),
    }


def execute(backend: Backend, cfg: RunConfig, out_dir: Path, argv: list[str], sweep: dict | None = None,
            run_id: str | None = None) -> dict | None:
    """Run this node's share of `cfg` (all of a one-node run). Node 0 then writes the run record to
    out_dir/<run_id>.json and returns it; another node returns None. `sweep` ({"id", "repeat"}) ties the run
    to the sweep that launched it; None for a single `harness run`."""
    if cfg.nodes > 1 and not run_id:
        raise ValueError("a multi-node run needs a run id every node agrees on; a random one would split it")
    run_id = run_id or new_run_id(cfg)
    run_node(backend, cfg, Path(out_dir) / "logs" / run_id, argv)
    return write_record(backend, cfg, Path(out_dir), run_id, sweep=sweep) if cfg.node_rank == 0 else None


def run_node(backend: Backend, cfg: RunConfig, run_dir: Path, argv: list[str]) -> dict:
    """Launch this node's ranks, then its share of the isolated counterfactual; returns its node marker."""
    marker = start_node(cfg, run_dir, argv, now_iso())
    result = launch_node(backend, cfg, run_dir)
    isolated_error = None
    if result.ok and cfg.compute_method == "isolated" and cfg.gpus > 1:
        isolated_error = run_isolated(backend, cfg, run_dir)
    return finish_node(run_dir, marker, result, isolated_error)


def write_record(backend: Backend, cfg: RunConfig, out_dir: Path, run_id: str, wait: bool = True,
                 sweep: dict | None = None) -> dict:
    """Node 0: gather every node's ranks (waiting for the nodes still running unless `wait` is False),
    classify, and write the ONE run record."""
    run_dir = Path(out_dir) / "logs" / run_id
    markers = wait_for_nodes(run_dir, cfg) if wait else read_markers(run_dir, cfg.nodes)
    result = merged_launch(markers)
    ranks = gather_ranks(run_dir, cfg.world_size)
    status, error = classify(result, ranks, cfg.world_size, run_dir)
    if error and len(ranks) < cfg.world_size and absent_nodes(markers):
        error["message"] += "; " + absent_nodes(markers)

    comm = {"method": cfg.compute_method if cfg.gpus > 1 else "none"}
    isolated = []
    if status == "ok" and comm["method"] == "isolated":
        isolated, comm_error = gather_isolated(run_dir, cfg, markers)
        if comm_error:
            comm["error"] = comm_error

    node0 = markers[0] or {}
    rank_list = [ranks[r] for r in sorted(ranks)]
    record = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "status": status,
        "error": error,
        "config": cfg.to_dict(),
        "backend_info": {
            "label": backend.label(cfg), "framework": backend.framework, "launcher": backend.launcher,
            "sharding": backend.sharding(cfg), "precision_scheme": backend.precision_scheme(cfg),
            "comm_pattern": dataclasses.asdict(backend.comm_pattern(cfg)),
        },
        "launch": {"returncodes": result.returncodes, "elapsed_s": result.elapsed_s, "log_dir": str(run_dir),
                   "nodes": markers},
        "comm": comm,
        "ranks": rank_list,
        "isolated_ranks": isolated,
        "environment": environment(cfg, rank_list, node0.get("argv", []), node0.get("started")),
        "sweep": sweep,
    }
    record["summary"] = summarize(record)
    write_json_atomic(Path(out_dir) / f"{run_id}.json", record)
    return record
