"""One run end to end: launch the workers, gather their rank records, write ONE run record.

The record is written for every outcome (ok | failed | crashed | oom | timeout), atomically, under
`out_dir`; per-rank logs stay in out_dir/logs/<run_id>/.
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


def classify(result: LaunchResult, ranks: dict[int, dict], world: int, run_dir: Path) -> tuple[str, dict | None]:
    """The run's status and, if it failed, which rank and its last log lines.

    A rank's own record says failed/oom when it raised; a rank with no record died without a word
    (killed, segfault, OOM-killer): crashed. Timeout wins, since killing causes the other symptoms.
    """
    missing = [r for r in range(world) if r not in ranks]
    bad = [r for r, rec in sorted(ranks.items()) if rec.get("status") != "ok"]
    if result.timed_out:
        return "timeout", {"message": f"run exceeded its timeout after {result.elapsed_s:.0f} s",
                           "unfinished_ranks": missing, "rank": missing[0] if missing else None,
                           "log_tail": log_tail(run_dir / f"rank{missing[0]}.log") if missing else []}
    if bad:  # the first rank to fail is the cause; the others usually fail on its broken collective
        r = min(bad, key=lambda k: ranks[k].get("failed_at", float("inf")))
        return ranks[r]["status"], {"rank": r, "message": ranks[r].get("error"),
                                    "log_tail": log_tail(run_dir / f"rank{r}.log")}
    if missing:
        r = missing[0]
        tail = log_tail(run_dir / f"rank{r}.log") or log_tail(run_dir / "launcher.log")
        return "crashed", {"rank": r, "message": f"ranks {missing} exited without a record "
                           f"(launcher exit codes {result.returncodes})", "log_tail": tail}
    return "ok", None


def launch_and_gather(backend: Backend, cfg: RunConfig, run_dir: Path) -> tuple[LaunchResult, dict[int, dict]]:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.to_json())
    result = run_processes(backend.launch(cfg, run_dir, free_port()), run_dir / "launcher.log", cfg.timeout_s,
                           cwd=REPO_ROOT)
    return result, gather_ranks(run_dir, cfg.world_size)


def run_isolated(backend: Backend, cfg: RunConfig, run_dir: Path) -> tuple[list[dict], str | None]:
    """The isolated counterfactual: N independent single-process workers started at the same time, each
    on the data shard of one rank, so they contend for the machine as the real run does but never talk."""
    processes, dirs = [], []
    for k in range(cfg.gpus):
        iso = dataclasses.replace(cfg, isolated_index=k)
        d = run_dir / f"isolated{k}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(iso.to_json())
        processes += backend.launch(iso, d, free_port())
        dirs.append(d)
    result = run_processes(processes, run_dir / "isolated.log", cfg.timeout_s, cwd=REPO_ROOT)
    records = [gather_ranks(d, 1).get(0) for d in dirs]
    if result.timed_out or any(r is None or r.get("status") != "ok" for r in records):
        return [], f"isolated counterfactual failed (exit codes {result.returncodes}); see {run_dir}"
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


def execute(backend: Backend, cfg: RunConfig, out_dir: Path, argv: list[str], sweep: dict | None = None) -> dict:
    """Run `cfg`, write its record to out_dir/<run_id>.json, and return the record. `sweep` ({"id",
    "repeat"}) ties the run to the sweep that launched it; None for a single `harness run`."""
    run_id = new_run_id(cfg)
    run_dir = Path(out_dir) / "logs" / run_id
    started = now_iso()
    result, ranks = launch_and_gather(backend, cfg, run_dir)
    status, error = classify(result, ranks, cfg.world_size, run_dir)

    comm = {"method": cfg.compute_method if cfg.gpus > 1 else "none"}
    isolated = []
    if status == "ok" and comm["method"] == "isolated":
        isolated, comm_error = run_isolated(backend, cfg, run_dir)
        if comm_error:
            comm["error"] = comm_error

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
        "launch": {"returncodes": result.returncodes, "elapsed_s": result.elapsed_s, "log_dir": str(run_dir)},
        "comm": comm,
        "ranks": rank_list,
        "isolated_ranks": isolated,
        "environment": environment(cfg, rank_list, argv, started),
        "sweep": sweep,
    }
    record["summary"] = summarize(record)
    write_json_atomic(Path(out_dir) / f"{run_id}.json", record)
    return record

