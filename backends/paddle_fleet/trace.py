"""Paddle's collective trace reader: the fused all-reduces of Paddle DataParallel's reducer, read from the
glog lines its C++ code writes to stderr at VLOG 3 (captured around the traced steps by the paddle-fleet
worker). Framework-free; entries are backends.comm_trace's.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
import stat
import sys
import tempfile
from contextlib import contextmanager
from datetime import datetime, timedelta

from backends.comm_trace import collective

# glog's line prefix (Paddle's C++ log): severity, MMDD, wall-clock time to the microsecond, thread id,
# file:line], message
GLOG_LINE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +(\d+) ([^:\]\s]+):\d+\] ?(.*)$")
# Paddle's EagerReducer (paddle/fluid/distributed/collective/reducer.cc) at VLOG(3)
REDUCER_GROUP = re.compile(r"The Group\[(\d+)\]:numel: (\d+) ;var number: (\d+)")
REDUCER_VAR_TYPE = re.compile(r"^var\[.*\] 's type is (\w+)")
REDUCER_START = re.compile(r"^group \[(\d+)\] start fused_allreduce")
# The files whose lines end a fused all-reduce (the reducer's own and the gradient hook's return): other
# files that log on the thread meanwhile (Paddle's API at a user's GLOG_v) run inside the call
REDUCER_FILES = ("reducer.cc", "accumulation_node.cc")
EPOCH = datetime(1970, 1, 1)


def glog_entries(text: str, now: datetime | None = None) -> list[tuple[int, str, str, str]]:
    """The lines glog wrote, as (microseconds since 1970, thread, file, message), in whole microseconds so
    differences are exact; a message's continuation lines (text without the prefix) are left out. glog
    writes no year: each line's is the latest that does not put it after `now` (default: the present; the
    log is read as it is written), so a log that runs past New Year's midnight counts on. Its times are
    local: a clock change while the log runs (daylight saving) is not undone."""
    now = now or datetime.now()
    entries: list[tuple[int, str, str, str]] = []
    for line in text.splitlines():
        m = GLOG_LINE.match(line)
        if not m:
            continue
        month, day, hour, minute, second, micro, thread, file, message = m.groups()
        fields = (int(month), int(day), int(hour), int(minute), int(second), int(micro))
        for year in range(now.year, now.year - 8, -1):  # back to a leap year for a 29 February
            try:
                when = datetime(year, *fields)
            except ValueError:
                continue
            if when <= now + timedelta(days=1):  # a day's slack for a log written in another time zone
                break
        entries.append(((when - EPOCH) // timedelta(microseconds=1), thread, file, message))
    return entries


def glog_levels(modules, environ) -> dict[str, int]:
    """The VLOG level glog gave each module from the environment: its GLOG_vmodule entry, else GLOG_v,
    else 0 (Paddle's binding can set a level but not read one back)."""
    vmodule = dict(item.split("=", 1) for item in environ.get("GLOG_vmodule", "").split(",") if "=" in item)
    default = environ.get("GLOG_v", "0")
    levels = {}
    for module in modules:
        level = vmodule.get(module, default).strip()
        levels[module] = int(level) if level.lstrip("-").isdigit() else 0
    return levels


def paddle_reducer_groups(text: str) -> dict:
    """Paddle DataParallel's gradient groups as its reducer logs them when it is built (VLOG 3 of
    reducer.cc): elements per group index, and the parameters' dtype (None if they differ)."""
    entries = glog_entries(text)
    groups = {int(m[1]): int(m[2]) for *_, msg in entries if (m := REDUCER_GROUP.search(msg))}
    dtypes = {m[1] for *_, msg in entries if (m := REDUCER_VAR_TYPE.search(msg))}
    return {"elements": groups, "dtype": dtypes.pop() if len(dtypes) == 1 else None}


def paddle_reducer_collectives(
    text: str, groups: dict, world: int, now: datetime | None = None
) -> list[dict]:
    """The collectives of Paddle DataParallel's reducer log over the traced steps, one dict per call.

    The reducer logs "group [k] start fused_allreduce" and then concatenates the group's gradients, scales
    them by 1/n and all-reduces them. On CPU the gloo all-reduce runs on the calling thread
    (ProcessGroupGloo::AllReduce runs its task before it returns), so the call ends before that thread's
    next line from REDUCER_FILES: the next group's start, the gradient hook's return
    (accumulation_node.cc, logged at the same level), or "Reducer is finished" after the last group, which
    follows the copy of the reduced gradients back into their tensors. A call's time thus includes its
    concatenation and scaling (and the last one's copy back): an upper bound by those copies. Nothing
    else runs on that thread meanwhile, so no compute overlaps it (0). `groups`: paddle_reducer_groups of
    the reducer's construction; `now`: as glog_entries takes it."""
    entries = glog_entries(text, now)
    t0 = entries[0][0] if entries else 0
    out = []
    for i, (start, thread, _, message) in enumerate(entries):
        m = REDUCER_START.search(message)
        if not m:
            continue
        end = next(
            (
                t
                for t, th, file, _ in itertools.islice(entries, i + 1, None)
                if th == thread and file in REDUCER_FILES
            ),
            None,
        )
        out.append(
            collective(
                "all_reduce",
                "paddle DataParallel fused_allreduce",
                groups["elements"].get(int(m[1])),
                groups["dtype"],
                world,
                (start - t0) / 1e6,
                (end - start) / 1e6 if end is not None else None,
                0.0 if end is not None else None,
            )
        )
    return out


@contextmanager
def captured_stderr():
    """What this process writes to file descriptor 2 for the duration (what C++ code logs there: glog), as
    the "text" of the dict it yields, set on exit. Where fd 2 is a regular file opened for appending (a
    worker's rank log), the text is read back from that file, so the log keeps every line as it is
    written, even if the process dies meanwhile. Otherwise fd 2 goes to a temporary file for the
    duration, and the text is then written on to the real stderr too."""
    sys.stderr.flush()
    captured: dict = {"text": ""}
    log = "/proc/self/fd/2"
    appended = stat.S_ISREG(os.fstat(2).st_mode) and fcntl.fcntl(2, fcntl.F_GETFL) & os.O_APPEND
    if appended and os.path.exists(log):  # every write lands at the file's end, where reading starts
        start = os.fstat(2).st_size
        try:
            yield captured
        finally:
            sys.stderr.flush()
            with open(log, "rb") as f:
                f.seek(start)
                captured["text"] = f.read().decode(errors="replace")
        return
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            data = sink.read()
            captured["text"] = data.decode(errors="replace")
            unwritten = memoryview(data)
            while unwritten:
                unwritten = unwritten[os.write(2, unwritten) :]
