"""`harness history`: one metric of one configuration across git commits, from the records on disk.

Each record knows the commit it ran at (environment.git.commit, with a dirty flag) and when it started;
runs of one commit are aggregated (median, min, max) and commits are ordered by their first run, so the
table reads as the project's timeline. A dirty tree is its own row: it is not the commit it sits on.

`--detect` finds change points in that timeline (harness.analyze.changepoints, Apache Otava's E-divisive)
and names the first commit after each, the size of the change and whether it is a regression or an
improvement for the metric. Exit codes, so that a nightly job can alert: 0 no change point that is a
regression (improvements only, none at all, or too few commits to detect one: a young history is not an
error); 1 a change point that is a regression (with `--recent N`: one among the newest N commits); 2 bad
input.

`--html PAGE` writes one self-contained page of every configuration in the records (or those that
--backend, --workload and --gpus name), with change points marked: harness.analyze.history_page.
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import numpy as np

from core.records import device_name, run_config, workload_name, write_atomic
from harness.analyze import changepoints
from harness.analyze.baseline import InputError, load_all
from harness.analyze.samples import run_key
from harness.arguments import add_flags, write_documents
from harness.usage import EXIT_FAILED, EXIT_OK, UsageError, fraction, int_at_least, positive

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


NEWEST_DEVICE = "newest"


def select(runs: list[dict], args) -> list[dict]:
    """The runs of exactly one configuration; several left after the filters is a usage error.
    `--device-kind newest`: the device kind the newest matching run ran on, for a series measured where the
    device may change between runs (a hosted CI runner's CPU model): its change points are within one."""
    chosen = [r for r in runs if wanted(r, args)]
    device = args.device_kind
    if device == NEWEST_DEVICE:
        named = [r for r in chosen if device_name(r)]
        device = device_name(max(named, key=start_time)) if named else None
    if device is not None:
        chosen = [r for r in chosen if device_name(r) == device]
    if not chosen:
        raise InputError(
            f"no records for backend {args.backend}, workload {args.workload}, {args.gpus} GPU(s) "
            f"with these filters among {len(runs)} record(s)"
        )
    keys = sorted({run_key(r) for r in chosen if device_name(r)})
    if len(keys) > 1:
        raise InputError(
            f"several configurations match: {'; '.join(k.text() for k in keys)}; narrow with "
            f"--backend LABEL, --precision, --scaling or --device-kind (KIND or {NEWEST_DEVICE})"
        )
    return chosen


def wanted(r: dict, args) -> bool:
    """Whether run `r` is of the backend, workload, size, precision and scaling `args` name."""
    cfg = run_config(r)
    return (
        r.get("kind", "training") == "training"
        and args.backend in (r["backend_info"].get("label"), cfg.backend)
        and args.workload == workload_name(cfg)
        and cfg.topology.world_size == args.gpus
        and (args.precision is None or cfg.model.precision == args.precision)
        and (args.scaling is None or cfg.batch.scaling == args.scaling)
    )


def start_text(run: dict) -> str:
    """When the run started, or where its record does not know (one rebuilt by `harness collect` without
    node 0's marker) when it ended: every record has one of the two."""
    return run["environment"].get("start_time") or run["environment"]["end_time"]


def start_time(run: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(start_text(run))


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
                "first_run": start_text(group[0]),
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


# Options that only `--detect` reads: given without it they would silently do nothing.
DETECT_OPTIONS = {
    "max_pvalue": "--max-pvalue",
    "min_magnitude": "--min-magnitude",
    "window": "--window",
    "recent": "--recent",
    "better": "--better",
}


def magnitude(text: str) -> float:
    """0 <= x < 1, as 0.03 or 3%: a relative change (0 keeps every significant one)."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.03 or 3%, got '{text}'") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a value from 0 up to 1 (exclusive), got {text}")
    return value


def detect(args, rows: list[dict], higher: bool) -> int:
    """The change points of the table's timeline, one line each, and the exit code a nightly job reads."""
    timeline = changepoints.series(rows)
    if len(timeline) < changepoints.MIN_COMMITS:
        print(
            f"change points: too few commits to detect one ({len(timeline)} with a value, need "
            f"{changepoints.MIN_COMMITS}); exit {EXIT_OK}"
        )
        return EXIT_OK
    points = changepoints.change_points(
        timeline,
        higher,
        max_pvalue=args.max_pvalue,
        min_magnitude=args.min_magnitude,
        window=args.window,
    )
    recent = len(timeline) if args.recent is None else args.recent
    deciding = [p for p in points if p.index >= len(timeline) - recent]
    print(
        f"\nchange points in {args.metric} over {len(timeline)} commits (Apache Otava E-divisive; max p "
        f"{args.max_pvalue:g}, min magnitude {args.min_magnitude:.1%}, window {args.window}; "
        f"{'higher' if higher else 'lower'} is better):"
    )
    for p in points:
        print(f"- {changepoints.describe(p, args.metric)}" + ("" if p in deciding else " (not recent)"))
    regressions = [p for p in deciding if p.verdict == "regression"]
    if regressions:
        last = regressions[-1]
        print(f"REGRESSION: {last.change:+.1%} {args.metric} from commit {last.commit}")
        return EXIT_FAILED
    print("no change point" if not points else "no regression among the change points")
    return EXIT_OK


NAMED_BY = ("backend", "workload", "gpus")


def cmd_history(args) -> int:
    if args.html:
        from harness.analyze.history_page import page_sections  # it imports this module

        write_documents(args, page_sections(args), label="history page")
        if not (args.detect or args.output) and None in (getattr(args, n) for n in NAMED_BY):
            return EXIT_OK
    missing = [f"--{n}" for n in NAMED_BY if getattr(args, n) is None]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} required: they name the configuration (--html PAGE alone covers them all)"
        )
    if not args.detect:
        given = [flag for name, flag in DETECT_OPTIONS.items() if getattr(args, name) is not None]
        if given:
            raise UsageError(f"{', '.join(given)} only apply with --detect")
    else:
        args.max_pvalue = changepoints.DEFAULT_MAX_PVALUE if args.max_pvalue is None else args.max_pvalue
        args.min_magnitude = (
            changepoints.DEFAULT_MIN_MAGNITUDE if args.min_magnitude is None else args.min_magnitude
        )
        args.window = changepoints.DEFAULT_WINDOW if args.window is None else args.window
    try:
        runs = select(load_all(args.records or [Path("results")]), args)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    valid = metric_names(runs[0]["summary"])
    if args.metric not in valid:
        raise UsageError(f"unknown metric '{args.metric}'; valid: {', '.join(valid)}")
    higher = changepoints.higher_is_better(args.metric) if args.better is None else args.better == "higher"
    if args.detect and higher is None:
        raise UsageError(
            f"metric '{args.metric}' has no known direction; give --better higher or --better lower"
        )
    label = run_key(next((r for r in runs if r["environment"].get("device_kind")), runs[0])).text()
    rows = history_rows(runs, args.metric)
    if args.detect and len(changepoints.series(rows)) >= changepoints.MIN_COMMITS:
        changepoints.otava_analysis()  # a missing library: one line and exit 2, before the table
    print(markdown(label, args.metric, rows), end="")
    if args.output:
        plot(label, args.metric, rows, args.output)
        print(f"plot: {args.output}")
    return detect(args, rows, bool(higher)) if args.detect else EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("history", help="one metric of one configuration across git commits")
    p.add_argument(
        "records", nargs="*", type=Path, help="record files, directories or baselines (default: results/)"
    )
    p.add_argument("--backend", help="backend name or label (e.g. deepspeed-zero2); required but with --html")
    p.add_argument("--workload", help="workload preset; required but with --html")
    p.add_argument("--gpus", type=positive, help="ranks of the configuration; required but with --html")
    p.add_argument("--precision", help="only this precision")
    p.add_argument("--scaling", help="only this scaling mode (weak or strong)")
    p.add_argument(
        "--device-kind",
        help=f"only this device kind, e.g. 'NVIDIA H100 80GB HBM3'; '{NEWEST_DEVICE}': the one the newest "
        "matching run ran on (a CI runner whose device changes)",
    )
    p.add_argument("--metric", default=DEFAULT_METRIC, help=f"summary figure (default {DEFAULT_METRIC})")
    p.add_argument("--output", type=Path, help="also plot the history to this image file")
    # --html FILE as every verb that writes a document takes it: here, the page of every configuration's
    # history (or of those named), change points marked; the records may be a data branch's checkout.
    add_flags(p, "--html")
    p.add_argument(
        "--git",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="the repository whose commit subjects the page shows (default: the current directory)",
    )
    d = p.add_argument_group("change points (--detect; exit 1 on a regression)")
    d.add_argument(
        "--detect",
        action="store_true",
        help="find change points across commits (Apache Otava's E-divisive); exit 1 if one is a regression",
    )
    d.add_argument(
        "--max-pvalue",
        type=fraction,
        help=f"keep a change point only below this p-value (default {changepoints.DEFAULT_MAX_PVALUE:g})",
    )
    d.add_argument(
        "--min-magnitude",
        type=magnitude,
        help="keep a change point only above this relative change "
        f"(default {changepoints.DEFAULT_MIN_MAGNITUDE:g}, compare's threshold)",
    )
    d.add_argument(
        "--window",
        type=int_at_least(changepoints.MIN_COMMITS, f"an integer >= {changepoints.MIN_COMMITS}"),
        help=f"commits the detector looks at at once (default {changepoints.DEFAULT_WINDOW})",
    )
    d.add_argument(
        "--recent",
        type=positive,
        metavar="N",
        help="only a change point among the newest N commits sets the exit code (default: any)",
    )
    d.add_argument(
        "--better",
        choices=["higher", "lower"],
        help="the metric's better direction, for a metric whose direction is not known",
    )
    p.set_defaults(func=cmd_history)
