"""A rank's event stream: one JSON object per line, in the spirit of MLPerf's `:::MLLOG` logging.

Every worker appends what happens to RUN_DIR/rank<R>.events.jsonl (EVENTS_FILE): its start, each phase of
the timed loop as it starts and ends, every step once its clock has stopped, and its result. The harness
reads nothing else of a rank: its live display follows rank 0's stream, and the run record's rank records
are folded from the streams (rank_record). Each line is written whole by one write(2) on a file opened for
appending, so a rank killed at any moment leaves whole lines; a reader skips a line that does not parse
(the last one, still being written, or one a killed rank tore).

Every event has `event` (one of the names below), `time` (Unix seconds, when it was written) and `rank`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

EVENTS_FILE = "rank{rank}.events.jsonl"

# The events, in the order a rank writes them, with their fields besides event, time and rank:
RUN_START = "run_start"
"""kind ("training" | "commbench"), backend, world_size, process_group_size, isolated_index, host, pid,
test_hooks (core.hooks: the hooks set, or None)."""
PHASE_START = "phase_start"
"""phase (its name), first_step, and the rest of the phase's description (backends.loop.Phase): steps,
sync_grads, time_parts, traced, measured, settle, keeps. Every phase of the loop is announced, one
that does not apply to this rank with steps 0."""
STEP = "step"
"""phase, step (its index over the whole run), loss, step_time_s, tokens_per_s (the tokens this process's
group steps over, per second of this rank's step), data_prep_s (preparing its batch, before the clock),
cpu_time_s (the process's CPU time over the step, all its threads), rss_bytes (the process's resident
memory after the step), kept (False: a settle step, run and dropped);
forward_s, backward_s and optimizer_step_time_s in a phase that times the step's parts (anatomy), each
where the worker times that part."""
PHASE_END = "phase_end"
"""phase, steps (run), elapsed_s (wall time of the phase), memory (rss_bytes and the framework allocator's
peaks so far)."""
MEASURED = "measured"
"""record: everything the rank has measured but the per-step series (which its step events carry), written
before its collective trace (its comm_trace then says it was lost) and again after it, so a rank that dies
while tracing or tearing down still has its measurements on file."""
RESULT = "result"
"""record: the rank's result without its per-step series: status "ok", or a failure record (status
"failed" | "oom", error, traceback, terminated) written as the rank raised. The first is final."""


def events_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / EVENTS_FILE.format(rank=rank)


class EventLog:
    """The writer: each event one line, written by one write(2) on a file opened for appending, so every
    line is on disk (in the page cache) as soon as emit returns. Keeps nothing in memory."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = Path(path), rank
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.torn = False  # a write cut short (by an exception between its partial writes)

    def emit(self, event: str, **fields) -> dict:
        entry = {"event": event, "time": time.time(), "rank": self.rank, **fields}
        line = (json.dumps(entry, default=str) + "\n").encode()
        if self.torn:  # end the torn line, so this one parses
            line = b"\n" + line
        self.torn = True
        view = memoryview(line)
        while view:
            view = view[os.write(self.fd, view) :]
        self.torn = False
        return entry

    def close(self) -> None:
        os.close(self.fd)


def parse_lines(data: bytes) -> list[dict]:
    """The events in `data`, whole lines only; a line that does not parse is skipped."""
    events = []
    for line in data.split(b"\n"):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "event" in entry:
            events.append(entry)
    return events


def read_new(path: Path, offset: int) -> tuple[list[dict], int]:
    """The events whole lines from byte `offset` on hold, and the offset after the last whole line: a line
    still being written waits for the next call. No file yet: nothing."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    return parse_lines(chunk[:end]), offset + end


def read_events(path: Path) -> list[dict]:
    """Every whole event in the file (none where the rank left no file)."""
    return read_new(path, 0)[0]


def rank_record(events: Iterable[dict], checkpoint: str = RESULT) -> dict | None:
    """A rank's record as its events give it: the `checkpoint` event's record (RESULT: the first, the rank's
    final word; MEASURED: the last, what it had measured before or after its collective trace), with the
    per-step series its steps carry: for each phase, the fields of its kept steps that its `keeps` names,
    each under its record key (a phase that ran no step leaves an empty list). None where the rank wrote no
    such event: it was killed, or died in native code."""
    series: dict[str, list] = {}
    keeps: dict[str, str] = {}
    found: dict | None = None
    for entry in events:
        kind = entry.get("event")
        if kind == PHASE_START:
            keeps = entry.get("keeps") or {}
            for key in keeps.values():
                series.setdefault(key, [])
        elif kind == STEP and entry.get("kept", True):
            for name, key in keeps.items():
                if name in entry:
                    series[key].append(entry[name])
        elif kind == checkpoint and (checkpoint != RESULT or found is None):
            found = entry
    if found is None:
        return None
    return {**found["record"], **series}
