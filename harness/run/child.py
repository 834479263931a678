"""`harness ARGS` as a child process, and the record it wrote: the one way a verb or a study launches a run.

A verb that measures to decide (the gate's pairs, select's confirmation runs) and the studies in
experiments/ start `harness run` (or `commbench`) as a user would, rather than importing the runner: the
child's record, exit code and output are then exactly a user's, a crash or a hang of the run cannot take the
caller with it, and a gate can run another tree's harness than its own.

    done = run_child(["run", "--backend", "torch-ddp", "--gpus", "2"], out=Path("results/x"))
    done.ok, done.status, done.record, done.path, done.returncode, done.output, done.seconds

- **argv** (harness_argv): `python -m harness ARGS`, or with `tree` that distbench tree's harness whatever
  is installed (its folder first on sys.path; the working directory stays the caller's, so a relative path
  in ARGS means the same file for every tree); `python` picks the interpreter (default: this one).
- **output**: captured into `ChildRun.output` (the default), written to `log` and read back, or streamed to
  the caller's terminal (`stream=True`, nothing captured); stdout and stderr together, in order.
- **waiting**: a SIGTERM the caller was sent (harness.run.launch.stopped, once stop_on_sigterm is set) is
  passed on, so the run writes its record; a Ctrl-C gives the child `grace_s` to write it, then kills it; past
  `timeout_s` it is ended the same way (SIGTERM, SIGKILL after `grace_s`) and `timed_out` says so. With
  `own_group` it starts in a process group of its own and every signal goes to that whole group (a Ctrl-C at
  the terminal then reaches it through the caller only).
- **the record**: with `out`, `--out OUT` is appended and the one *.json that appears in OUT is loaded
  (core.records.load_record: migrated, checked); none where the child wrote none or several. A new file
  there that is not a record raises RecordError: something else writes into OUT.

start_child/Child.finish split the launch from the wait, for a caller that acts on the run meanwhile (sends
it a signal, watches its logs); run_child is both at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from core.records import load_record
from harness.run.launch import stopped

# `python -c BOOTSTRAP TREE ARGS...` runs TREE's `harness ARGS...` with TREE first on sys.path, so that its
# modules, not those of an editable install, are imported.
BOOTSTRAP = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('harness', run_name='__main__', alter_sys=True)"
)
POLL_S = 1.0  # how often a waiting caller checks for a SIGTERM of its own and for the timeout
GRACE_S = 60.0  # a run told to stop writes its record within this, or is killed


def harness_argv(*args: str, tree: Path | str | None = None, python: str | None = None) -> list[str]:
    """The command line of `harness ARGS`: the importable harness's, or the one of the distbench tree
    `tree`."""
    interpreter = python or sys.executable
    if tree is None:
        return [interpreter, "-m", "harness", *args]
    return [interpreter, "-c", BOOTSTRAP, str(tree), *args]


def last_line(text: str) -> str:
    """What a harness's output says went wrong: its last error line (without the `harness: error:` prefix,
    which the caller's own line carries), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        line.removeprefix("harness: error:").strip() for line in lines if line.startswith("harness: error:")
    ]
    return (errors or lines or ["(no output)"])[-1]


@dataclass
class ChildRun:
    """A finished child: its exit code, its record (None where it wrote none, or several) and that
    record's path, what it printed, and how long it took."""

    returncode: int
    record: dict | None
    path: Path | None
    output: str = ""  # stdout and stderr together; "" where it was streamed
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def status(self) -> str:
        """The record's status ("ok", "failed", "timeout", ...), or why there is no record."""
        if self.record is not None:
            return str(self.record["status"])
        return f"no record (exit {self.returncode}{', timed out' if self.timed_out else ''})"

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.record is not None and self.record["status"] == "ok"

    @property
    def why(self) -> str:
        """One line saying why the run is not ok ("" where it is): its record's error, else the last
        error line of its output."""
        if self.ok:
            return ""
        if self.record is not None and self.record["status"] != "ok":
            return (self.record.get("error") or {}).get("message") or self.status
        return last_line(self.output)


@dataclass
class Child:
    """A started child (start_child): `proc` to signal or poll it while it runs, `finish` to wait for it."""

    proc: subprocess.Popen
    out: Path | None
    before: set[Path]
    sink: IO | None
    log: Path | None
    own_group: bool
    started: float = field(default_factory=time.monotonic)

    def signal(self, signum: int) -> None:
        """`signum` to the child, or to its whole process group where it has one of its own."""
        try:
            if self.own_group:
                os.killpg(self.proc.pid, signum)
            else:
                self.proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def finish(self, timeout_s: float | None = None, grace_s: float = GRACE_S) -> ChildRun:
        """Wait for the child (module docstring: SIGTERM passed on, Ctrl-C, `timeout_s`), then find and
        load its record. Raises core.records.RecordError where the one new file in `out` is no record."""
        try:
            code, timed_out = self.wait(timeout_s, grace_s)
        finally:
            output = self.read_output()
        seconds = time.monotonic() - self.started
        new = sorted(set(self.out.glob("*.json")) - self.before) if self.out is not None else []
        if len(new) != 1:
            return ChildRun(code, None, None, output, seconds, timed_out)
        return ChildRun(code, load_record(new[0]), new[0], output, seconds, timed_out)

    def wait(self, timeout_s: float | None, grace_s: float) -> tuple[int, bool]:
        """(exit code, timed out)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        told = False
        try:
            while True:
                try:
                    return self.proc.wait(timeout=POLL_S), False
                except subprocess.TimeoutExpired:
                    if stopped() and not told:
                        self.signal(signal.SIGTERM)
                        told = True
                    if deadline is not None and time.monotonic() > deadline:
                        self.end(signal.SIGTERM, grace_s)
                        return self.proc.wait(), True
        except KeyboardInterrupt:
            if self.own_group:  # the terminal's Ctrl-C reached the caller's group only
                self.signal(signal.SIGINT)
            self.end(None, grace_s)
            raise

    def end(self, signum: int | None, grace_s: float) -> None:
        """`signum` (None: none, it was sent already), `grace_s` to end, then SIGKILL."""
        if signum is not None:
            self.signal(signum)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()

    def read_output(self) -> str:
        if self.sink is None:
            return ""
        if self.log is None:  # the temporary file
            self.sink.seek(0)
            text = self.sink.read().decode(errors="replace")
        else:
            self.sink.flush()
            text = self.log.read_text(errors="replace")
        self.sink.close()
        return text


def start_child(
    args: Sequence[str],
    out: Path | None = None,
    *,
    tree: Path | str | None = None,
    python: str | None = None,
    log: Path | None = None,
    stream: bool = False,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    cwd: Path | str | None = None,
    own_group: bool = False,
) -> Child:
    """Start `harness ARGS [--out OUT]` (module docstring). `env`: variables set on top of this process's;
    `prefix`: a command the harness runs under (`taskset --cpu-list 0,1`); `log`: its output's file."""
    tail = ["--out", str(out)] if out is not None else []
    argv = [*prefix, *harness_argv(*args, *tail, tree=tree, python=python)]
    before: set[Path] = set()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        before = set(out.glob("*.json"))
    sink: IO | None = None
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        sink = open(log, "w")
    elif not stream:
        sink = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **env} if env else None,
            cwd=cwd,
            stdout=sink,
            stderr=subprocess.STDOUT if sink is not None else None,
            stdin=subprocess.DEVNULL,
            start_new_session=own_group,
        )
    except BaseException:
        if sink is not None:
            sink.close()
        raise
    return Child(proc, out, before, sink, log, own_group)


def run_child(
    args: Sequence[str],
    out: Path | None = None,
    *,
    timeout_s: float | None = None,
    grace_s: float = GRACE_S,
    **how,
) -> ChildRun:
    """`harness ARGS [--out OUT]` from start to end: start_child's options (`tree`, `python`, `log`,
    `stream`, `env`, `prefix`, `cwd`, `own_group`), then Child.finish's wait and record."""
    return start_child(args, out, **how).finish(timeout_s, grace_s)
