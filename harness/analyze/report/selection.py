"""The report's framework selection: one ranking per context with a sentence of advice per backend, assembled
from the measured figures, never canned per backend. A sentence drawn from an oversubscribed CPU run says so.

Every number comes from harness.analyze.analysis; this module only chooses and formats.
"""

from __future__ import annotations

import pandas as pd

from backends import REFERENCE_BACKEND
from harness.analyze.report.contexts import OVERSUBSCRIBED, context_title, oversubscribed_ns
from harness.document import Section, Table, nbytes, num, pct, value


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
