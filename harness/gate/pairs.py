"""The pairs of `harness gate`: base and head of each pair run in a seeded random order (or at once, in a
duet), one line per finished pair in pairs.jsonl, until the sequential test decides or the budget runs out;
a gate run again with the same --out resumes from the recorded pairs."""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.records import now_iso, write_atomic, write_json_atomic
from harness.analyze.baseline import InputError, load_all
from harness.analyze.compare import DEFAULT_MEMORY_THRESHOLD
from harness.analyze.paired import log_ratio, part_changes, run_figures
from harness.analyze.sequential import CONTINUE, Decision, Design, decide
from harness.gate.launching import Duet, Runner, RunOutcome
from harness.gate.trees import SIDES
from harness.gate.verdict import (
    Outcome,
    details,
    failure_outcome,
    fmt_change,
    fmt_interval,
    verdict_of,
    write_verdict,
)
from harness.run.launch import stopped
from harness.usage import EXIT_USAGE, UsageError

DEFAULT_MAX_MINUTES = 60.0
EXIT_INCONCLUSIVE = 3
# The gate's per-run statistic by default (one of harness.analyze.samples.STATISTICS; compare's own default
# is the median): chosen from the A/A spread of each (docs/ci-gate.md, "Which statistic"): the fastest
# step's was the lowest, and contention, a shared runner's noise, only adds time.
DEFAULT_STATISTIC = "min"
PAIRS_FILE, FAILURES_FILE, CONFIG_FILE = "pairs.jsonl", "failures.jsonl", "gate.json"
DROPPED_DIR = "dropped"  # the records of pairs that never finished


def order_of(seed: int, pair: int) -> tuple[str, str]:
    """Which side runs first in pair `pair`: a coin flip of a generator seeded by (seed, pair), so a resumed
    gate draws the orders the uninterrupted one would have."""
    return SIDES if np.random.default_rng([seed, pair]).random() < 0.5 else SIDES[::-1]


@dataclass
class Settings:
    design: Design
    statistic: str = DEFAULT_STATISTIC
    memory_threshold: float = DEFAULT_MEMORY_THRESHOLD
    max_minutes: float | None = DEFAULT_MAX_MINUTES
    inconclusive_exit: int = EXIT_INCONCLUSIVE
    order_seed: int | None = None  # None: drawn for a new gate, the recorded one on resume
    duet: Duet | None = None  # both sides of a pair at once, each on its half of the node
    match: dict = field(default_factory=dict)  # what identifies the experiment (gate.json), checked on resume


def where(run: RunOutcome, out: Path) -> str | None:
    """A run's record, relative to --out (the folder can move between an interruption and the resume)."""
    return os.path.relpath(run.path, out) if run.path is not None else None


def paired_run(run: RunOutcome, out: Path, statistic: str) -> dict:
    """What pairs.jsonl keeps of one ok run of a pair: where its record is, its figures
    (harness.analyze.paired.run_figures) and its seconds."""
    assert run.record is not None and run.path is not None
    return {"record": where(run, out), **run_figures(run.record, statistic), "seconds": run.seconds}


def read_pairs(out: Path) -> list[dict]:
    path = out / PAIRS_FILE
    if not path.is_file():
        return []
    pairs = []
    for k, line in enumerate(path.read_text().splitlines(), 1):
        try:
            pair = json.loads(line)
            if not (math.isfinite(pair["log_ratio"]) and pair["base"]["record"] and pair["head"]["record"]):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise UsageError(
                f"{path}: line {k} is not a recorded pair; move the file away to start over"
            ) from None
        pairs.append(pair)
    return pairs


def write_lines(path: Path, rows: list[dict]) -> None:
    write_atomic(
        path, lambda tmp: tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    )


def check_config(out: Path, settings: Settings) -> int:
    """A fresh --out gets gate.json; one holding another experiment (or another --order-seed) is refused.
    Returns the order seed: the one given, else a new one, else (resuming) the recorded one."""
    path = out / CONFIG_FILE
    if not path.is_file():
        if (out / PAIRS_FILE).is_file():
            raise UsageError(f"--out {out}: holds {PAIRS_FILE} but no {CONFIG_FILE}; give another --out")
        seed = settings.order_seed if settings.order_seed is not None else secrets.randbelow(2**31)
        write_json_atomic(path, {"match": settings.match, "order_seed": seed, "created": now_iso()})
        return seed
    try:
        recorded = json.loads(path.read_text())
        match, seed = recorded["match"], int(recorded["order_seed"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"--out {out}: {CONFIG_FILE} is unreadable; give another --out") from None
    mine = json.loads(json.dumps(settings.match, sort_keys=True, default=str))
    if differs := first_difference(match, mine):
        raise UsageError(
            f"--out {out} holds the pairs of another gate ({differs}); give another --out, or the same "
            "arguments to resume"
        )
    if settings.order_seed is not None and settings.order_seed != seed:
        raise UsageError(
            f"--out {out}: its pairs were ordered with --order-seed {seed}, not {settings.order_seed}; "
            "give another --out, or drop --order-seed to resume"
        )
    return seed


def first_difference(there, here, name: str = "") -> str | None:
    """'key.sub: X there, Y here' for the first setting that differs, or None."""
    if isinstance(there, dict) and isinstance(here, dict):
        for key in sorted(set(there) | set(here)):
            if found := first_difference(there.get(key), here.get(key), f"{name}.{key}" if name else key):
                return found
        return None
    return None if there == here else f"{name}: {json.dumps(there)} there, {json.dumps(here)} here"


def progress(k: int, design: Design, pair: dict, decision: Decision) -> str:
    order = pair["order"][0]
    b, h = pair["base"]["statistic"], pair["head"]["statistic"]
    return (
        f"pair {k + 1}/{design.max_pairs} ({order} first): base {b * 1e3:.1f} ms, head {h * 1e3:.1f} ms, "
        f"{math.expm1(pair['log_ratio']):+.1%}; so far {fmt_change(decision.change)}"
        f"{fmt_interval(decision.interval)} ({pair['seconds']:.0f} s)"
    )


def load_recorded(out: Path, pairs: list[dict], side: str, cache: dict[str, dict]) -> list[dict]:
    runs = []
    for pair in pairs:
        rel = pair[side]["record"]
        if rel not in cache:
            try:
                (cache[rel],) = load_all([out / rel])
            except (InputError, ValueError):
                continue  # a record moved away: the pair's statistic is recorded, the exact metrics are not
        runs.append(cache[rel])
    return runs


def set_aside_unpaired(out: Path, pairs: list[dict], say=print) -> None:
    """The records of a pair that never finished (stopped, killed, interrupted) are no evidence, and the pair
    is run again: they go to out/dropped/<side>/, so that `harness compare OUT/base OUT/head` reads the
    gate's own runs only. A failed pair's records stay: they are its verdict's evidence."""
    kept = {p[side]["record"] for p in pairs for side in SIDES}
    kept |= {f[side]["record"] for f in read_failures(out) for side in SIDES if f[side].get("record")}
    moved = 0
    for side in SIDES:
        for path in sorted((out / side).glob("*.json")):
            if os.path.relpath(path, out) not in kept:
                target = out / DROPPED_DIR / side / path.name
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
                moved += 1
    if moved:
        say(f"{moved} record(s) of a pair that did not finish moved to {out / DROPPED_DIR}")


def run_gate(settings: Settings, out: Path, runner: Runner, say=print, clock=time.monotonic) -> Outcome:
    """Pairs until the design decides or the budget runs out, resuming from those recorded in `out`; the
    verdict also goes to out/verdict.json."""
    design = settings.design
    out.mkdir(parents=True, exist_ok=True)
    seed = check_config(out, settings)
    pairs = read_pairs(out)
    cache: dict[str, dict] = {}
    say(f"order seed {seed}; runs, pairs and verdict in {out}")
    if pairs:
        say(f"resuming from {len(pairs)} pair(s) recorded in {out}")
    set_aside_unpaired(out, pairs, say)
    budget_s = settings.max_minutes * 60 if settings.max_minutes else math.inf
    outcome: Outcome | None = None
    while True:
        spent = sum(p["seconds"] for p in pairs)
        per_pair = spent / len(pairs) if pairs else 0.0
        exhausted = spent + per_pair > budget_s
        decision = decide([p["log_ratio"] for p in pairs], design, exhausted=exhausted)
        if decision.verdict != CONTINUE:
            break
        k = len(pairs)
        order = order_of(seed, k)
        start = clock()
        runs: dict[str, RunOutcome] = {}
        if settings.duet:  # both at once, each on its half; a SIGTERM reaches both (harness.run.child)
            with ThreadPoolExecutor(max_workers=2) as both:
                started = {side: both.submit(runner, side, k) for side in order}
                runs = {side: started[side].result() for side in order}
        else:
            for side in order:
                if not stopped():
                    runs[side] = runner(side, k)
        took = clock() - start
        if why := stopped():  # a run it stopped is no evidence either way: the pair is run again on resume
            say(f"gate: stopped by {why}; {len(pairs)} pair(s) recorded in {out}: the same command resumes")
            raise KeyboardInterrupt
        for side in order:
            if runs[side].returncode == EXIT_USAGE and runs[side].record is None:
                raise UsageError(f"--{side}: its harness refused the run: {runs[side].message}")
        if not (runs["base"].ok and runs["head"].ok):
            outcome = failed_pair(out, k, order, runs)
            break
        pair = {
            "pair": k,
            "order": list(order),
            "seconds": took,
            "finished": now_iso(),
            **(
                {"duet": {side: list(settings.duet.placement(side, k).half) for side in SIDES}}
                if settings.duet
                else {}
            ),
            **{side: paired_run(runs[side], out, settings.statistic) for side in SIDES},
        }
        pair["log_ratio"] = log_ratio(pair["base"], pair["head"])
        cache.update({pair[side]["record"]: runs[side].record for side in SIDES if runs[side].record})
        pairs.append(pair)
        write_lines(out / PAIRS_FILE, pairs)
        say(progress(k, design, pair, decide([p["log_ratio"] for p in pairs], design)))
    minutes = sum(p["seconds"] for p in pairs) / 60
    if outcome is None:
        used = pairs[: decision.pairs]
        base = load_recorded(out, used, "base", cache)
        head = load_recorded(out, used, "head", cache)
        found = details(base, head, used, design, settings.memory_threshold)
        outcome = verdict_of(decision, found, design, settings.inconclusive_exit, minutes, part_changes(used))
    write_verdict(
        out,
        outcome,
        pairs,
        minutes,
        step_time={"statistic": settings.statistic, "threshold": design.threshold},
        settings={"design": design.to_dict(), "order_seed": seed, "match": settings.match},
    )
    return outcome


def failed_pair(out: Path, k: int, order: tuple[str, str], runs: dict[str, RunOutcome]) -> Outcome:
    """A pair with a failed run ends the gate (verdict.failure_outcome says how); it goes to
    failures.jsonl."""
    rows = read_failures(out)
    rows.append(
        {
            "pair": k,
            "order": list(order),
            "finished": now_iso(),
            **{
                side: {
                    "ok": runs[side].ok,
                    "returncode": runs[side].returncode,
                    "record": where(runs[side], out),
                    "message": runs[side].message,
                }
                for side in SIDES
            },
        }
    )
    write_lines(out / FAILURES_FILE, rows)
    return failure_outcome(runs["base"], runs["head"])


def read_failures(out: Path) -> list[dict]:
    path = out / FAILURES_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
