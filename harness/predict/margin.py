"""The empirical scale-loss margin: per-GPU throughput that published runs lost, per doubling of N beyond one
node, below the low end of the model's band.

Why: the model's band spans its inputs' ranges, and published runs at scale lose more than every modelled term
explains (job placement, congestion, a slow node, framework overheads that grow with N): on the published rows
of harness/predict/published_scaling_rows.yaml most misses lie below the band. A band that misses what was
published gives odds (`harness select`) and budgets (`harness predict`) that are too sure. The margin is not
modelled, it is measured on other people's runs, and every output that uses it labels it empirical.

How it is estimated (split conformal, one-sided): each row's score is the per-doubling loss that would bring
its published ratio up to the band's low end (0 when it is inside); the margin is the largest score of the
rows it is fitted on. For exchangeable rows the largest of n scores covers a new row with probability at least
n/(n+1); published rows are not exchangeable (one publisher's rows share a cluster and a code base), so the
coverage is also checked leave-one-publisher-out: each publisher's rows against the margin fitted on the
other publishers' rows only. Only rows of stacks and versions the product runs are fitted on; the others are
checked against the margin of all fitted rows, which never saw them.
"""

from __future__ import annotations

import functools
import json
import math

from harness.predict.published_check import CHECK_FILE

LABEL = "empirical scale loss"


def doublings_beyond_node(world: int, gpus_per_node: int) -> float:
    """How many times N doubles beyond one node: 0 within a node (where the model is anchored: every published
    row's smaller N fills a node or more)."""
    return max(0.0, math.log2(world / gpus_per_node))


def factor(per_doubling: float, doublings: float) -> float:
    """The share of per-GPU throughput kept at the slow end: (1 - margin) per doubling."""
    return (1.0 - per_doubling) ** doublings


def score(published: float, low: float, doublings: float) -> float:
    """The per-doubling loss that puts `published` at the band's low end `low`; 0 inside or above it."""
    if published >= low or doublings <= 0:
        return 0.0
    return 1.0 - (published / low) ** (1.0 / doublings)


def fitted(scores: list[float]) -> float:
    """The margin of these rows' scores: the largest (0 for none)."""
    return max(scores, default=0.0)


def leave_one_publisher_out(rows: list[dict]) -> dict[str, float]:
    """Each publisher's margin fitted without its own rows: rows are dicts with "publisher" and "score"."""
    return {
        publisher: fitted([r["score"] for r in rows if r["publisher"] != publisher])
        for publisher in sorted({r["publisher"] for r in rows})
    }


@functools.cache
def fitted_margin() -> dict:
    """The margin as published_check.json holds it (written by `python -m harness.predict.published`): its
    value per doubling, the rows and publishers it was fitted on, and the coverage of the rows' bands. Read
    once a process: every calibration (one per stack in `harness select`) takes it."""
    return json.loads(CHECK_FILE.read_text())["empirical_scale_loss"]


def per_doubling() -> float:
    """The margin `harness predict` and `harness select` widen the slow end by (fitted on every product
    row)."""
    return float(fitted_margin()["per_doubling"])


def coverage_line(stored: dict | None = None) -> str:
    """How the margin held on the published rows, in and out of sample, in one line (`stored`: a margin as
    fitted_margin gives it; the stored one where None)."""
    stored = stored or fitted_margin()
    product, other = stored["coverage"]["product_rows"], stored["coverage"]["other_rows"]
    return (
        f"the largest loss below the model's band among {stored['fitted_on']} published runs of the "
        f"product's stacks ({', '.join(stored['publishers'])}); their bands hold {product['model']} of "
        f"{product['rows']} without it, {product['in_sample']} with it, {product['out_of_sample']} fitted "
        f"without each run's publisher; {other['model']} and {other['out_of_sample']} of {other['rows']} "
        f"runs of stacks the product does not run"
    )
