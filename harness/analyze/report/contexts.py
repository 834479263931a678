"""How the report names a context and marks an oversubscribed CPU point, alike in every section that shows
one: the scaling table and plots (training.py) and the framework selection (selection.py)."""

from __future__ import annotations

import pandas as pd


def context_title(ctx: dict) -> str:
    return (
        f"{ctx['workload']} · {ctx['precision']} · {ctx['device']} · "
        f"{ctx['scaling']} scaling ({ctx['batch']}) · {ctx['settings']}"
    )


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
