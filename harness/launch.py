"""Start a run's processes, wait with a deadline, and never leave one behind.

Every process starts in its own session so the whole tree (launcher, workers, their helpers) can be found
and killed; descendants are collected before the kill because they are re-parented once a launcher dies.
Each also gets SIGTERM from the kernel if the harness itself dies (even by SIGKILL), so nothing runs on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from backends.base import Process, die_with_parent

# After one process of a multi-process launch fails, how long the others get to notice and exit on their
# own (a launcher such as torchrun tears its workers down itself) before they are killed.
FAILURE_GRACE_S = 15.0
KILL_GRACE_S = 5.0


@dataclass
class LaunchResult:
    returncodes: list[int | None]
    timed_out: bool
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def kill_tree(popens: list[subprocess.Popen]) -> None:
    """SIGTERM every process in the trees (and sessions) we started, then SIGKILL what is left."""
    procs = []
    for p in popens:
        try:
            root = psutil.Process(p.pid)
            procs.extend([root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            pass
    sessions = {p.pid for p in popens}
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
    for p in popens:
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def run_processes(processes: list[Process], log_path: Path, timeout_s: float, cwd: Path | None = None) -> LaunchResult:
    """Run processes concurrently, all output to one log; kill everything on timeout, Ctrl-C, or once a
    process has failed and the others have not exited within FAILURE_GRACE_S."""
    start = time.monotonic()
    popens = []
    with open(log_path, "ab") as log:
        try:
            for proc in processes:
                popens.append(subprocess.Popen(proc.argv, env={**os.environ, **proc.env}, cwd=cwd, stdout=log,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True, preexec_fn=die_with_parent))
            first_failure = None
            while any(p.poll() is None for p in popens):
                now = time.monotonic()
                if now - start > timeout_s:
                    kill_tree(popens)
                    return LaunchResult([p.returncode for p in popens], True, now - start)
                if first_failure is None and any(p.returncode not in (None, 0) for p in popens):
                    first_failure = now
                if first_failure is not None and now - first_failure > FAILURE_GRACE_S:
                    break
                time.sleep(0.1)
        finally:
            kill_tree(popens)  # also reaps any stragglers (daemons, grandchildren) of a clean exit
    return LaunchResult([p.returncode for p in popens], False, time.monotonic() - start)
