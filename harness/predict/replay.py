"""The interval replay of one step: compute segments on one stream, the collectives on another in the order
they become ready, and how much of each the other hides. Pure interval arithmetic: the step model
(harness.predict.model) gives it the segments' seconds and each call's price.
"""

from __future__ import annotations

import numpy as np

from backends.schedule import Message


def replay(durations, messages: list[Message], comm_time) -> dict:
    """Compute segments in order on one stream, collectives in the order they become ready on another (one
    at a time, as NCCL serialises a communicator's calls). A segment waits for the messages it needs."""
    n = len(durations)
    start, end = np.zeros(n), np.zeros(n)
    done: dict[int, float] = {}  # message index -> when its collective ends, once issued
    intervals, comm_free, clock, scheduled = [], 0.0, 0.0, 0

    def ready(m):
        return (end[m.after] if m.after >= 0 else 0.0) + m.delay_s

    order = sorted(range(len(messages)), key=lambda i: (messages[i].after, i))

    spans: dict[int, tuple[float, float]] = {}  # message index -> (start, end) on the comm stream

    def issue(upto):  # every message ready at the end of segment `upto` or earlier
        nonlocal comm_free, scheduled
        batch = []
        while scheduled < len(order) and messages[order[scheduled]].after <= upto:
            batch.append(order[scheduled])
            scheduled += 1
        for i in sorted(batch, key=lambda i: (ready(messages[i]), i)):
            t0 = max(comm_free, ready(messages[i]))
            comm_free = t0 + comm_time(messages[i])
            done[i] = comm_free
            intervals.append((t0, comm_free))
            spans[i] = (t0, comm_free)

    needed: dict[int, list[int]] = {}
    for i, m in enumerate(messages):
        if m.before is not None:
            needed.setdefault(m.before, []).append(i)
    for k in range(n):
        issue(k - 1)
        wait = max((done[i] for i in needed.get(k, [])), default=0.0)
        start[k] = max(clock, wait)
        end[k] = clock = start[k] + durations[k]
    issue(n)
    step = max(clock, comm_free)
    overlapped = overlap(intervals, list(zip(start, end)))
    # Where compute stands idle (waiting for a collective, or the step's tail after the last segment), the
    # collectives then on the wire are the exposed time, each charged for its own share of it.
    before = [float(end[k - 1]) if k else 0.0 for k in range(n)]
    idle = [(before[k], float(start[k])) for k in range(n) if start[k] > before[k]]
    if step > clock:
        idle.append((float(clock), float(step)))
    exposed = shares(spans, idle)
    return {
        "step_s": step,
        "compute_s": float(np.sum(durations)),
        "comm_busy_s": sum(b - a for a, b in intervals),
        "overlapped_s": overlapped,
        "exposed_by_message": exposed,
        "busy_by_message": {i: b - a for i, (a, b) in spans.items()},
    }


def shares(spans: dict[int, tuple[float, float]], idle: list[tuple[float, float]]) -> dict[int, float]:
    """Each span's time inside the sorted, disjoint `idle` intervals, in one pass over both: the spans are
    one stream's calls, disjoint and in time order (a pair per span would be quadratic in the calls, and a
    large model issues thousands a step)."""
    out, j = {}, 0
    for i, (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        while j < len(idle) and idle[j][1] <= a:
            j += 1
        total, k = 0.0, j
        while k < len(idle) and idle[k][0] < b:
            total += max(0.0, min(b, idle[k][1]) - max(a, idle[k][0]))
            k += 1
        out[i] = total
    return out


def overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    """Total time two sorted lists of disjoint intervals share, in one pass over both (the collectives of
    one communication stream against the compute segments of one stream)."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        (a, b), (c, d) = first[i], second[j]
        total += max(0.0, min(b, d) - max(a, c))
        if b < d:
            i += 1
        else:
            j += 1
    return total
