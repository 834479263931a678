"""The markdown table of a comparison (harness.analyze.compare.compare_runs's dict): what `harness compare`
prints."""

from __future__ import annotations

from harness.analyze.summary import fmt_bytes


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
        "threshold, by the same test.",
        "",
        "| configuration | metric | baseline | candidate | change | test | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result["comparisons"]:
        note = " †" if c["environment_differences"] else ""
        for i, m in enumerate(c["metrics"]):
            change = "n/a" if m.get("change") is None else f"{m['change']:+.1%}"
            v = f"**{m['verdict']}**" if m["verdict"] == "regression" else m["verdict"]
            lines.append(
                f"| {c['key'] + note if i == 0 else ''} | {m['label']} | {fmt_value(m, 'baseline')} | "
                f"{fmt_value(m, 'candidate')} | {change} | {m['detail']} | {v} |"
            )
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
