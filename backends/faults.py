"""How a rank fails on purpose and how it records a failure: the test hooks' injected faults, and the rank
record of a rank that raised or was stopped by SIGTERM, written even while its launcher tears it down.

Apart from the timed loop (backends.loop), which calls inject_fault every step, because the worker's entry
point (backends.worker) and the commbench loop need them too; nothing here imports a framework.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import sys
import time
import traceback

import psutil

from backends.process_stats import peak_rss_bytes, rank_from_env
from core.events import RESULT, EventLog
from core.hooks import TestHooks


def inject_fault(hooks: TestHooks, rank: int, step: int) -> None:
    """Test-only (core.hooks): make one rank fail in a chosen way at a chosen step, so failure handling is
    testable."""
    fault = hooks.fault
    if not fault or fault["rank"] != rank or fault["step"] != step:
        return
    kind = fault["kind"]
    print(f"injecting fault '{kind}' at step {step} (unix time {time.time():.3f})", flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    if kind == "exit":
        os._exit(3)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigstop":  # stopped, not dead: no exit code, no record, deaf to SIGTERM until killed
        os.kill(os.getpid(), signal.SIGSTOP)
    if kind == "hang":
        time.sleep(1e9)
    if kind == "oom":  # cap the address space, then allocate past it: a real MemoryError from the allocator
        used = psutil.Process().memory_info().vms
        resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
        hog = [bytearray(64 << 20) for _ in range(1 << 12)]
        raise AssertionError(f"allocated {len(hog)} blocks without running out of memory")


class Terminated(BaseException):
    """SIGTERM reached this rank: a launcher tearing its workers down after another rank failed, or the
    harness at a timeout. Recorded as such, so a rank stopped from outside is never taken for the cause."""


def record_termination() -> None:
    """Turn SIGTERM into Terminated, so the rank still writes its record (where it was, and that it was
    stopped) instead of vanishing. Only the first: a second SIGTERM (launcher and harness both send one)
    must not interrupt the writing of that record; SIGKILL still ends a rank that does not finish."""

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated("stopped by SIGTERM (from its launcher or the harness)")

    signal.signal(signal.SIGTERM, handler)


def record_failure(events: EventLog, exc: BaseException) -> None:
    """Write the result of a rank that raised, deaf to SIGTERM while it writes: a rank that failed because
    a peer died is sent SIGTERM by its launcher moments later, and a Terminated raised while this result is
    written would leave none at all, so the rank would be taken for the one that died. A SIGTERM that
    lands before the handler is switched off raises Terminated once (the handler then ignores the next),
    so the result is written again. Afterwards SIGTERM ends the process, so a rank stuck on its way out
    is still ended by its launcher."""
    try:
        write_failure_record(events, exc)
    except Terminated:
        write_failure_record(events, exc)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_failure_record(events: EventLog, exc: BaseException) -> None:
    """record_failure's one attempt: SIGTERM off, then the result event."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record = failure_record(exc)
    print(record["traceback"], file=sys.stderr, flush=True)
    events.emit(RESULT, record=record)


def failure_record(exc: BaseException) -> dict:
    """The rank record of a rank that raised: 'oom' for out-of-memory errors, else 'failed';
    `terminated` marks a rank stopped from outside (see Terminated)."""
    name = type(exc).__name__
    oom = isinstance(exc, MemoryError) or "OutOfMemory" in name or "out of memory" in str(exc).lower()
    return {
        "rank": rank_from_env(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "status": "oom" if oom else "failed",
        "error": f"{name}: {exc}",
        "failed_at": time.time(),
        "terminated": isinstance(exc, Terminated),
        "traceback": "".join(traceback.format_exception(exc))[-4000:],
        "memory": {"peak_rss": peak_rss_bytes()},
    }
