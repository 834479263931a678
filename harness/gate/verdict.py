"""The verdict of `harness gate`: its line and exit code, the details beside the step time (exact metrics,
peak memory, the CPU companion, each part of the step's change and the part that moved), and its files:
OUT/verdict.json, and OUT/verdict.md, the markdown a pull request's comment shows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.records import now_iso, write_atomic, write_json_atomic
from harness.analyze.anatomy import LABELS
from harness.analyze.compare import compare_memory, memory_field
from harness.analyze.compare_table import anatomy_line, moved_text, part_change_text
from harness.analyze.paired import cpu_companion, exact_changes, log_ratio_sd
from harness.analyze.sequential import INCONCLUSIVE, NO_REGRESSION, REGRESSION, Decision, Design
from harness.analyze.summary import fmt_bytes
from harness.gate.launching import RunOutcome
from harness.usage import EXIT_FAILED, EXIT_OK, EXIT_USAGE

VERDICT_FILE, VERDICT_MARKDOWN = "verdict.json", "verdict.md"


def fmt_change(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def fmt_interval(interval) -> str:
    return "" if not interval else f" [{interval[0]:+.1%}, {interval[1]:+.1%}]"


def memory_lines(base: list[dict], head: list[dict], threshold: float) -> list[dict]:
    """Peak memory per rank, by harness compare's rule (median per side, relative growth over the
    threshold)."""
    field_name, label = memory_field(base + head)
    m = compare_memory(base, head, field_name, label, threshold)
    if m["change"] is None:
        return []
    m["line"] = (
        f"{label}: {fmt_bytes(m['baseline'])} -> {fmt_bytes(m['candidate'])} ({m['change']:+.1%}; "
        f"threshold {threshold:.0%}): {m['verdict']}"
    )
    return [m]


def details(
    base: list[dict], head: list[dict], pairs: list[dict], design: Design, threshold: float
) -> list[dict]:
    """What the verdict reports beside the step time, from the runs of the pairs it rests on: each exact
    metric's change, peak memory by compare's rule (`threshold`) and the CPU-time companion."""
    found = exact_changes(base, head) + (memory_lines(base, head, threshold) if base and head else [])
    cpu = cpu_companion(pairs, design)
    if cpu is not None:
        found.append(
            {
                "metric": "CPU time per step",
                "verdict": "companion",
                **cpu,
                "line": f"CPU time per step (companion, not gated): {fmt_change(cpu['change'])}"
                f"{fmt_interval(cpu['interval'])}",
            }
        )
    return found


@dataclass
class Outcome:
    verdict: str  # REGRESSION | NO REGRESSION | INCONCLUSIVE (capitals), or "ERROR"
    exit_code: int
    line: str
    decision: Decision | None = None
    details: list[dict] = field(default_factory=list)
    anatomy: dict | None = None  # each part's change over the pairs (harness.analyze.paired.part_changes)


def anatomy_text(anatomy: dict | None) -> str | None:
    """Every part's change over the pairs in one line, as the gate prints it beside the verdict."""
    return None if anatomy is None else f"step anatomy, head against base: {anatomy_line(anatomy)}"


def verdict_of(
    decision: Decision,
    details: list[dict],
    design: Design,
    inconclusive_exit: int,
    minutes: float,
    anatomy: dict | None = None,
) -> Outcome:
    """The verdict on the pairs' decision and the details; where the step time is found slower (or faster),
    the line names the part of the step that moved that way, from `anatomy` (paired.part_changes)."""
    spent = f"{decision.pairs} pair(s), {minutes:.1f} min"
    step = f"step time {fmt_change(decision.change)}{fmt_interval(decision.interval)}"
    grew = [d for d in details if d["verdict"] == "regression"]
    if decision.verdict == REGRESSION or grew:
        reasons = []
        if decision.verdict == REGRESSION:
            reasons.append(f"{step} (repeated {decision.coverage:.0%} interval)")
            if anatomy is not None:
                reasons.append(moved_text(anatomy, +1))
        reasons += [d["line"] for d in grew]
        return Outcome(
            "REGRESSION",
            EXIT_FAILED,
            f"REGRESSION: {'; '.join(reasons)} ({spent})",
            decision,
            details,
            anatomy,
        )
    if decision.verdict == NO_REGRESSION:
        faster = decision.interval is not None and decision.interval[1] < 0 and anatomy is not None
        return Outcome(
            "NO REGRESSION",
            EXIT_OK,
            f"NO REGRESSION: {step} rules out a slowdown of {design.threshold:.0%} or more"
            + (f"; faster: {moved_text(anatomy, -1)}" if faster and anatomy is not None else "")
            + f" ({spent})",
            decision,
            details,
            anatomy,
        )
    assert decision.verdict == INCONCLUSIVE
    which = "--max-pairs" if decision.pairs >= design.max_pairs else "--max-minutes"
    could = (
        f"these pairs could have detected a slowdown of {decision.detectable:.1%} or more"
        if decision.detectable is not None
        else "too few pairs to estimate what they could detect"
    )
    return Outcome(
        "INCONCLUSIVE",
        inconclusive_exit,
        f"INCONCLUSIVE: {step} after {spent}: the budget ({which}) ran out; {could}",
        decision,
        details,
        anatomy,
    )


def failure_outcome(base: RunOutcome, head: RunOutcome) -> Outcome:
    """A pair with a failed run: a head failing where the base ran is a regression (as in compare); a base
    failing (alone or with the head) leaves nothing to gate against."""
    if base.ok:
        return Outcome(
            "REGRESSION", EXIT_FAILED, f"REGRESSION: a head run failed where the base ran: {head.message}"
        )
    if head.ok:
        line = (
            f"harness: error: a base run failed where the head ran ({base.message}): nothing to gate against"
        )
    else:
        line = f"harness: error: runs failed on both sides (base: {base.message}; head: {head.message})"
    return Outcome("ERROR", EXIT_USAGE, line)


def write_verdict(
    out: Path, outcome: Outcome, pairs: list[dict], minutes: float, step_time: dict, settings: dict
) -> dict:
    """OUT/verdict.json and OUT/verdict.md (`out` is OUT): the outcome, the pairs run and what they cost,
    and `settings` (the design, order seed and match, as gate.json has them); `step_time` is added to the
    decision's figures (the statistic and threshold). Returns what verdict.json holds."""
    verdict = {
        "verdict": outcome.verdict,
        "exit_code": outcome.exit_code,
        "line": outcome.line,
        "step_time": None if outcome.decision is None else {**outcome.decision.to_dict(), **step_time},
        "pairs_run": len(pairs),
        # the spread that sets what a gate on this machine costs (docs/ci-gate.md: a budget for a runner)
        "log_ratio_sd": log_ratio_sd(pairs),
        "minutes": minutes,
        "details": outcome.details,
        "anatomy": outcome.anatomy,
        **settings,
        "finished": now_iso(),
    }
    write_json_atomic(out / VERDICT_FILE, verdict)
    write_atomic(out / VERDICT_MARKDOWN, lambda tmp: tmp.write_text(verdict_markdown(verdict)))
    return verdict


def verdict_markdown(verdict: dict) -> str:
    """The verdict as a pull-request comment or job summary shows it: the verdict, the step time's change
    with its repeated interval, the pairs and minutes spent, what those pairs could detect, the exact
    and memory metrics, and each part of the step's change with the part that moved."""
    step = verdict.get("step_time") or {}
    design = verdict["design"]
    rows = [
        (
            "step time, head against base",
            f"{fmt_change(step.get('change'))}{fmt_interval(step.get('interval'))}",
        ),
        ("interval", f"repeated {step['interval_coverage']:.0%}, valid at every look" if step else "n/a"),
        (
            "threshold",
            f"a slowdown of {design['threshold']:.0%} ({step.get('statistic', 'median')} step a run)",
        ),
        ("pairs", f"{verdict['pairs_run']} of at most {design['max_pairs']} ({verdict['minutes']:.1f} min)"),
        (
            "smallest slowdown these pairs detect",
            "n/a"
            if step.get("detectable") is None
            else f"{step['detectable']:.1%} (power {1 - design['beta']:.0%})",
        ),
        ("order seed", str(verdict["order_seed"])),
    ]
    lines = [f"### distbench gate: {verdict['verdict']}", "", verdict["line"], "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += [f"| {d['metric']} | {d['line']} |" for d in verdict["details"]]
    anatomy = verdict.get("anatomy")
    if anatomy:
        lines += [
            f"| {LABELS[name]}, head against base | {part_change_text(name, p)} |"
            for name, p in anatomy["parts"].items()
        ]
        lines.append(f"| which part moved | {moved_text(anatomy)} |")
    return "\n".join(lines) + "\n"
