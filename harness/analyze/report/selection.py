"""The report's framework selection: one ranking per context with a sentence of advice per backend, assembled
from the measured figures, never canned per backend. A sentence drawn from an oversubscribed CPU run says so;
where the step's anatomy explains why a stack ranks below the fastest, one more sentence says which part.
Under each ranking, the step's anatomy (harness.analyze.anatomy) of every stack at every N of its context:
a table (forward, backward, optimizer, exposed communication and other, in ms and share of the step) and
(html) stacked horizontal bars.

An unresolved part (a difference negative beyond its noise) is shown as unresolved with its signed value,
never drawn as a bar, and never the ground of a sentence, a ranking or a comparison: no exposed share, no
"least exposed communication"; a part not measured is n/a with its reason. Every number comes from
harness.analyze.analysis (medians over repeats); this module only chooses and formats.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import pandas as pd

from backends import REFERENCE_BACKEND
from harness.analyze.analysis import resolved_part
from harness.analyze.anatomy import LABELS, PARTS
from harness.analyze.report.contexts import HOLLOW, OVERSUBSCRIBED, context_title, n_cell, oversubscribed_ns
from harness.document import Figure, Section, Table, nbytes, num, pct, value

if TYPE_CHECKING:  # matplotlib is imported where a plot is drawn, never for a Markdown report
    from matplotlib.figure import Figure as Plot


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
    if r.world_size > 1 and exposed_known(r):
        facts.append(f"{r.exposed_comm_ratio:.0%} of the step is exposed communication")
    if r.world_size > 1 and value(r.efficiency) is not None:
        facts.append(f"scaling efficiency {r.efficiency:.0%}")
    if r.world_size == 1 and r.sharding not in (None, "none") and not pd.isna(r.sharding):
        facts.append(
            f"at one rank there is nothing to shard: its {r.sharding} sharding runs and saves nothing"
        )

    fast = rel >= 1 - noise_cv  # within the noise threshold of the best: not distinguishable from it
    lean = (
        len(states) > 1
        and value(r.model_state_bytes) is not None
        and r.model_state_bytes <= 1.1 * states["model_state_bytes"].min()
        and states["model_state_bytes"].max() > 1.1 * states["model_state_bytes"].min()
    )
    # Least exposed communication only where no stack's exposed part is unresolved: that one could be
    # anything, so no stack is the least beside it.
    comm = at.dropna(subset=["exposed_comm_ratio"])
    least_comm = (
        len(comm) > 1
        and not (at["anatomy_exposed_comm_status"] == "unresolved").any()
        and exposed_known(r)
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
    return f"{r.label}: {', '.join(facts)}: {verdict}{noisy}{over}.{anatomy_sentence(r, at)}"


def best_settings(at: pd.DataFrame, n) -> tuple[pd.DataFrame, str]:
    """Best against best: a stack measured at several settings at this N (DeepSpeed's ZeRO stages, Paddle's
    sharding stages, FSDP2 with and without resharding) is ranked at its fastest one, and the note under
    the heading says which, with the others and their throughput against it; a stack measured at one
    setting is ranked as it is. The rows, and the note ("" where no stack had a choice)."""
    fastest = at.sort_values("throughput", ascending=False, na_position="last")
    best = fastest.drop_duplicates(subset="backend", keep="first")
    notes = []
    for r in best.itertuples():
        others = fastest[(fastest["backend"] == r.backend) & (fastest["label"] != r.label)]
        if len(others):
            also = ", ".join(
                f"{o.label} {num(o.throughput / r.throughput, '{:.2f}')}x" for o in others.itertuples()
            )
            notes.append(f"{r.backend} as {r.label} (also measured: {also})")
    note = (
        f"Best against best: each stack at its fastest measured setting at N={n}: " + "; ".join(notes) + "."
        if notes
        else ""
    )
    return best.sort_values("throughput", ascending=False), note


def exposed_known(r) -> bool:
    """Whether a group row's exposed-communication ratio may be spoken of: a figure, its part resolved."""
    resolved = r.anatomy_exposed_comm_status in ("measured", "derived")
    return resolved and value(r.exposed_comm_ratio) is not None


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
    at, settings_note = best_settings(at, n)
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
    if settings_note:
        sec.blocks.append(settings_note)
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
                exposed_cell(r),
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


# ------------------------------------------------------------------------------------- the step's anatomy
ANATOMY_HEADERS = ["stack", "N", "step", *(LABELS[p] for p in PARTS)]
PLOT_TITLE = "Step anatomy by stack and N"
# The share of the step-time gap to the fastest a single part must account for before a sentence says
# that part is why the stack ranks lower.
EXPLAINS = 0.5
PART_COLORS = {"forward": "C0", "backward": "C1", "optimizer": "C2", "exposed_comm": "C3", "other": "C7"}


def ms(seconds: float) -> str:
    """Milliseconds with a true minus sign, so an unresolved part reads 'unresolved −3.0 ms'."""
    text = f"{abs(seconds) * 1e3:.1f} ms"
    return f"−{text}" if seconds < 0 and round(abs(seconds) * 1e3, 1) > 0 else text


def part_cell(r, name: str) -> str:
    """One part of a group row: its ms and share, 'unresolved −x ms', or 'n/a (why)'."""
    status = getattr(r, f"anatomy_{name}_status")
    seconds, share = value(getattr(r, f"anatomy_{name}_s")), value(getattr(r, f"anatomy_{name}_share"))
    if status == "n/a" or seconds is None:
        return f"n/a ({getattr(r, f'anatomy_{name}_why')})"
    if status == "unresolved":
        return f"unresolved {ms(seconds)}"
    return ms(seconds) + (f" ({share:.0%})" if share is not None else "")


def exposed_cell(r, digits: int = 1) -> str:
    """The exposed-communication ratio of a group row, 'unresolved' where its part is."""
    if getattr(r, "anatomy_exposed_comm_status", None) == "unresolved":
        return "unresolved"
    return pct(r.exposed_comm_ratio, digits)


def measured_rows(agg: pd.DataFrame) -> pd.DataFrame:
    return agg[agg["runs"] > 0].sort_values(["label", "world_size"], kind="stable")


def anatomy_table(agg: pd.DataFrame) -> Table:
    """One row per stack and N of a context with an ok run: the step and its five parts."""
    return Table(
        ANATOMY_HEADERS,
        [
            [r.label, n_cell(r), ms(r.t_step_s) if value(r.t_step_s) is not None else "n/a"]
            + [part_cell(r, name) for name in PARTS]
            for r in measured_rows(agg).itertuples()
        ],
    )


def anatomy_plot(agg: pd.DataFrame) -> Plot:
    """Stacked horizontal bars, one per stack and N: each resolved part a segment (gid '<label> N=<n>
    <part>'), the measured step a tick ('<label> N=<n> step'); an unresolved or n/a part is not drawn but
    named in the text beside the bar ('<label> N=<n> undrawn'); an oversubscribed bar hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = list(measured_rows(agg).itertuples())
    fig, ax = plt.subplots(figsize=(7.5, 1.8 + 0.42 * max(len(rows), 1)))
    ticks, ends = [], []
    for y, r in enumerate(rows):
        name = f"{r.label} N={int(r.world_size)}"
        left, unresolved, missing = 0.0, [], []
        for part in PARTS:
            seconds = resolved_part(r, part)
            status = getattr(r, f"anatomy_{part}_status")
            if seconds is None:
                if status == "unresolved":
                    unresolved.append(f"{LABELS[part]} {part_cell(r, part)}")
                else:
                    missing.append(LABELS[part])
                continue
            if seconds <= 0:  # resolved, within its noise of none: nothing to draw
                continue
            (bar,) = ax.barh(y, seconds * 1e3, left=left, color=PART_COLORS[part], gid=f"{name} {part}")
            if status == "derived":
                bar.set(alpha=0.8)
            if r.oversubscribed:
                bar.set(hatch="///", edgecolor="white")
            left += seconds * 1e3
        if value(r.t_step_s) is not None:
            ax.plot([r.t_step_s * 1e3], [y], "k|", ms=14, mew=2, gid=f"{name} step")
        end = max(left, (value(r.t_step_s) or 0) * 1e3)
        ends.append(end)
        if unresolved or missing:
            text = "; ".join([*unresolved, *(["n/a: " + ", ".join(missing)] if missing else [])])
            ax.text(end, y, f"  not drawn: {text}", va="center", fontsize=6, gid=f"{name} undrawn")
        ticks.append(f"{r.label} N={n_cell(r)}")
    ax.set_yticks(range(len(rows)), ticks, fontsize=7)
    ax.invert_yaxis()
    ax.set(title=PLOT_TITLE, xlabel="ms per step (median over repeats)")
    ax.set_xlim(0, 1.7 * max([*ends, 1e-3]))  # room for the text of the parts not drawn
    ax.grid(alpha=0.3, axis="x")
    handles: list = [Patch(color=PART_COLORS[p], label=LABELS[p]) for p in PARTS]
    handles.append(Line2D([], [], color="k", marker="|", ls="none", ms=10, mew=2, label="measured step"))
    if any(r.oversubscribed for r in rows):
        handles.append(Patch(facecolor="0.6", edgecolor="white", hatch="///", label=HOLLOW))
    ax.legend(
        handles=handles,
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / fig.get_figheight() - 0.1),
        ncol=4,
    )
    return fig


def anatomy_figure(agg: pd.DataFrame) -> Figure:
    import matplotlib.pyplot as plt

    fig = anatomy_plot(agg)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")  # the legend below
    plt.close(fig)
    return Figure(PLOT_TITLE, buf.getvalue())


def anatomy_section(agg: pd.DataFrame, with_figures: bool) -> Section:
    """The anatomy of every stack at every N of one context, under its framework selection."""
    sec = Section(
        "Where each step goes (the step's anatomy, every N)",
        4,
        [
            "Forward, backward and optimizer timed between device synchronisations in steps of their own "
            "(without communication); exposed comm = the measured step less t_compute; other = t_compute "
            "less the three. Medians over repeats, with each part's share of the step. A part marked "
            "unresolved is negative beyond its noise in a repeat: its value is shown, never drawn or "
            "concluded from."
            + (
                f" {OVERSUBSCRIBED} rows measure contention for the CPUs."
                if measured_rows(agg)["oversubscribed"].any()
                else ""
            ),
            anatomy_table(agg),
        ],
    )
    if with_figures and len(measured_rows(agg)):
        sec.blocks.append(anatomy_figure(agg))
    return sec


def anatomy_sentence(r, at: pd.DataFrame) -> str:
    """Why a stack ranks below the fastest at this N, where one of its parts is longer than the fastest's
    same part by at least EXPLAINS of the gap between their steps; '' otherwise, and wherever a part of
    either is unresolved (the parts hang together: an unresolved exposed part leaves 'other' unsure too)."""
    best = at.loc[at["throughput"].idxmax()]
    gap = (value(r.t_step_s) or 0.0) - (value(best["t_step_s"]) or 0.0)
    if r.label == best["label"] or gap <= 0:
        return ""
    statuses = [getattr(x, f"anatomy_{p}_status") for x in (r, best) for p in PARTS]
    if "unresolved" in statuses:
        return ""
    excess = {}
    for part in PARTS:
        mine, theirs = resolved_part(r, part), resolved_part(best, part)
        if mine is not None and theirs is not None:
            excess[part] = (mine - theirs, mine, theirs)
    if not excess:
        return ""
    part, (more, mine, theirs) = max(excess.items(), key=lambda kv: kv[1][0])
    if more < EXPLAINS * gap:
        return ""
    share = value(getattr(r, f"anatomy_{part}_share"))
    share = share if share is not None else mine / r.t_step_s
    return (
        f" Its {SENTENCE_NAMES.get(part, LABELS[part])} is {share:.0%} of its step ({ms(mine)} against "
        f"{ms(theirs)} for {best['label']}): {ms(more)}{', more than' if more > gap else ' of'} the "
        f"{ms(gap)} by which its step is longer."
    )


SENTENCE_NAMES = {
    "exposed_comm": "exposed communication",
    "other": "other time (within t_compute, outside forward, backward and optimizer)",
}
