"""Process helpers both sides need: what the harness starts (`Process`), free ports, the environment that
fixes how a worker runs (`process_settings`), and dying with the parent. No framework is imported here."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Process:
    """One command the harness starts (a launcher, or a worker where the framework has no launcher)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now at `host` ("" for every interface, where the server binds them all)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# glibc malloc's defaults hand large freed blocks back to the kernel and fault them in again on the next
# step: thousands of page faults per CPU step, their count set by incidental allocation order, and +-5% step
# time between identical launches. So every backend's workers keep freed memory (the same advice as
# PyTorch's CPU tuning guide, which preloads jemalloc/tcmalloc for it); a value already set in the
# environment wins, and the run record says which were used.
ALLOCATOR_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Settings that switch a stack's trace instrument on for the whole process, not only while it records
# (Backend.traces_in_own_launch): a launch that measures must run without them, and its record shows it.
TRACE_SETTINGS = ("HOROVOD_TIMELINE",)


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on, not the machine's: its affinity (what Slurm's task binding, taskset
    or a container's cpuset gives it), capped by a cgroup v2 CPU quota ("max" or "<quota> <period>",
    rounded up). os.cpu_count() counts the host's, and N workers sized from it can share one CPU."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def process_settings(threads_per_worker: int) -> dict[str, str]:
    """The environment that fixes how a worker process runs, the same for every backend: its thread count
    (set before the framework starts) and the C allocator's settings. Each rank records what reached it."""
    allocator = {k: os.environ.get(k, v) for k, v in ALLOCATOR_SETTINGS.items()}
    return {**{k: str(threads_per_worker) for k in THREAD_SETTINGS}, **allocator}


def seen_process_settings() -> dict[str, str | None]:
    """The process settings as this worker got them through its framework's launcher."""
    return {k: os.environ.get(k) for k in (*THREAD_SETTINGS, *ALLOCATOR_SETTINGS, *TRACE_SETTINGS)}


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, so a harness or launcher killed with
    SIGKILL leaves no launcher or worker running on (a no-op where prctl is unavailable)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
