"""A rank's event stream (core.events): whole lines only, a torn line never hides the next, and the rank
record folded from it."""

from __future__ import annotations

import os

import pytest

from core import events as ev
from core.events import MEASURED, PHASE_START, RESULT, STEP, EventLog, rank_record, read_events, read_new

pytestmark = pytest.mark.unit


def test_a_reader_takes_whole_lines_only_and_waits_for_the_one_being_written(tmp_path):
    path = tmp_path / "rank0.events.jsonl"
    log = EventLog(path, 0)
    log.emit(STEP, step=0)
    with open(path, "ab") as f:
        f.write(b'{"event": "step", "step": 1, "lo')  # still being written
    events, offset = read_new(path, 0)
    assert [e["step"] for e in events] == [0] and offset == len(path.read_bytes().split(b"\n")[0]) + 1
    with open(path, "ab") as f:
        f.write(b'ss": 7.0}\n')
    more, _ = read_new(path, offset)
    assert [(e["step"], e["loss"]) for e in more] == [(1, 7.0)]
    assert read_new(tmp_path / "none.jsonl", 0) == ([], 0)  # a rank that has not started yet


def test_a_line_torn_by_an_exception_does_not_hide_the_next_event(tmp_path, monkeypatch):
    """A write cut short (a signal's exception between partial writes) leaves a torn line; the next event
    starts a line of its own, so the rank's failure result still parses."""
    path = tmp_path / "rank0.events.jsonl"
    log = EventLog(path, 0)
    real_write = os.write

    def half_then_raise(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise KeyboardInterrupt

    monkeypatch.setattr(ev.os, "write", half_then_raise)
    with pytest.raises(KeyboardInterrupt):
        log.emit(RESULT, record={"rank": 0, "status": "ok"})
    monkeypatch.setattr(ev.os, "write", real_write)
    log.emit(RESULT, record={"rank": 0, "status": "failed", "error": "Terminated"})
    assert [e["record"]["status"] for e in read_events(path)] == ["failed"]


def test_the_rank_record_is_the_first_result_with_the_series_its_phases_keep():
    """Each phase's `keeps` maps its kept steps' fields to the record's lists; a settle step is not kept,
    a phase with no step leaves an empty list, a later result (SIGTERM after the rank had finished) does
    not replace the first, and the last measured checkpoint is the one kept."""
    events = [
        {"event": PHASE_START, "phase": "warm-up", "keeps": {"loss": "warmup_losses"}},
        {"event": STEP, "phase": "warm-up", "loss": 9.0, "step_time_s": 1.0, "kept": True},
        {"event": PHASE_START, "phase": "measured", "keeps": {"step_time_s": "step_times", "loss": "losses"}},
        {"event": STEP, "loss": 8.0, "step_time_s": 0.2, "kept": True},
        {"event": STEP, "loss": 7.0, "step_time_s": 0.3, "kept": True},
        {"event": PHASE_START, "phase": "compute-only", "keeps": {"step_time_s": "compute_only_step_times"}},
        {"event": STEP, "loss": 7.0, "step_time_s": 0.9, "kept": False},
        {"event": STEP, "loss": 7.0, "step_time_s": 0.1, "kept": True},
        {
            "event": PHASE_START,
            "phase": "optimizer-timed",
            "keeps": {"step_time_s": "optimizer_timed_step_times"},
        },
        {"event": MEASURED, "record": {"rank": 0, "comm_trace": "lost"}},
        {"event": MEASURED, "record": {"rank": 0, "comm_trace": "done"}},
        {"event": RESULT, "record": {"rank": 0, "status": "ok"}},
        {"event": RESULT, "record": {"rank": 0, "status": "failed"}},
    ]
    assert rank_record(events) == {
        "rank": 0,
        "status": "ok",
        "warmup_losses": [9.0],
        "step_times": [0.2, 0.3],
        "losses": [8.0, 7.0],
        "compute_only_step_times": [0.1],
        "optimizer_timed_step_times": [],
    }
    assert rank_record(events, MEASURED)["comm_trace"] == "done"
    assert rank_record(events[:-2]) is None  # killed before its result: no record
