"""`harness select --confirm`: the top candidates run here briefly, as `harness run` with each one's own
arguments (harness.arguments.run_argv, in the search's rows), and the predicted step against the measured
one. The one part of selection that runs anything.
"""

from __future__ import annotations

import math
from pathlib import Path

from harness.analyze.metrics import summarize
from harness.run.child import run_child


def confirm(rows: list[dict], out: Path, steps: int) -> list[dict]:
    """Each of the top candidates run briefly here (`harness run` with its run_argv, as a child:
    harness.run.child), one after the other: the predicted step time and band against the measured one. A
    run that fails is recorded as a failed candidate, never dropped, with the one line that says why; then
    the candidates are ranked again on what was measured."""
    done = []
    for r in rows:
        argv = [*r["run_argv"], "--steps", str(steps), "--warmup", "2", "--compute-method", "none"]
        child = run_child(["run", *argv, "--no-trace-comm", "--quiet"], out)
        predicted = r["step_time_s"]
        measured = None
        if child.record is not None and child.record["status"] == "ok":
            measured = float(summarize(child.record)["step_time_s"]["median"])
        entry = {
            "label": r["label"],
            "gpus": r["gpus"],
            "run_argv": r["run_argv"],
            "status": child.status,
            "record": str(child.path) if child.path is not None else None,
            "predicted_step_s": predicted,
            "measured_step_s": measured,
            "in_band": None if measured is None else bool(predicted["low"] <= measured <= predicted["high"]),
            "error": None if measured is None else float(measured / predicted["nominal"] - 1),
            "why": None if measured is not None else [child.why],
        }
        done.append(entry)
    ranked = sorted(
        range(len(done)), key=lambda i: done[i]["measured_step_s"] if done[i]["measured_step_s"] else math.inf
    )
    for rank, i in enumerate(ranked, 1):
        done[i]["measured_rank"] = rank if done[i]["measured_step_s"] is not None else None
    return done
