"""What a worker process reads of itself from its launcher and the OS: its rank, its resident and peak
memory, its page faults and its CPU's model.

Apart from the timed loop (backends.loop) that records them, because the failure record
(backends.faults), the commbench loop and `harness env` read them too; nothing here imports a framework.
"""

from __future__ import annotations

import functools
import os
import platform
import resource

import psutil

# Environment variables through which the launchers tell a process its rank, in the order we trust them.
RANK_VARS = ("DISTBENCH_RANK", "RANK", "HOROVOD_RANK", "PADDLE_TRAINER_ID", "OMPI_COMM_WORLD_RANK")


def rank_from_env() -> int:
    for var in RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process (VmHWM) to its current RSS: Linux's clear_refs "5".
    False where that is unavailable; the peak is then the lifetime maximum (getrusage)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS since reset_peak_rss() (VmHWM), else over the process's life (getrusage)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@functools.cache
def this_process() -> psutil.Process:
    return psutil.Process()


def rss_bytes() -> int:
    """The process's resident memory now: one read of /proc/self/statm, cheap enough for every step's
    event (written after the step's clock has stopped)."""
    return this_process().memory_info().rss


def minor_page_faults() -> int:
    """Page faults of this process served without I/O so far. Re-faulting memory the allocator gave back
    costs step time on CPU, so the loop records them per measured step."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_name() -> str:
    """The CPU model, so CPU records from different machines are not mistaken for each other."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())
