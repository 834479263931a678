"""Whether a run fits this node's memory, checked before anything launches; and the measurement of the
per-worker footprint the check reads, which each stack keeps beside its adapter
(backends.base.FOOTPRINT_FILE).

**The footprint** of a stack is the host memory (RSS) its processes take beyond the model, measured once on
a real run: `python -m harness.run.footprint --backend NAME --write` runs `harness run` (tiny, 2 ranks, CPU,
as a user would: harness.run.child) while it samples the run's process tree, then reads the record. It keeps

- `worker_bytes`: a rank's peak RSS (the larger of the record's and the sampled one) less its model state
  as the record counted it and less `shared_bytes`: framework, runtime, buffers and the tiny model's
  activations, which every further worker adds;
- `shared_bytes`: the part of a rank's RSS it shares with the other processes (the framework's libraries,
  mapped from the same files), which the node holds once however many workers map it;
- `launcher_bytes`: the stack's launcher (every process of the run's tree that is neither the harness nor
  a rank: torchrun, horovodrun and its driver, ...), once per launch;
- `harness_bytes`: the `harness run` process itself;

with how, where and when it was measured. A stack without the file (a registered one not measured yet)
still runs: the check says it cannot estimate and lets it go.

**The estimate** for this node's N local ranks (each node of a multi-node run checks its own):

    harness + launcher + shared + N x (worker + model state)

where the model state is the analytic bytes one rank holds for the stack's sharding at the run's N
(Backend.model_state_bytes) on a CPU run, and nothing on a GPU one, whose model lives on the device. Where
the isolated counterfactual runs, its N single-process workers run at once, each under its own launcher and
each with the whole model state (a process group of one shards nothing): the estimate is the larger of the
two launches. Activations beyond the tiny model's are left out (their terms belong to the prediction, which
harness.run does not import): for a larger workload on a CPU the estimate is a floor, so what it refuses
cannot fit, and a run it lets go may still need more.

**The check** compares the estimate with what the node has: the memory available (psutil), or what the
cgroup this process runs in has left under its limit where that is lower. A run that does not fit is a
UsageError (one line, exit 2) with the estimate and what to do; `--skip-memory-check` runs it anyway.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from backends import backend_names, get_backend
from backends.base import Backend
from core.config import RunConfig
from harness.analyze.summary import fmt_bytes
from harness.usage import UsageError

FIELDS = ("worker_bytes", "shared_bytes", "launcher_bytes", "harness_bytes")
# The run a footprint is measured on: the smallest workload, 2 ranks (so the ranks share what they share),
# one thread each, no isolated counterfactual and no trace (one launch: the launcher is the run's).
MEASURE_ARGV = (
    "--workload", "tiny", "--gpus", "2", "--device", "cpu", "--steps", "5", "--warmup", "2",
    "--compute-method", "none", "--no-trace-comm", "--threads-per-worker", "1", "--quiet",
    "--skip-memory-check",
)  # fmt: skip
SAMPLE_S = 0.1


# ------------------------------------------------------------------------------------- what the node has
def cgroup_available(
    root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")
) -> int | None:
    """What the memory cgroup this process runs in has left under its limit: the limit less what it uses
    that cannot be reclaimed (its usage less its inactive file cache, as the kernel and Kubernetes count a
    working set). None where no limit is set or none can be read (cgroup v2, then v1)."""
    try:
        lines = own.read_text().splitlines()
        path = next((line.split(":", 2)[2].strip() for line in lines if line.startswith("0::")), "/")
    except OSError:
        path = "/"
    for folder, limit_file, usage_file in (
        (root / path.lstrip("/"), "memory.max", "memory.current"),
        (root, "memory.max", "memory.current"),
        (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        try:
            limit_text = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= 1 << 60:  # v2's "max", v1's page-rounded 2^63
            return None
        inactive = 0
        try:
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines())
            inactive = int(stat.get("inactive_file", stat.get("total_inactive_file", 0)))
        except (OSError, ValueError):
            pass
        return max(0, int(limit_text) - (usage - inactive))
    return None


def node_available() -> tuple[int, str]:
    """(bytes this node has for a run, where the figure comes from): the memory available, or the cgroup's
    remainder where that is lower."""
    available = int(psutil.virtual_memory().available)
    limited = cgroup_available()
    if limited is not None and limited < available:
        return limited, "left under this cgroup's memory limit"
    return available, "available"


# ------------------------------------------------------------------------------------------- the estimate
def estimate(backend: Backend, cfg: RunConfig, footprint: dict) -> dict:
    """This node's bytes for `cfg` (module docstring): `per_worker` (its footprint and, on a CPU, its model
    state), `workers` (this node's ranks), `once` (harness, launcher and shared libraries) and `total`,
    for the launch that needs the most ("run", or "isolated" for the isolated counterfactual)."""
    workers = cfg.topology.gpus_per_node
    on_cpu = cfg.topology.device == "cpu"
    state = backend.model_state_bytes(cfg)["total"] if on_cpu else 0
    once = footprint["harness_bytes"] + footprint["shared_bytes"]
    launches = {"run": (footprint["worker_bytes"] + state, once + footprint["launcher_bytes"])}
    if cfg.measurement.compute_method == "isolated" and cfg.topology.world_size > 1:
        whole = (
            cfg.model.spec.model_state_bytes(cfg.model.precision, backend.precision_scheme(cfg))["total"]
            if on_cpu
            else 0
        )
        launches["isolated"] = (footprint["worker_bytes"] + footprint["launcher_bytes"] + whole, once)
    name, (per_worker, fixed) = max(launches.items(), key=lambda item: workers * item[1][0] + item[1][1])
    return {
        "launch": name,
        "per_worker": int(per_worker),
        "workers": workers,
        "once": int(fixed),
        "total": int(workers * per_worker + fixed),
        "model_state": int(state if name == "run" else per_worker - footprint["worker_bytes"]),
    }


def check_fits(
    backend: Backend, cfg: RunConfig, available: Callable[[], tuple[int, str]] | None = None
) -> str | None:
    """Refuse (UsageError) a run whose workers would not fit this node's memory; `available` says what the
    node has (default: node_available). Returns a note where the stack has no footprint to estimate from
    (the run goes), else None."""
    footprint = backend.footprint()
    if footprint is None:
        return (
            f"{backend.name} has no measured footprint ({backend.footprint_path().name} beside its adapter): "
            "this node's memory is not checked"
        )
    need = estimate(backend, cfg, footprint)
    have, where = (available or node_available)()
    if need["total"] <= have:
        return None
    what = f"{need['workers']} {cfg.topology.device} worker{'s' if need['workers'] > 1 else ''}"
    state = f" ({fmt_bytes(need['model_state'])} of it model state)" if need["model_state"] else ""
    during = " for its isolated counterfactual" if need["launch"] == "isolated" else ""
    raise UsageError(
        f"{backend.name} with {what} would not fit this node's memory: {need['workers']} x "
        f"{fmt_bytes(need['per_worker'])} a worker{state} + {fmt_bytes(need['once'])} once = "
        f"{fmt_bytes(need['total'])}{during}, and the node has {fmt_bytes(have)} {where}; run fewer "
        "--gpus, a smaller --workload, or add --skip-memory-check to run it anyway"
    )


# ------------------------------------------------------------------------------------------ the measurement
def tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def sample(root: psutil.Process, seen: dict[int, dict]) -> None:
    """Each process of `root`'s tree: its peak RSS and its peak shared part (RSS less USS) so far, and how
    many samples it was alive for."""
    for proc in tree(root):
        try:
            info = proc.memory_full_info()
        except psutil.Error:
            continue
        peak = seen.setdefault(proc.pid, {"rss": 0, "shared": 0, "samples": 0})
        peak["rss"] = max(peak["rss"], info.rss)
        peak["shared"] = max(peak["shared"], info.rss - info.uss)
        peak["samples"] += 1


def measure(name: str, out: Path, python: str | None = None) -> dict:
    """Run `harness run --backend NAME` (MEASURE_ARGV) into `out`, sampling its process tree every
    SAMPLE_S, and return the footprint its record and samples give (module docstring)."""
    from harness.run.child import start_child

    child = start_child(["run", "--backend", name, *MEASURE_ARGV], out, python=python)
    root, seen = psutil.Process(child.proc.pid), dict[int, dict]()
    while child.proc.poll() is None:
        sample(root, seen)
        time.sleep(SAMPLE_S)
    done = child.finish()
    if not done.ok:
        raise SystemExit(f"footprint of {name}: the run failed: {done.why}")
    record = done.record or {}
    ranks = record["ranks"]
    rank_pids = {r["pid"] for r in ranks}
    shared = max(seen.get(r["pid"], {}).get("shared", 0) for r in ranks)
    worker = max(
        max(r["memory"]["peak_rss"] or 0, seen.get(r["pid"], {}).get("rss", 0))
        - shared
        - (r.get("model_state_bytes") or {}).get("total", 0)
        for r in ranks
    )
    # The launcher: the tree's other processes that lived a second or more (not the harness's short probes:
    # git, an interpreter asked what it has); steady once started, so the sum of their peaks.
    others = [
        pid
        for pid, p in seen.items()
        if pid not in rank_pids and pid != root.pid and p["samples"] * SAMPLE_S >= 1
    ]
    launcher = sum(seen[pid]["rss"] for pid in others)
    return {
        "worker_bytes": int(worker),
        "shared_bytes": int(shared),
        "launcher_bytes": int(launcher),
        "harness_bytes": int(seen.get(root.pid, {}).get("rss", 0)),
        "measured": {
            "how": f"python -m harness.run.footprint --backend {name} --write",
            "run": ["harness", "run", "--backend", name, *MEASURE_ARGV],
            "record": record["run_id"],
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
            "versions": ranks[0].get("versions", {}),
            "ranks_peak_rss_bytes": [r["memory"]["peak_rss"] for r in ranks],
            "ranks_model_state_bytes": [(r.get("model_state_bytes") or {}).get("total") for r in ranks],
            "launcher_processes": len(others),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.run.footprint",
        description="Measure a stack's host-memory footprint on a tiny 2-rank CPU run (module docstring).",
    )
    parser.add_argument("--backend", action="append", help="a stack (repeat for several; default: all)")
    parser.add_argument("--write", action="store_true", help="write it beside the adapter (footprint.json)")
    parser.add_argument("--python", help="the interpreter the harness runs under (default: this one)")
    args = parser.parse_args(argv)
    for name in args.backend or backend_names():
        backend = get_backend(name)
        with tempfile.TemporaryDirectory(prefix="footprint-") as out:
            found = measure(name, Path(out), args.python)
        print(
            f"{name}: worker {fmt_bytes(found['worker_bytes'])}, shared {fmt_bytes(found['shared_bytes'])}, "
            f"launcher {fmt_bytes(found['launcher_bytes'])}, harness {fmt_bytes(found['harness_bytes'])}",
            flush=True,
        )
        if args.write:
            backend.footprint_path().write_text(json.dumps(found, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
