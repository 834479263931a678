"""Start a run's processes, wait with a deadline, and never leave one behind.

Every process starts in its own session so the whole tree (launcher, workers, their helpers) can be found
and killed; descendants are collected before the kill because they are re-parented once a launcher dies.
If the harness itself dies (even by SIGKILL), each launcher gets SIGTERM from the kernel, and a reaper
process, which outlives the harness, tears the sessions down as the harness would have (SIGTERM, then
SIGKILL): a launcher caught mid-start by SIGTERM can otherwise linger.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from core.process import REPO_ROOT, Process, die_with_parent

# After one process of a multi-process launch fails, how long the others get to notice and exit on their
# own (a launcher such as torchrun tears its workers down itself) before they are killed.
FAILURE_GRACE_S = 15.0
KILL_GRACE_S = 5.0
STOPPED_CHECK_S = 2.0
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)  # in /proc/PID/status's pending-signal masks


@dataclass
class LaunchResult:
    returncodes: list[int | None]
    timed_out: bool
    elapsed_s: float
    stopped: str | None = None  # why the harness was told to stop (a SIGTERM: who sent it), if it was

    @property
    def ok(self) -> bool:
        return not self.timed_out and not self.stopped and all(rc == 0 for rc in self.returncodes)


# Set by the harness's SIGTERM handler (harness.run.commands): every launch ends as on a timeout, with the
# reason kept, and the record is still written (a scheduler's time limit sends SIGTERM, then SIGKILL).
STOP = threading.Event()
stop_reason: list[str] = []


def request_stop(reason: str) -> None:
    if not STOP.is_set():
        stop_reason.append(reason)
        STOP.set()


def stopped() -> str | None:
    return stop_reason[0] if STOP.is_set() else None


def who_sent_sigterm() -> str:
    """Python's handler is not told the sender; the environment says who can have sent it."""
    if job := os.environ.get("SLURM_JOB_ID"):
        return f"SIGTERM from Slurm (job {job}: its time limit, or scancel)"
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return "SIGTERM from Kubernetes (the pod was deleted, evicted or its job ended)"
    return "SIGTERM from outside the harness (kill, a scheduler, a container stop)"


def stop_on_sigterm() -> None:
    """A SIGTERM to the harness stops its launches as a timeout would and lets it write the record (a
    scheduler sends SIGTERM at the time limit, then SIGKILL after a grace: Slurm's KillWait, 30 s by
    default). Later SIGTERMs are ignored, so they cannot interrupt the writing."""

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        request_stop(who_sent_sigterm())

    signal.signal(signal.SIGTERM, handler)


def kill_tree(popens: list[subprocess.Popen]) -> None:
    """SIGTERM every process in the trees (and sessions) we started, then SIGKILL what is left."""
    kill_sessions([p.pid for p in popens])
    for p in popens:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def kill_sessions(leaders: list[int]) -> None:
    """SIGTERM the session leaders we started, their descendants and their sessions' other members; after
    KILL_GRACE_S, SIGKILL what is left."""
    procs = []
    for pid in leaders:
        try:
            root = psutil.Process(pid)
            procs.extend([root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            pass
    sessions = set(leaders)
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) in sessions and proc not in procs:
                procs.append(proc)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=KILL_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=KILL_GRACE_S)


def remove_leftovers(patterns: list[str]) -> None:
    """Remove what the framework left outside the run directory (see LaunchPlan.leftovers)."""
    for path in (p for pattern in patterns for p in glob.glob(pattern)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def start_reaper() -> subprocess.Popen:
    """`python -m harness.run.reaper` in its own session, told each started process's pid on its stdin. If
    the harness dies, its stdin closes without "done" and it kills those sessions (see
    harness/run/reaper.py)."""
    return subprocess.Popen(
        [sys.executable, "-m", "harness.run.reaper"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd=REPO_ROOT,
        text=True,
    )


def tell_reaper(reaper: subprocess.Popen, line: str, last: bool = False) -> None:
    if reaper.stdin is None:
        raise ValueError("the reaper was started without a pipe on its stdin (start_reaper opens one)")
    try:
        reaper.stdin.write(line + "\n")
        reaper.stdin.flush()
        if last:
            reaper.stdin.close()
            reaper.wait(timeout=KILL_GRACE_S)
    except (OSError, subprocess.TimeoutExpired):
        pass  # a reaper gone or slow changes nothing while the harness itself is alive to clean up


def pending_signals(pid: int) -> int:
    """The signals waiting for a process (sent to it or to one of its threads), as a bit mask."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    except (OSError, KeyError, ValueError):
        return 0


def resume_stopped_ranks_told_to_end(popens: list[subprocess.Popen]) -> None:
    """SIGCONT every process we started (and its descendants) that is stopped (SIGSTOP: a frozen rank)
    while a SIGTERM waits for it: its launcher is tearing the run down. Stopped, it cannot act on that
    SIGTERM, and the launcher waits out its own grace (torchrun: 30 s) before SIGKILL; resumed, it ends at
    once and records that it was stopped from outside. A process stopped under a debugger is left alone."""
    for popen in popens:
        try:
            leader = psutil.Process(popen.pid)
            tree = [leader, *leader.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            try:
                if proc.status() == psutil.STATUS_STOPPED and pending_signals(proc.pid) & SIGTERM_BIT:
                    proc.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass


def run_processes(
    processes: list[Process],
    log_path: Path,
    timeout_s: float,
    cwd: Path | None = None,
    leftovers: list[str] | None = None,
) -> LaunchResult:
    """Run processes concurrently, all output to one log; kill everything on timeout, Ctrl-C, or once a
    process has failed and the others have not exited within FAILURE_GRACE_S; then remove `leftovers`."""
    start = time.monotonic()
    if stopped():  # told to stop before this launch: start nothing
        return LaunchResult([], False, 0.0, stopped())
    popens = []
    reaper = start_reaper()
    with open(log_path, "ab") as log:
        try:
            for pattern in leftovers or []:
                tell_reaper(reaper, f"leftover {pattern}")
            for proc in processes:
                popens.append(
                    subprocess.Popen(
                        proc.argv,
                        env={**os.environ, **proc.env},
                        cwd=cwd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
                )
                tell_reaper(reaper, str(popens[-1].pid))
            first_failure, last_stopped_check = None, start
            while any(p.poll() is None for p in popens):
                now = time.monotonic()
                if now - start > timeout_s:
                    kill_tree(popens)
                    return LaunchResult([p.returncode for p in popens], True, now - start)
                if stopped():
                    kill_tree(popens)
                    return LaunchResult([p.returncode for p in popens], False, now - start, stopped())
                if first_failure is None and any(p.returncode not in (None, 0) for p in popens):
                    first_failure = now
                if first_failure is not None and now - first_failure > FAILURE_GRACE_S:
                    break
                if now - last_stopped_check > STOPPED_CHECK_S:  # a walk of /proc: not 10 times a second
                    resume_stopped_ranks_told_to_end(popens)
                    last_stopped_check = now
                time.sleep(0.1)
        finally:
            kill_tree(popens)  # also reaps any stragglers (daemons, grandchildren) of a clean exit
            remove_leftovers(leftovers or [])
            tell_reaper(reaper, "done", last=True)  # nothing left for it to do
    # stopped() again: the processes may have ended (they get the scheduler's SIGTERM too) between checks
    return LaunchResult([p.returncode for p in popens], False, time.monotonic() - start, stopped())
