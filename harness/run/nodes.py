"""Multi-node runs: one harness per node starts that node's launcher; node 0 writes the one run record.

How the nodes agree without a coordinator of our own:
- every node gets the same layout (--nodes, --gpus-per-node, --hosts/--hostfile, --master ADDR:PORT) and the
  same --run-id; only --node-rank differs (or it is found from this host's place in --hosts);
- so every node writes into the same run dir, out/logs/<run_id>/ on a shared filesystem: its ranks' event
  streams rankN.events.jsonl, its launcher log, and node<R>.json, written when the node starts and again
  when its launcher has exited (exit codes, timed out or not);
- node 0 then waits for every node that has started to finish, gathers all ranks' records and writes the
  record. A node whose marker never shows up shares no filesystem with node 0 (or never ran): node 0 writes
  what it has, and `harness collect` completes the record once the other nodes' run dirs are copied over.
`harness plan` (harness/run/plan.py) prints what each node would run, from the same adapter.launch(). The
layout flags themselves are read in harness.arguments.layout.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

from core.config import RunConfig
from core.events import events_path
from core.records import write_json_atomic
from harness.run.launch import LaunchResult, stopped
from harness.usage import UsageError

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NODE_GRACE_S = 30.0  # beyond the run's own timeout, how long node 0 waits for late nodes
# After a SIGTERM, how long node 0 still waits for the other nodes' markers: a scheduler signals every node,
# and each writes its marker as its launch stops (Slurm's --signal=TERM@60 leaves a minute before SIGKILL).
STOP_GRACE_S = 15.0
POLL_S = 0.5
# The flags a job file sets from the scheduler's allocation (harness.run.jobfile).
LAYOUT_FLAGS = ("--nodes", "--gpus-per-node", "--hosts", "--hostfile", "--node-rank", "--master", "--run-id")


def check_run_id(run_id: str | None, cfg: RunConfig, out_dir: Path) -> None:
    """A multi-node run needs a run id every node knows; a result is never overwritten.

    Each node looks only at what it itself would have written before (its marker, and node 0 its rank 0's
    events): the other nodes share the run dir and may start first, so their files are no sign of reuse."""
    if run_id is None:
        if cfg.topology.nodes > 1:
            raise UsageError(
                f"--nodes {cfg.topology.nodes}: give --run-id ID, the same on every node (e.g. "
                "$SLURM_JOB_ID), so that all nodes write into one run dir"
            )
        return
    if not RUN_ID.fullmatch(run_id):
        raise UsageError(f"--run-id '{run_id}': use letters, digits, '.', '_' and '-' (up to 128)")
    run_dir = Path(out_dir) / "logs" / run_id
    node_rank = cfg.topology.node_rank
    if (
        (Path(out_dir) / f"{run_id}.json").exists()
        or marker_path(run_dir, node_rank).exists()
        or (node_rank == 0 and events_path(run_dir, 0).exists())
    ):
        raise UsageError(f"run id '{run_id}' was used before in {out_dir}: give a new --run-id")


# ------------------------------------------------------------------------------------------- node markers
def node_log(run_dir: Path, cfg: RunConfig, stem: str) -> Path:
    """A per-node log file: node 0 keeps the one-node name, so single-node run dirs look as before."""
    return run_dir / (
        f"{stem}.log" if cfg.topology.node_rank == 0 else f"{stem}.node{cfg.topology.node_rank}.log"
    )


def marker_path(run_dir: Path, node_rank: int) -> Path:
    return Path(run_dir) / f"node{node_rank}.json"


def start_node(cfg: RunConfig, run_dir: Path, argv: list[str], started: str) -> dict:
    """Say, in the run dir, that this node has started (so node 0 knows to wait for it)."""
    marker = {
        "node_rank": cfg.topology.node_rank,
        "host": socket.gethostname(),
        "argv": list(argv),
        "started": started,
        "finished": False,
    }
    write_json_atomic(marker_path(run_dir, cfg.topology.node_rank), marker)
    return marker


def ranks_launched(run_dir: Path, marker: dict, result: LaunchResult, measured: bool) -> dict:
    """Say that this node's launcher has exited (its ranks are done), before the isolated counterfactual;
    `measured`: every rank of the node finished its measured steps (even if one then died while tracing)."""
    marker = {**marker, "ranks_done": True, "ranks_ok": measured}
    write_json_atomic(marker_path(run_dir, marker["node_rank"]), marker)
    return marker


def wait_for_ranks(run_dir: Path, node_rank: int, timeout_s: float) -> str | None:
    """Wait until node `node_rank`'s launcher has exited (for a launcher that also runs this node's ranks);
    returns an error message if it failed or did not finish within the run's timeout plus a grace."""
    deadline = time.monotonic() + timeout_s + NODE_GRACE_S
    while time.monotonic() < deadline:
        marker = read_markers(run_dir, node_rank + 1)[node_rank] or {}
        if marker.get("ranks_done") or marker.get("finished"):
            return (
                None if marker.get("ranks_ok", True) else f"node {node_rank}'s ranks failed: no isolated run"
            )
        if reason := stopped():  # the launcher got the same signal: its ranks will not finish the run
            return f"stopped by {reason}: no isolated run"
        time.sleep(POLL_S)
    return f"node {node_rank}'s launcher, which runs this node's ranks, did not finish: no isolated run"


def finish_node(run_dir: Path, marker: dict, result: LaunchResult, isolated_error: str | None) -> dict:
    marker = {
        **marker,
        "finished": True,
        "returncodes": result.returncodes,
        "timed_out": result.timed_out,
        "stopped": result.stopped,
        "elapsed_s": result.elapsed_s,
        "isolated_error": isolated_error,
    }
    write_json_atomic(marker_path(run_dir, marker["node_rank"]), marker)
    return marker


def read_markers(run_dir: Path, nodes: int) -> list[dict | None]:
    markers = []
    for k in range(nodes):
        try:
            markers.append(json.loads(marker_path(run_dir, k).read_text()))
        except (OSError, ValueError):
            markers.append(None)
    return markers


def wait_for_nodes(run_dir: Path, cfg: RunConfig) -> list[dict | None]:
    """Every node's marker once each node that has started has finished. While node 0's own launch went
    well, a node still running gets the run's timeout (twice with the isolated counterfactual, a second
    launch) plus a grace; once node 0's failed, the others only get the grace to notice and report: the
    run has failed whatever they do, and the record should not wait on a peer that waits for a dead one."""
    own = read_markers(run_dir, 1)[0] or {}
    own_ok = not own.get("timed_out") and own.get("ranks_ok", False)  # its ranks all measured
    launches = 1 + (cfg.measurement.isolated_repeats if cfg.measurement.compute_method == "isolated" else 0)
    deadline = time.monotonic() + (launches * cfg.measurement.timeout_s if own_ok else 0) + NODE_GRACE_S
    while True:
        markers = read_markers(run_dir, cfg.topology.nodes)
        if all(m is None or m.get("finished") for m in markers) or time.monotonic() > deadline:
            return markers
        if stopped():  # the others were signalled too: a short grace for their markers, then the record
            deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
        time.sleep(POLL_S)


def merged_launch(markers: list[dict | None]) -> LaunchResult:
    """All nodes' launches as one: every exit code, timed out if any node timed out."""
    done = [m for m in markers if m and m.get("finished")]
    return LaunchResult(
        [rc for m in done for rc in m["returncodes"]],
        any(m["timed_out"] for m in done),
        max((m["elapsed_s"] for m in done), default=0.0),
        next((m["stopped"] for m in done if m.get("stopped")), None),
    )


def absent_nodes(markers: list[dict | None]) -> str | None:
    """Why some ranks' records may be missing: nodes that left no (finished) marker here."""
    absent = [k for k, m in enumerate(markers) if not (m and m.get("finished"))]
    if not absent or len(absent) == len(markers):
        return None
    return (
        f"node(s) {absent} left no finished node marker in this run dir: if the nodes share no filesystem, "
        "copy their run dirs here and run `harness collect`"
    )
