"""`harness history`: one metric of one configuration across git commits, from the records on disk.

Each record knows the commit it ran at (environment.git.commit, with a dirty flag) and when it started;
runs of one commit are aggregated (median, min, max) and commits are ordered by their first run, so the
table reads as the project's timeline. A dirty tree is its own row: it is not the commit it sits on.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np

from core.records import device_name, run_config, workload_name, write_atomic
from harness.analyze.baseline import InputError, load_all
from harness.analyze.compare import run_key
from harness.usage import EXIT_OK, UsageError, positive

DEFAULT_METRIC = "throughput_tokens_per_s"


def metric_names(summary: dict) -> list[str]:
    """Numeric summary figures, with nested statistics as e.g. step_time_s.median."""
    names = []
    for k, v in summary.items():
        if isinstance(v, dict):
            names += [f"{k}.{s}" for s, x in v.items() if isinstance(x, (int, float)) or x is None]
        elif (isinstance(v, (int, float)) or v is None) and not isinstance(v, bool):
            names.append(k)
    return sorted(names)


def metric_value(summary: dict, name: str):
    value: object = summary
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def select(runs: list[dict], args) -> list[dict]:
    """The runs of exactly one configuration; several left after the filters is a usage error."""

    def wanted(r):
        cfg = run_config(r)
        return (
            r.get("kind", "training") == "training"
            and args.backend in (r["backend_info"].get("label"), cfg.backend)
            and args.workload == workload_name(cfg)
            and cfg.topology.world_size == args.gpus
            and (args.precision is None or cfg.model.precision == args.precision)
            and (args.scaling is None or cfg.batch.scaling == args.scaling)
            and (args.device_kind is None or r["environment"].get("device_kind") == args.device_kind)
        )

    chosen = [r for r in runs if wanted(r)]
    if not chosen:
        raise InputError(
            f"no records for backend {args.backend}, workload {args.workload}, {args.gpus} GPU(s) "
            f"with these filters among {len(runs)} record(s)"
        )
    keys = sorted({run_key(r) for r in chosen if device_name(r)})
    if len(keys) > 1:
        raise InputError(
            f"several configurations match: {'; '.join(k.text() for k in keys)}; narrow with "
            f"--backend LABEL, --precision, --scaling or --device-kind"
        )
    return chosen


def start_time(run: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(run["environment"]["start_time"])


def history_rows(runs: list[dict], metric: str) -> list[dict]:
    """One row per (commit, dirty) in order of first run: the metric's median/min/max over its ok runs."""
    by_commit: dict[str, list[dict]] = {}
    for run in sorted(runs, key=start_time):
        git = run["environment"].get("git") or {}
        commit = (git.get("commit") or "unknown")[:10] + ("+dirty" if git.get("dirty") else "")
        by_commit.setdefault(commit, []).append(run)
    rows, previous = [], None
    for commit, group in by_commit.items():
        values = [metric_value(r["summary"], metric) for r in group if r["status"] == "ok"]
        values = [v for v in values if v is not None]
        median = float(np.median(values)) if values else None
        rows.append(
            {
                "commit": commit,
                "first_run": group[0]["environment"]["start_time"],
                "runs": len(group),
                "failed": sum(r["status"] != "ok" for r in group),
                "median": median,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "change": median / previous - 1 if (median is not None and previous) else None,
            }
        )
        previous = median if median is not None else previous
    return rows


def markdown(label: str, metric: str, rows: list[dict]) -> str:
    num = lambda x: "n/a" if x is None else f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"  # noqa: E731
    lines = [
        f"### {metric}: {label}",
        "",
        "| commit | first run | runs (failed) | median | min | max | change vs previous |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        change = "" if r["change"] is None else f"{r['change']:+.1%}"
        lines.append(
            f"| {r['commit']} | {r['first_run']} | {r['runs']} ({r['failed']}) | {num(r['median'])} | "
            f"{num(r['min'])} | {num(r['max'])} | {change} |"
        )
    return "\n".join(lines) + "\n"


def plot(label: str, metric: str, rows: list[dict], path: Path) -> None:
    """Median per commit with its min-max range; written to a temp file and renamed (never half a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["median"] is not None]
    x = np.arange(len(rows))
    med = np.array([r["median"] for r in rows])
    err = np.array([[m - r["min"] for m, r in zip(med, rows)], [r["max"] - m for m, r in zip(med, rows)]])
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    ax.errorbar(x, med, yerr=err, marker="o", capsize=3)
    ax.set_xticks(x, [r["commit"] for r in rows], rotation=45, ha="right")
    ax.set_xlabel("commit (ordered by first run)")
    ax.set_ylabel(metric)
    ax.set_title(label, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    write_atomic(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip(".") or "png"))
    plt.close(fig)


def cmd_history(args) -> int:
    try:
        runs = select(load_all(args.records or [Path("results")]), args)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    valid = metric_names(runs[0]["summary"])
    if args.metric not in valid:
        raise UsageError(f"unknown metric '{args.metric}'; valid: {', '.join(valid)}")
    label = run_key(next((r for r in runs if r["environment"].get("device_kind")), runs[0])).text()
    rows = history_rows(runs, args.metric)
    print(markdown(label, args.metric, rows), end="")
    if args.output:
        plot(label, args.metric, rows, args.output)
        print(f"plot: {args.output}")
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("history", help="one metric of one configuration across git commits")
    p.add_argument(
        "records", nargs="*", type=Path, help="record files, directories or baselines (default: results/)"
    )
    p.add_argument("--backend", required=True, help="backend name or label (e.g. deepspeed-zero2)")
    p.add_argument("--workload", required=True, help="workload preset")
    p.add_argument("--gpus", type=positive, required=True)
    p.add_argument("--precision", help="only this precision")
    p.add_argument("--scaling", help="only this scaling mode (weak or strong)")
    p.add_argument("--device-kind", help="only this device kind, e.g. 'NVIDIA H100 80GB HBM3'")
    p.add_argument("--metric", default=DEFAULT_METRIC, help=f"summary figure (default {DEFAULT_METRIC})")
    p.add_argument("--output", type=Path, help="also plot the history to this image file")
    p.set_defaults(func=cmd_history)
