"""`harness history --html PAGE`: one self-contained page of every configuration's history.

For each configuration (the runs' match key, core.records.ConfigKey: a configuration whose arguments
changed is another key, so a new series rather than a jump in the old one) it plots the throughput and the
peak memory per commit, commits in the order of their first run (history_rows: a commit that a force-push
or rebase took out of the branch keeps its place), each point the median of that commit's ok runs with
their min-max range; a commit whose runs all failed is a red mark on the axis, not a point. Apache Otava's
change points (harness.analyze.changepoints) are drawn where they fall, labelled with the commit, size and
direction, and listed newest first at the top of the page. A data branch's checkout (harness.analyze.
history_store: records/ and nights/) is read as such, and its nights are tabulated, a night that left no
record included.

The page is a harness.document: every string from a record or from git (commit subjects, run ids, labels)
reaches it as text and is escaped by the renderer, and the plots are PNG embedded in it, so it loads
nothing from the network and runs no script.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import numpy as np

from core.records import device_name, run_config, workload_name
from harness.analyze import changepoints
from harness.analyze.baseline import InputError, load_all
from harness.analyze.history import DEFAULT_METRIC, history_rows, metric_value, start_time
from harness.analyze.history_store import NIGHTS, RECORDS
from harness.analyze.samples import run_key
from harness.document import Figure, Section, Table, nbytes, num, value
from harness.usage import UsageError

MEMORY_METRICS = ("peak_allocated_bytes", "peak_rss_bytes")  # a device's peak where measured, else the host's
NOT_IN_HISTORY = "(not in the current history)"
MAX_WIDTH_IN, MAX_TICKS = 16, 60  # a year of nights stays one screen wide, its labels legible


def record_folders(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """The folders of records and of nights: a data branch's checkout holds both; another path, records."""
    records, nights = [], []
    for p in map(Path, paths):
        if (p / RECORDS).is_dir():
            records.append(p / RECORDS)
            nights += [p / NIGHTS] if (p / NIGHTS).is_dir() else []
        else:
            records.append(p)
    return records, nights


def load_nights(folders: list[Path]) -> list[dict]:
    """Each night's attempts, newest night first (night names are run ids: numbers that grow)."""
    nights = []
    for folder in folders:
        for path in folder.glob("*.json"):
            try:
                nights.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
    key = lambda n: (len(str(n.get("night"))), str(n.get("night")))  # noqa: E731
    return sorted(nights, key=key, reverse=True)


def series(runs: list[dict]) -> dict:
    """ConfigKey -> its training runs, the configuration with the newest run first. A run that failed
    before naming its device joins its configuration on the one device kind that configuration ran on
    (as compare does)."""
    runs = [r for r in runs if r.get("kind", "training") == "training"]
    kinds: dict = {}
    for r in runs:
        if device_name(r):
            kinds.setdefault(run_key(r, "*"), set()).add(device_name(r))
    out: dict = {}
    for r in runs:
        known = kinds.get(run_key(r, "*"), set())
        key = run_key(r, None if device_name(r) or len(known) != 1 else next(iter(known)))
        out.setdefault(key, []).append(r)
    newest = lambda kv: max(start_time(r) for r in kv[1])  # noqa: E731
    return dict(sorted(out.items(), key=newest, reverse=True))  # the configuration measured last first


def memory_metric(runs: list[dict]) -> str:
    for name in MEMORY_METRICS:
        if any(metric_value(r["summary"], name) is not None for r in runs if r["status"] == "ok"):
            return name
    return MEMORY_METRICS[-1]


def subjects(repo: Path | None, commits: set[str]) -> dict[str, str]:
    """commit (10 characters, as history names it) -> its subject in `repo`, or NOT_IN_HISTORY where the
    current history (HEAD's) does not hold it; {} without a repository or where it holds none of them."""
    if repo is None:
        return {}
    proc = subprocess.run(
        ["git", "-C", str(repo), "log", "--format=%H%x00%s", "HEAD"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {}
    known = {}
    for line in proc.stdout.splitlines():
        sha, _, subject = line.partition("\0")
        known[sha[:10]] = subject
    if not any(c.removesuffix("+dirty") in known for c in commits):
        return {}  # not the records' repository: no subjects, rather than every commit "not in" it
    return {c: known.get(c.removesuffix("+dirty"), NOT_IN_HISTORY) for c in commits}


def detect(rows: list[dict], metric: str) -> tuple[list, str | None]:
    """Otava's change points of one metric's rows, or none with the reason (too few commits, no Otava)."""
    timeline = changepoints.series(rows)
    if len(timeline) < changepoints.MIN_COMMITS:
        return [], f"{len(timeline)} commit(s) with a value: too few to detect a change"
    try:
        higher = changepoints.higher_is_better(metric)
        return changepoints.change_points(timeline, bool(higher)), None
    except UsageError as exc:
        return [], str(exc)


def plot(title: str, panels: list[tuple[str, list[dict], list, bool]]) -> Figure:
    """One figure, a panel per metric: median per commit with its min-max range, failed commits as red
    marks on the axis, change points as dashed lines labelled commit, size and direction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = panels[0][1]
    width = min(MAX_WIDTH_IN, max(7, 0.45 * len(rows) + 3))
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 2.8 * len(panels)))
    axes = np.atleast_1d(axes)
    x = np.arange(len(rows))
    for ax, (metric, rows, points, in_bytes) in zip(axes, panels):
        scale = 2**20 if in_bytes else 1.0
        ok = [i for i, r in enumerate(rows) if r["median"] is not None]
        med = np.array([rows[i]["median"] / scale for i in ok])
        err = [
            [m - rows[i]["min"] / scale for m, i in zip(med, ok)],
            [rows[i]["max"] / scale - m for m, i in zip(med, ok)],
        ]
        ax.errorbar(ok, med, yerr=err, marker="o", ms=4, capsize=3, lw=1)
        failed = [i for i, r in enumerate(rows) if r["median"] is None]
        if failed:
            ax.plot(failed, [0] * len(failed), "x", color="tab:red", ms=8, transform=ax.get_xaxis_transform(),
                    clip_on=False, label="no ok run (failed)")  # fmt: skip
            ax.legend(fontsize=7, loc="lower left")
        index = {r["commit"]: i for i, r in enumerate(rows)}
        for p in points:
            colour = "tab:red" if p.verdict == "regression" else "tab:green"
            ax.axvline(index[p.commit] - 0.5, color=colour, ls="--", lw=1)
            ax.annotate(f"{p.commit} {p.change:+.1%}\n{p.verdict}", (index[p.commit] - 0.5, 0.97),
                        xycoords=("data", "axes fraction"), fontsize=7, color=colour, ha="left", va="top",
                        bbox={"boxstyle": "round", "fc": "white", "ec": colour, "alpha": 0.85})  # fmt: skip
        ax.set_ylabel(metric + (" (MiB)" if in_bytes else ""), fontsize=8)
        ax.grid(alpha=0.3)
        every = -(-len(rows) // MAX_TICKS)  # a long history labels every k-th commit
        ax.set_xticks(x[::every], [r["commit"] for r in rows][::every], rotation=45, ha="right", fontsize=7)
    axes[0].set_title(title, fontsize=9)
    axes[-1].set_xlabel("commit (in the order of its first run)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    plt.close(fig)
    return Figure(title, buf.getvalue())


def spread(row: dict, in_bytes: bool) -> str:
    if row["median"] is None:
        return "n/a"
    show = nbytes if in_bytes else num
    width = (row["max"] - row["min"]) / row["median"] if row["median"] else None
    half = num(None if width is None or value(width) is None else width / 2 * 100, "{:.1f}")
    return f"{show(row['median'])} [{show(row['min'])}–{show(row['max'])}] ±{half}%"


def runs_by_commit(runs: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in sorted(runs, key=start_time):
        git = r["environment"].get("git") or {}
        commit = (git.get("commit") or "unknown")[:10] + ("+dirty" if git.get("dirty") else "")
        out.setdefault(commit, []).append(str(r["run_id"]))
    return out


def configuration_section(key, runs: list[dict], names: dict, with_figures: bool) -> tuple[Section, list]:
    memory = memory_metric(runs)
    throughput = history_rows(runs, DEFAULT_METRIC)
    peak = history_rows(runs, memory)
    found = []
    panels = []
    notes = []
    for metric, rows, in_bytes in ((DEFAULT_METRIC, throughput, False), (memory, peak, True)):
        points, why = detect(rows, metric)
        found += [(key, metric, p, rows) for p in points]
        panels.append((metric, rows, points, in_bytes))
        if why:
            notes.append(f"{metric}: no change points ({why}).")
    cfg = run_config(runs[0])
    sec = Section(key.text(), 2)
    sec.blocks.append(
        f"{cfg.backend} · {workload_name(cfg)} · {cfg.topology.world_size} rank(s) · {len(runs)} run(s) over "
        f"{len(throughput)} commit(s); each point is the median of a commit's ok runs, its bar their range."
    )
    sec.blocks += notes
    if with_figures:
        sec.blocks.append(plot(key.text(), panels))
    ids = runs_by_commit(runs)
    sec.blocks.append(
        Table(
            [
                "commit",
                "subject",
                "first run",
                "runs (failed)",
                "throughput tok/s median [min–max] ±half-range",
                f"{memory} median [min–max] ±half-range",
                "run ids",
            ],
            [
                [
                    r["commit"],
                    names.get(r["commit"], ""),
                    r["first_run"],
                    f"{r['runs']} ({r['failed']})",
                    spread(r, False),
                    spread(m, True),
                    ", ".join(ids.get(r["commit"], [])),
                ]
                for r, m in zip(reversed(throughput), reversed(peak))
            ],
        )
    )
    return sec, found


def change_table(found: list, names: dict) -> Table:
    """Every change point, the newest first (by its commit's first run)."""
    rows = []
    for key, metric, p, metric_rows in found:
        first = next(r["first_run"] for r in metric_rows if r["commit"] == p.commit)
        rows.append((first, key, metric, p))
    rows.sort(key=lambda t: t[0], reverse=True)
    in_bytes = lambda m: m in MEMORY_METRICS  # noqa: E731
    show = lambda m, x: nbytes(x) if in_bytes(m) else num(x)  # noqa: E731
    return Table(
        ["first run", "configuration", "metric", "commit", "subject", "after", "change", "before -> after",
         "p", "direction"],
        [
            [first, key.text(), metric, p.commit, names.get(p.commit, ""), p.previous, f"{p.change:+.1%}",
             f"{show(metric, p.before)} -> {show(metric, p.after)}", f"{p.pvalue:.2g}", p.verdict]
            for first, key, metric, p in rows
        ],
    )  # fmt: skip


def nights_table(nights: list[dict]) -> Table:
    rows = []
    for n in nights:
        for a in n.get("attempts", []):
            rows.append(
                [str(n.get("night")), str(a.get("attempt")), str(a.get("recorded_at", "")),
                 str(a.get("commit") or "")[:10], str(a.get("outcome")), str(len(a.get("records", [])))]
            )  # fmt: skip
    return Table(["night (run id)", "attempt", "recorded", "commit", "outcome", "records"], rows)


def page_sections(args, with_figures: bool = True) -> list[Section]:
    record_dirs, night_dirs = record_folders(args.records or [Path("results")])
    try:
        runs = load_all(record_dirs)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    wanted = lambda r: (  # noqa: E731
        (args.backend is None or args.backend in (r["backend_info"].get("label"), run_config(r).backend))
        and (args.workload is None or args.workload == workload_name(run_config(r)))
        and (args.gpus is None or run_config(r).topology.world_size == args.gpus)
    )
    groups = series([r for r in runs if wanted(r)])
    nights = load_nights(night_dirs)
    if not groups and not nights:
        raise UsageError(f"no training records in {', '.join(map(str, record_dirs))}")
    commits = {row["commit"] for rs in groups.values() for row in history_rows(rs, DEFAULT_METRIC)}
    names = subjects(args.git, commits)
    sections, found = [], []
    for key, rs in groups.items():
        sec, points = configuration_section(key, rs, names, with_figures)
        sections.append(sec)
        found += points
    intro = Section("distbench history", 1)
    intro.blocks.append(
        f"{len(runs)} record(s), {len(groups)} configuration(s), {len(nights)} night(s) from "
        f"{', '.join(map(str, args.records or ['results']))}. Commits are in the order of their first run; "
        f"a commit {NOT_IN_HISTORY} was measured on a branch since rewritten."
    )
    head = [intro, Section("Change points, newest first", 2, [change_table(found, names)])]
    try:
        changepoints.otava_analysis()
        tested = f"(Apache Otava E-divisive, max p {changepoints.DEFAULT_MAX_PVALUE:g}, min magnitude "
        tested += f"{changepoints.DEFAULT_MIN_MAGNITUDE:.0%}, over every commit of each series)"
    except UsageError as exc:
        tested = f"not computed: {exc}"
    head[1].blocks.insert(
        0, ("" if found else "No change point in any configuration. ") + f"Change points {tested}."
    )
    if nights:
        head.append(Section("Nights, newest first", 2, [nights_table(nights)]))
    return head + sections
