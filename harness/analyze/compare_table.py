"""The markdown table of a comparison (harness.analyze.compare.compare_runs's dict): what `harness compare`
prints; and the text of each part's change (harness.analyze.compare.part_change), which `harness gate`
prints too."""

from __future__ import annotations

from harness.analyze.anatomy import CONFIDENCE, LABELS
from harness.analyze.compare import moved_part
from harness.analyze.summary import fmt_bytes

# How a part that moved is said, by the direction asked of it (harness.analyze.compare.moved_part).
NOTHING_MOVED = {
    0: "no part's change is resolved from zero",
    1: "no part's slowdown is resolved from zero",
    -1: "no part's speed-up is resolved from zero",
}


def part_change_text(name: str, p: dict) -> str:
    """One part's change: its milliseconds, its share of the baseline's step and its interval; or why
    there is none."""
    label = LABELS[name]
    if p["s"] is None:
        return f"{label} {p['status']} ({p['note']})"
    share = f" ({p['share']:+.1%} of the step)" if p["share"] is not None else ""
    interval = f" [{p['ci'][0] * 1e3:+.1f}, {p['ci'][1] * 1e3:+.1f}]" if p["ci"] else f" ({p['note']})"
    return f"{label} {p['s'] * 1e3:+.1f} ms{share}{interval}"


def moved_text(anatomy: dict, direction: int = 0) -> str:
    """The part that moved (most, or in `direction`), named with its change; or that none is resolved."""
    name = moved_part(anatomy["parts"], direction)
    if name is not None:
        most = " most" if direction == 0 else ""
        return f"{part_change_text(name, anatomy['parts'][name])}, the part that moved{most}"
    if not any(p["ci"] for p in anatomy["parts"].values()):
        return "no part's change has an interval, so none is named"
    return NOTHING_MOVED[direction]


def anatomy_line(anatomy: dict) -> str:
    """Every part's change and the part that moved most, in one line."""
    parts = " · ".join(part_change_text(name, p) for name, p in anatomy["parts"].items())
    return f"{parts}; {moved_text(anatomy)}"


def fmt_value(metric: dict, side: str) -> str:
    value = metric.get(side)
    if value is None:
        return "n/a"
    if metric["unit"] == "bytes":
        return fmt_bytes(value)
    if metric["unit"] == "s":
        return f"{value * 1e6:,.1f} µs"
    return f"{value:,.0f} tok/s ({metric[side + '_step_time_s'] * 1e3:.1f} ms/step)"


def markdown(result: dict) -> str:
    s = result["settings"]
    headline = {"ok": "no regression", "regression": "REGRESSION"}[result["result"]]
    counts = (
        f"{result['regressions']} regression(s), {result['improvements']} improvement(s)"
        + (f", {result['newly_failing']} newly failing run(s)" if result["newly_failing"] else "")
        + f" in {len(result['comparisons'])} matched configuration(s)"
    )
    side = lambda d: f"`{d['path']}` ({d['runs']} runs; commit {', '.join(c[:10] for c in d['commits'])})"  # noqa: E731
    lines = [
        f"### distbench compare: {headline}",
        "",
        counts + ".",
        "",
        f"Baseline {side(result['baseline'])} vs candidate {side(result['candidate'])}. "
        f"A regression is throughput down by more than {s['threshold']:.0%} with significantly different "
        f"step times (Welch's t-test on the runs' log step times, alpha {s['alpha']}; step time of a run: "
        f"its {s['statistic']}; MDC: the change these runs would detect 80% of the time), "
        f"or peak memory / model state up by more than {s['memory_threshold']:.0%}. A commbench op "
        "regresses when its time (geometric mean over sizes of the median call) grows by more than the "
        "threshold, by the same test. Beside a step-time verdict, the part of the step that moved that way "
        "(below the table).",
        "",
        "| configuration | metric | baseline | candidate | change | test | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        note = " †" if c["environment_differences"] else ""
        for i, m in enumerate(c["metrics"]):
            change = "n/a" if m.get("change") is None else f"{m['change']:+.1%}"
            v = f"**{m['verdict']}**" if m["verdict"] == "regression" else m["verdict"]
            if m["verdict"] in ("regression", "improvement") and "part_that_moved" in m:
                moved = m["part_that_moved"]  # the part that moved the verdict's way (compare.moved_part)
                v += (
                    f": {LABELS[moved]} {c['anatomy']['parts'][moved]['s'] * 1e3:+.1f} ms moved"
                    if moved
                    else ": no part resolved"
                )
            lines.append(
                f"| {c['key'] + note if i == 0 else ''} | {m['label']} | {fmt_value(m, 'baseline')} | "
                f"{fmt_value(m, 'candidate')} | {change} | {m['detail']} | {v} |"
            )
    with_anatomy = [c for c in result["comparisons"] if c.get("anatomy")]
    if with_anatomy:
        lines += [
            "",
            "Where the step time went, part by part (the step's anatomy), candidate against baseline: the "
            "change in ms and as a share of the baseline's step, with its "
            f"{CONFIDENCE:.0%} bootstrap interval over the runs (the median of the candidate's runs less the "
            "baseline's); a part unresolved in any run is not compared, nor named:",
        ]
        lines += [f"- {c['key']}: {anatomy_line(c['anatomy'])}" for c in with_anatomy]
    diffs = [c for c in result["comparisons"] if c["environment_differences"]]
    if diffs:
        lines += ["", "† Environment or settings differ (baseline -> candidate):"]
        lines += [f"- {c['key']}: " + "; ".join(c["environment_differences"]) for c in diffs]
    if result["not_compared"]:
        lines += ["", "Runs not compared (status is not ok):"]
        lines += [
            f"- {n['side']} `{n['run_id']}` ({n['key']}): {n['status']}"
            + (f": {n['error']}" if n["error"] else "")
            + (" — **newly failing**" if n["newly_failing"] else "")
            for n in result["not_compared"]
        ]
    for side_name in ("baseline", "candidate"):
        unmatched = result[f"only_in_{side_name}"]
        if unmatched:
            lines += ["", f"Only in the {side_name} (not compared):"] + [f"- {k}" for k in unmatched]
    return "\n".join(lines) + "\n"
