"""The report's sections on training runs: per context (workload, precision, device, scaling) the scaling
table, the numerics each backend ran and (html) five plots, every figure of an oversubscribed CPU run marked
so (a table row, a hollow point or hatched bar, a sentence); failed runs and incidents; the environment; the
framework selection with the anatomy of every step under it (selection.py); each adapter's features.

Every number comes from harness.analyze.analysis (which builds on harness.analyze.metrics.summarize); this
module only formats. The selection advice is assembled from the measured figures, never canned per backend.
"""

from __future__ import annotations

import datetime as dt
import io
from typing import TYPE_CHECKING

import pandas as pd

from backends import all_backends
from core.precision import DEFINITION_TEXT
from core.records import run_config
from harness.analyze.analysis import aggregate, contexts, runs_table
from harness.analyze.metrics import run_numerics
from harness.analyze.report.contexts import (
    HOLLOW,
    OVERSUBSCRIBED,
    context_title,
    n_cell,
    oversubscription_legend,
)
from harness.analyze.report.selection import anatomy_section, exposed_cell, selection
from harness.document import Figure, Section, Table, nbytes, num, pct, value

if TYPE_CHECKING:  # matplotlib is imported where a plot is drawn, never for a Markdown report
    from matplotlib.figure import Figure as Plot


SCALING_HEADERS = [
    "backend",
    "N",
    "runs",
    "throughput tok/s median [min–max]",
    "CV over repeats",
    "speedup",
    "scaling efficiency",
    "peak memory/rank",
    "memory ratio vs N=1",
    "model state/rank",
    "exposed comm",
    "volume / exposed time",
    "MFU",
    "first step (compile)",
]


def scaling_table(agg: pd.DataFrame) -> Table:
    rows = []
    for r in agg.itertuples():
        if not r.runs:
            rows.append(
                [
                    r.label,
                    n_cell(r),
                    f"0 ok, {r.failed} failed",
                    *["n/a"] * (len(SCALING_HEADERS) - 3),
                ]
            )
            continue
        cv = (
            "n/a (1 run)"
            if value(r.throughput_cv) is None
            else pct(r.throughput_cv, 1) + (" NOISY" if r.noisy else "")
        )
        mark = " (noisy)" if r.speedup_noisy else ""
        rows.append(
            [
                r.label,
                n_cell(r),
                f"{r.runs} ok" + (f", {r.failed} failed" if r.failed else ""),
                f"{num(r.throughput)} [{num(r.throughput_min)}–{num(r.throughput_max)}]",
                cv,
                num(r.speedup, "{:.2f}x") + (mark if value(r.speedup) is not None else ""),
                pct(r.efficiency) + (mark if value(r.efficiency) is not None else ""),
                f"{nbytes(r.peak_memory_bytes)} ({r.peak_memory_source or 'n/a'})",
                num(r.memory_ratio, "{:.2f}"),
                f"{nbytes(r.model_state_bytes)} ({num(r.model_state_vs_analytic, '{:.3f}')}x analytic)",
                exposed_cell(r),
                nbytes(r.volume_per_exposed_s) + "/s" if value(r.volume_per_exposed_s) is not None else "n/a",
                pct(r.mfu, 1),
                num(r.first_step_s, "{:.2f} s"),
            ]
        )
    return Table(SCALING_HEADERS, rows)


NUMERICS_HEADERS = [
    "backend",
    "matmuls",
    "parameters in forward",
    "residual stream",
    "gradient reduction",
    "master weights",
    "optimizer state",
    "TF32",
    "how",
    "deviations from the definition",
]


def numerics_table(ctx: dict, labels: list[str], runs: pd.DataFrame, by_id: dict[str, dict]) -> Table:
    """What each backend of a context ran in which dtype, as its workers recorded and checked it
    (core.precision), one row per label: from its first ok run; 'not recorded' for older records."""
    in_context = runs[(runs["status"] == "ok")]
    for key, want in ctx.items():
        in_context = in_context[in_context[key].astype(str) == str(want)]
    rows = []
    for label in labels:
        ids = in_context.loc[in_context["label"] == label, "run_id"]
        n = next((x for x in (run_numerics(by_id[i].get("ranks", [])) for i in ids) if x), None)
        if n is None:
            rows.append([label, *["not recorded"] + [""] * (len(NUMERICS_HEADERS) - 2)])
            continue
        rows.append(
            [
                label,
                n["compute"],
                n["forward_params"],
                n["activations"],
                n["grad_reduce"],
                n["master_weights"],
                n["optimizer_state"],
                "on" if n["tf32"] else "off",
                n["mechanism"],
                "; ".join(n["deviations"]) or "none",
            ]
        )
    return Table(NUMERICS_HEADERS, rows)


def plots(agg: pd.DataFrame) -> list[tuple[str, Plot]]:
    """The five plots of one context as matplotlib figures, one line (or bar group) per backend label: N on
    a log2 axis ticked at each measured N; an oversubscribed point drawn hollow (gid 'oversubscribed
    <label>'), an oversubscribed bar hatched, and the legend naming that mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import NullLocator

    ns = sorted(int(n) for n in agg["world_size"].unique())
    labels = sorted(agg["label"].unique())
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    marked = bool(agg["oversubscribed"].any())
    out: list[tuple[str, Plot]] = []

    def legend(ax, handles):
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))

    def n_axis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(ns[0] / 1.3, ns[-1] * 1.3)

    def line_plot(title, column, ylabel, ideal=None, scale=1.0, from_zero=True):
        fig, ax = plt.subplots(figsize=(6.5, 3.4))
        handles = []
        if ideal is not None:
            handles += ax.plot(ns, ideal, "k--", lw=1, label="ideal")
        for label in labels:
            g = agg[agg["label"] == label].sort_values("world_size")
            x, y, over = g["world_size"], g[column] * scale, g["oversubscribed"].astype(bool)
            c = colors[label]
            ax.plot(x, y, "-", color=c)
            if (~over).any():
                ax.plot(x[~over], y[~over], "o", color=c, ls="none", gid=f"fits {label}")
            if over.any():
                ax.plot(x[over], y[over], "o", color=c, mfc="white", ls="none", gid=f"oversubscribed {label}")
            handles.append(Line2D([], [], color=c, marker="o", label=label))
        if marked:
            handles.append(Line2D([], [], color="0.4", marker="o", mfc="white", ls="none", label=HOLLOW))
        ax.set(title=title, xlabel="N (ranks, log2)", ylabel=ylabel)
        n_axis(ax)
        if from_zero:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        legend(ax, handles)
        out.append((title, fig))

    line_plot("Speedup vs N", "speedup", "throughput(N) / throughput(1)", ideal=ns)
    line_plot("Scaling efficiency", "efficiency", "speedup / N", ideal=[1.0] * len(ns))
    line_plot("Per-rank peak memory", "peak_memory_bytes", "MiB", scale=1 / 2**20, from_zero=False)
    line_plot("Exposed-communication ratio", "exposed_comm_ratio", "(t_step − t_compute) / t_step")

    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    width = 0.8 / len(labels)
    handles = []
    for i, label in enumerate(labels):
        g = agg[agg["label"] == label].set_index("world_size").reindex(ns)
        err = [
            (g["throughput"] - g["throughput_min"]).fillna(0),
            (g["throughput_max"] - g["throughput"]).fillna(0),
        ]
        bars = ax.bar(
            [k + i * width for k in range(len(ns))],
            g["throughput"],
            width,
            yerr=err,
            capsize=3,
            color=colors[label],
            label=label,
        )
        for bar, over in zip(bars, g["oversubscribed"].eq(True)):
            if over:
                bar.set(hatch="///", edgecolor="white", gid=f"oversubscribed {label}")
        handles.append(Patch(color=colors[label], label=label))
    if marked:
        handles.append(Patch(facecolor="0.6", edgecolor="white", hatch="///", label=HOLLOW))
    ax.set(title="Throughput by backend", xlabel="N (ranks)", ylabel="tokens/s (median, min–max bars)")
    ax.set_xticks([k + width * (len(labels) - 1) / 2 for k in range(len(ns))], [str(n) for n in ns])
    ax.grid(alpha=0.3, axis="y")
    legend(ax, handles)
    out.append(("Throughput by backend", fig))
    return out


def figures(agg: pd.DataFrame) -> list[Figure]:
    """The five plots of one context (`plots`), each as an embedded PNG."""
    import matplotlib.pyplot as plt

    out = []
    for title, fig in plots(agg):
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        out.append(Figure(title, buf.getvalue()))
    return out


def feature_section(runs: pd.DataFrame) -> Section:
    """What each registered adapter supports (from the adapter classes), and the variants measured."""
    rows = []
    for b in all_backends():
        f = b.features()
        ok, reason = b.availability()
        variants = sorted(runs.loc[runs["backend"] == b.name, "label"].unique()) if len(runs) else []
        rows.append(
            [
                b.name,
                f["framework"],
                f["launcher"],
                ", ".join(f["sharding"]),
                f["mixed_precision"],
                "yes" if f["multi_node"] else "no",
                ", ".join(f["compute_methods"]),
                "yes" if ok else f"no: {reason}",
                ", ".join(variants) or "none",
            ]
        )
    return Section(
        "Features of each adapter",
        2,
        [
            Table(
                [
                    "backend",
                    "framework",
                    "launcher",
                    "sharding",
                    "mixed precision",
                    "multi-node",
                    "t_compute methods",
                    "available here",
                    "measured variants",
                ],
                rows,
            )
        ],
    )


def environment_section(records: list[dict]) -> Section:
    def distinct(get) -> str:
        values = sorted({str(v) for v in map(get, records) if v not in (None, "", [], {})})
        return "; ".join(values) or "n/a"

    env = [r.get("environment", {}) for r in records]
    versions = sorted({f"{k} {v}" for e in env for k, v in (e.get("versions") or {}).items()})
    starts = sorted(e["start_time"] for e in env if e.get("start_time"))
    rows = [
        ["device", distinct(lambda r: r["environment"].get("device_kind"))],
        ["hosts", distinct(lambda r: ", ".join(r["environment"].get("hostnames") or []))],
        ["CPU cores (harness host)", distinct(lambda r: r["environment"].get("cpu_count"))],
        ["threads per worker", distinct(lambda r: run_config(r).topology.threads_per_worker)],
        ["platform", distinct(lambda r: r["environment"].get("platform"))],
        ["framework versions", ", ".join(versions) or "n/a"],
        [
            "git commit",
            distinct(
                lambda r: (
                    lambda g: g.get("commit") and g["commit"][:10] + (" (dirty)" if g.get("dirty") else "")
                )(r["environment"].get("git") or {})
            ),
        ],
        ["measured", f"{starts[0]} to {starts[-1]}" if starts else "n/a"],
    ]
    return Section("Environment", 2, [Table(["", ""], rows)])


def build(records: list[dict], at_gpus: int | None, noise_cv: float, with_figures: bool) -> list[Section]:
    runs = runs_table(records)
    agg = aggregate(runs, noise_cv)
    ok = int((runs["status"] == "ok").sum())
    intro = Section(
        "distbench report",
        1,
        [
            f"{len(runs)} run record(s): {ok} ok, {len(runs) - ok} failed. Generated "
            f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC.",
            "Throughput is the median over repeats (separate launches) of each run's median step; "
            "speedup = throughput(N) / throughput(1) of the same backend; efficiency = speedup / N; "
            "memory ratio = per-rank peak at N / at 1; exposed comm = (t_step − t_compute) / t_step. "
            f"Rows whose repeats vary by more than CV {noise_cv:.0%} are marked NOISY, "
            "and so is every speedup computed from them.",
        ],
    )
    if (runs["device_type"] == "cpu").any():
        intro.blocks.append(
            "CPU runs: N counts worker processes sharing one machine's cores, so speedup shows how "
            "a stack shares a CPU, not how it scales on GPUs; per-rank peak memory is process RSS "
            "(framework runtime included); MFU is n/a (no device peak for a CPU)."
            + (
                f" Where a node's workers x threads exceed its CPUs, the row, its plotted points and every "
                f"sentence drawn from it are marked {OVERSUBSCRIBED}."
                if agg["oversubscribed"].any()
                else ""
            )
        )
    sections = [intro, environment_section(records)]
    by_id = {r["run_id"]: r for r in records}
    for ctx, g in contexts(agg):
        legend = oversubscription_legend(g)
        sec = Section(f"Scaling: {context_title(ctx)}", 2, [*([legend] if legend else []), scaling_table(g)])
        sec.blocks += [
            f"Numerics each backend ran, as its workers recorded and checked them. The definition: "
            f"{DEFINITION_TEXT}.",
            numerics_table(ctx, list(dict.fromkeys(g["label"])), runs, by_id),
        ]
        if with_figures:
            sec.blocks.extend(figures(g))
        sections.append(sec)
    failed = runs[runs["status"] != "ok"]
    if len(failed):
        sections.append(
            Section(
                "Failed runs",
                2,
                [
                    Table(
                        ["run", "backend", "N", "status", "error"],
                        [
                            [r.run_id, r.label, str(r.world_size), r.status, str(r.error)]
                            for r in failed.itertuples()
                        ],
                    )
                ],
            )
        )
    incidents = runs[runs["incident"].notna()] if "incident" in runs else runs.iloc[0:0]
    if len(incidents):  # ok runs whose figures stand, but part of whose record (a trace) was lost
        sections.append(
            Section(
                "Incidents after the measured steps (the runs are ok)",
                2,
                [
                    Table(
                        ["run", "backend", "N", "incident"],
                        [
                            [r.run_id, r.label, str(r.world_size), str(r.incident)]
                            for r in incidents.itertuples()
                        ],
                    )
                ],
            )
        )
    measured = set(runs.loc[runs["status"] == "ok", "backend"])
    missing = [
        f"{b.name} ({'available, but no ok run in these records' if ok_ else 'unavailable here: ' + why})"
        for b in all_backends()
        for ok_, why in [b.availability()]
        if b.name not in measured
    ]
    if missing:
        sections.append(
            Section(
                "Not measured",
                2,
                ["Registered backends without a successful run: " + "; ".join(missing) + "."],
            )
        )
    sections.append(
        Section(
            "Framework selection",
            2,
            [
                "Backends at one N, ranked by throughput, with their memory and communication; "
                "each sentence is derived from the numbers in its row."
            ],
        )
    )
    for ctx, g in contexts(agg):
        sections += [selection(ctx, g, at_gpus, noise_cv), anatomy_section(g, with_figures)]
    sections.append(feature_section(runs))
    return sections
