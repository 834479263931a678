"""What a run is doing while it runs: its phase, step i of n, the latest loss, step time and tokens/s, elapsed
time and ETA.

Read from rank 0's event stream (core.events: its phases as they start, each step after the step's clock
has stopped), by a thread of the harness process that polls the file: nothing enters a worker's timed
region. On a terminal it is a live rich display; otherwise, or with --quiet, plain lines (one per phase
and a few per phase for the steps), so CI logs stay readable. The runner tells it the phases it alone
knows (launching, the isolated counterfactual's launches, writing the record); the worker's events tell
the rest (warm-up, measured, timing the optimizer, compute-only, tracing collectives).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from core.events import PHASE_START, STEP, read_new
from harness.analyze.summary import incident_text

# The loop's phases (backends.loop.training_phases) as the display names them.
PHASE_LABELS = {
    "optimizer-timed": "timing the optimizer",  # records made before the anatomy phase
    "anatomy": "timing the step's parts",
    "traced": "tracing collectives",
}
POLL_S = 0.25
PLAIN_LINES_PER_PHASE = 4  # step lines printed per phase in plain mode, besides the phase's first line


def clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class RunDisplay:
    """The progress of one run. `live`: a rich display on `progress` (shared by a sweep with its own bar);
    else plain lines on `stream`. Use as a context manager around the run; `phase()` at each phase the
    runner starts, with rank 0's event stream to follow."""

    def __init__(self, live: bool, stream: TextIO | None = None, progress: Progress | None = None):
        self.live = live
        self.stream = stream or sys.stdout
        self.owns_progress = live and progress is None
        self.progress = progress or (make_progress(self.stream) if live else None)  # None: plain lines
        self.task: TaskID | None = None
        self.start = time.monotonic()
        self.lock = threading.Lock()
        self.events: Path | None = None
        self.offset = 0
        self.name = ""
        self.total = 0
        self.done = 0
        self.phase_start = self.start
        self.muted = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.follow, daemon=True)

    # ---------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> RunDisplay:
        if self.owns_progress and self.progress is not None:
            self.progress.start()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.poll()  # the lines written since the last poll
        if self.progress is not None:
            if self.task is not None:
                self.progress.remove_task(self.task)
            if self.owns_progress:
                self.progress.stop()

    def phase(self, name: str, events: Path | None = None, total: int = 0, detail: str = "") -> None:
        """Enter a runner-known phase; follow `events` (rank 0's stream) from its start if given."""
        self.poll()
        with self.lock:
            if events is not None:
                self.events, self.offset = events, 0
            self.enter(name, total, detail)

    def finish(self, record: dict, tail_lines: int = 5) -> None:
        """The end: the run's status and, on failure, the failing rank's last lines as the record has them
        (`tail_lines` of them: 0 where the summary printed next shows them all)."""
        error = record.get("error") or {}
        incident = record.get("incident")
        self.say(
            f"{record['status']}"
            + (f": {error.get('message', '')}" if error else "")
            + (f", with an incident after the measured steps: {incident_text(incident)}" if incident else "")
        )
        for line in (error.get("log_tail") or [])[-tail_lines:] if tail_lines else []:
            self.say(f"  | {line}")

    # ------------------------------------------------------------------------------------------ updates
    def enter(self, name: str, total: int, detail: str = "") -> None:
        self.name, self.total, self.done = name, total, 0
        self.phase_start = time.monotonic()
        label = f"{name} {detail}".strip()
        if self.progress is not None:
            if self.task is not None:
                self.progress.remove_task(self.task)
            self.task = self.progress.add_task(label, total=total or None, status="")
        else:
            self.say(f"{label}" + (f": {total} step(s)" if total else ""))

    def worker_phase(self, event: dict) -> None:
        """A phase of rank 0's loop starts; one that runs no step here is not shown. The isolated
        counterfactual's workers run the same phases, counted as one."""
        if self.name != "isolated counterfactual" and event["steps"]:
            self.enter(PHASE_LABELS.get(event["phase"], event["phase"]), event["steps"])

    def step(self, event: dict) -> None:
        """One of rank 0's steps."""
        self.done += 1
        tokens_per_s = event.get("tokens_per_s") or 0.0
        status = (
            f"step {event['step']} loss {event['loss']:.4f} | {event['step_time_s'] * 1e3:.1f} ms | "
            f"{tokens_per_s:,.0f} tokens/s"
        )
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=self.done, status=status)
            return
        every = max(1, self.total // PLAIN_LINES_PER_PHASE) if self.total else 1
        if self.done == self.total or self.done % every == 0:
            left = self.total - self.done
            eta = (time.monotonic() - self.phase_start) / self.done * left if self.total else None
            self.say(
                f"  {self.name} {self.done}/{self.total or '?'}: {status}"
                + (f" | ETA {clock(eta)}" if eta is not None else "")
            )

    def say(self, text: str) -> None:
        """Print a line; if the reader has gone (`harness run | head`), stop printing, never the run."""
        if self.muted:
            return
        try:
            if self.progress is not None:
                self.progress.console.print(text)
            else:
                print(f"[{clock(time.monotonic() - self.start)}] {text}", file=self.stream, flush=True)
        except BrokenPipeError:
            self.muted = True

    # ------------------------------------------------------------------------------------------ reading
    def follow(self) -> None:
        while not self.stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        with self.lock:
            if self.events is None:
                return
            events, self.offset = read_new(self.events, self.offset)  # whole lines only
            for event in events:
                if event["event"] == PHASE_START:
                    self.worker_phase(event)
                elif event["event"] == STEP:
                    self.step(event)


def make_progress(stream: TextIO) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=Console(file=stream),
        transient=False,
    )


class NoDisplay:
    """What the runner calls when nobody watches (multi-node followers' records, tests, library use)."""

    def phase(self, name: str, events: Path | None = None, total: int = 0, detail: str = "") -> None:
        pass


NO_DISPLAY = NoDisplay()
