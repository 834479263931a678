"""The report's sections on training runs: per context (workload, precision, device, scaling) the scaling
table, the numerics each backend ran and (html) five plots, every figure of an oversubscribed CPU run marked
so (a table row, a hollow point or hatched bar, a sentence); failed runs and incidents; the environment; the
framework selection, one ranking per context with a sentence of advice per backend; each adapter's features.

Every number comes from harness.analyze.analysis (which builds on harness.analyze.metrics.summarize); this
module only formats. The selection advice is assembled from the measured figures, never canned per backend.
"""

from __future__ import annotations

import datetime as dt
import io
from typing import TYPE_CHECKING

import pandas as pd

from backends import REFERENCE_BACKEND, all_backends
from core.precision import DEFINITION_TEXT
from core.records import run_config
from harness.analyze.analysis import aggregate, contexts, runs_table
from harness.analyze.metrics import run_numerics
from harness.document import Figure, Section, Table, nbytes, num, pct, value

if TYPE_CHECKING:  # matplotlib is imported where a plot is drawn, never for a Markdown report
    from matplotlib.figure import Figure as Plot


def context_title(ctx: dict) -> str:
    return (
        f"{ctx['workload']} · {ctx['precision']} · {ctx['device']} · "
        f"{ctx['scaling']} scaling ({ctx['batch']}) · {ctx['settings']}"
    )


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


# The mark of a table row, a plot's point and a selection sentence whose runs had more CPU workers x threads
# than the CPUs they may use (harness.analyze.metrics.cpu_oversubscription): their figures measure contention.
OVERSUBSCRIBED = "OVERSUBSCRIBED"
HOLLOW = "hollow / hatched: CPU oversubscribed"  # the plots' legend entry for the same mark


def n_cell(r) -> str:
    return f"{r.world_size} {OVERSUBSCRIBED}" if r.oversubscribed else str(r.world_size)


def oversubscribed_ns(agg: pd.DataFrame) -> list[int]:
    return sorted({int(n) for n in agg.loc[agg["oversubscribed"], "world_size"]})


def oversubscription_legend(agg: pd.DataFrame) -> str | None:
    """The legend line of a context whose table and plots carry the mark; None where no row does."""
    over = agg[agg["oversubscribed"]]
    if over.empty:
        return None
    threads = sorted({int(t) for t in over["threads_per_worker"]})
    cpus = sorted({int(c) for c in over["cpus"].dropna()})
    return (
        f"{OVERSUBSCRIBED} (rows marked so; {HOLLOW} in the plots): at N = "
        f"{', '.join(map(str, oversubscribed_ns(agg)))} a node's CPU workers, {'/'.join(map(str, threads))} "
        f"thread(s) each, ask for more threads than the {'/'.join(map(str, cpus))} CPU(s) they may use, so "
        "their step times measure contention for the cores: throughput, speedup, efficiency, exposed comm "
        "and first step there say how a stack bears oversubscription, not how it scales."
    )


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
                pct(r.exposed_comm_ratio, 1),
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


def advice(r, at: pd.DataFrame, ref_label: str | None, noise_cv: float) -> str:
    """One plain sentence on when to pick this backend, from its numbers at this N against the others'."""
    best = at.loc[at["throughput"].idxmax()]
    rel = r.throughput / best["throughput"]
    facts = [
        f"fastest at N={r.world_size} ({rel:.2f}x of best)"
        if r.label == best["label"]
        else f"{rel:.2f}x the throughput of {best['label']} at N={r.world_size}"
    ]
    states = at.dropna(subset=["model_state_bytes"])
    ref = states[states["label"] == ref_label]
    if value(r.model_state_bytes) is not None and len(ref) and r.label != ref_label:
        facts.append(
            f"{r.model_state_bytes / ref['model_state_bytes'].iloc[0]:.0%} of "
            f"{ref_label}'s per-rank model state"
        )
    if r.world_size > 1 and value(r.exposed_comm_ratio) is not None:
        facts.append(f"{r.exposed_comm_ratio:.0%} of the step is exposed communication")
    if r.world_size > 1 and value(r.efficiency) is not None:
        facts.append(f"scaling efficiency {r.efficiency:.0%}")

    fast = rel >= 1 - noise_cv  # within the noise threshold of the best: not distinguishable from it
    lean = (
        len(states) > 1
        and value(r.model_state_bytes) is not None
        and r.model_state_bytes <= 1.1 * states["model_state_bytes"].min()
        and states["model_state_bytes"].max() > 1.1 * states["model_state_bytes"].min()
    )
    comm = at.dropna(subset=["exposed_comm_ratio"])
    least_comm = (
        len(comm) > 1
        and value(r.exposed_comm_ratio) is not None
        and r.exposed_comm_ratio <= comm["exposed_comm_ratio"].min() + 0.02
    )
    if fast and lean:
        verdict = "pick it: fastest and leanest here"
    elif fast:
        verdict = "pick it when throughput matters and the model fits in memory"
    elif lean:
        faster = states[
            (states["throughput"] > r.throughput)
            & (states["model_state_bytes"] <= 1.1 * states["model_state_bytes"].min())
        ]
        verdict = "pick it when memory is the constraint" + (
            f", though {faster['label'].iloc[0]} is as lean and "
            f"{faster['throughput'].iloc[0] / r.throughput:.2f}x faster"
            if len(faster)
            else ""
        )
    elif least_comm:
        verdict = "consider it when communication dominates (least exposed communication here)"
    else:
        leanest = states.loc[states["model_state_bytes"].idxmin(), "label"] if len(states) else None
        verdict = f"no measured advantage at N={r.world_size}: {best['label']} is faster" + (
            f" and {leanest} holds less model state" if leanest and leanest != r.label else ""
        )
    noisy = f" (noisy: CV {r.throughput_cv:.0%} over repeats, re-measure before deciding)" if r.noisy else ""
    crowded = sorted(at.loc[at["oversubscribed"], "label"])
    if r.oversubscribed:
        over = (
            f" ({OVERSUBSCRIBED} at N={r.world_size}: these figures measure contention for the CPUs, not "
            "how it scales; decide by a ranking at an N that fits them)"
        )
    elif crowded:
        over = f" (beside {OVERSUBSCRIBED} runs of {', '.join(crowded)}: their figures measure contention)"
    else:
        over = ""
    return f"{r.label}: {', '.join(facts)}: {verdict}{noisy}{over}."


def memory_reference(at: pd.DataFrame) -> str | None:
    """The yardstick for model state: plain replicated data parallelism (the suite's REFERENCE_BACKEND) if
    measured, else the heaviest."""
    plain = at[at["backend"] == REFERENCE_BACKEND]  # in the variant ranked: torch-ddp+tuned among tuned
    if len(plain):
        return str(plain.sort_values("label")["label"].iloc[0])
    states = at.dropna(subset=["model_state_bytes"])
    return states.loc[states["model_state_bytes"].idxmax(), "label"] if len(states) else None


def selection(ctx: dict, agg: pd.DataFrame, at_gpus: int | None, noise_cv: float) -> Section:
    measured = sorted(agg.loc[agg["runs"] > 0, "world_size"].unique())
    crowded = oversubscribed_ns(agg[agg["runs"] > 0])
    # By default the largest N whose runs fit the CPUs: a ranking of oversubscribed runs measures contention.
    fits = [x for x in measured if x not in crowded]
    n = at_gpus or (fits[-1] if fits else measured[-1] if measured else None)
    at = agg[(agg["world_size"] == n) & (agg["runs"] > 0)].sort_values("throughput", ascending=False)
    # Best against best: where tuned runs were measured, the ranking holds each stack's tuned variant
    # against the others' (a stack with no tuned run joins with its default, named so by its label).
    tuned = at[at["variant"] == "tuned"]
    variant = ""
    if len(tuned):
        with_tuned = set(tuned["backend"])
        at = at[(at["variant"] == "tuned") | ~at["backend"].isin(with_tuned)]
        variant = " (tuned against tuned)"
    mark = f" ({OVERSUBSCRIBED})" if at["oversubscribed"].any() else ""
    sec = Section(f"Framework selection at N={n}{mark}{variant}: {context_title(ctx)}", 3)
    if crowded and not mark:
        sec.blocks.append(
            f"Ranked at N={n}"
            + (", the largest N whose runs fit the CPUs" if not at_gpus else "")
            + f": at N = {', '.join(map(str, crowded))} the workers oversubscribed them ({OVERSUBSCRIBED} "
            "in the scaling table), where a ranking would measure contention"
            + ("; `--at-gpus N` ranks at another N." if not at_gpus else ".")
        )
    elif mark:
        sec.blocks.append(
            f"Ranked at N={n}, where runs {OVERSUBSCRIBED} the CPUs (marked in the ranking and in every "
            "sentence): their figures measure contention for the cores, not how the stacks scale."
            + (f" N = {', '.join(map(str, fits))} fit the CPUs: `--at-gpus` ranks there." if fits else "")
        )
    if at.empty:
        sec.blocks.append(
            f"No successful run at N={n}; measured N: {', '.join(map(str, measured)) or 'none'}."
        )
        return sec
    if variant:
        untuned = sorted(set(at.loc[at["variant"] != "tuned", "label"]))
        sec.blocks.append(
            "Ranked tuned against tuned: each stack with its tuned set (`--tuned`: the settings its own "
            "documentation and reference trainers use), its default runs in the tables above"
            + (f"; measured only by default: {', '.join(untuned)}" if untuned else "")
            + "."
        )
    ref_label = memory_reference(at)
    best, low_mem = at["throughput"].max(), at["peak_memory_bytes"].min()
    rows = []
    for rank, r in enumerate(at.itertuples(), 1):
        ref_state = at.loc[at["label"] == ref_label, "model_state_bytes"]
        rows.append(
            [
                str(rank),
                f"{r.label} {OVERSUBSCRIBED}" if r.oversubscribed else r.label,
                f"{num(r.throughput)} ({r.throughput / best:.2f}x)",
                pct(r.efficiency),
                f"{nbytes(r.peak_memory_bytes)} ({num(r.peak_memory_bytes / low_mem, '{:.2f}')}x lowest)",
                f"{nbytes(r.model_state_bytes)} "
                f"({num(r.model_state_bytes / ref_state.iloc[0], '{:.2f}')}x {ref_label})"
                if len(ref_state)
                else nbytes(r.model_state_bytes),
                pct(r.exposed_comm_ratio, 1),
            ]
        )
    sec.blocks.append(
        Table(
            [
                "rank",
                "backend",
                "throughput tok/s (x best)",
                "scaling efficiency",
                "peak memory/rank",
                "model state/rank",
                "exposed comm",
            ],
            rows,
        )
    )
    sec.blocks.extend(advice(r, at, ref_label, noise_cv) for r in at.itertuples())
    return sec


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
    sections += [selection(ctx, g, at_gpus, noise_cv) for ctx, g in contexts(agg)]
    sections.append(feature_section(runs))
    return sections
