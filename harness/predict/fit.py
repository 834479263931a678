"""What fits on a device: a candidate's peak bytes per rank, term by term, against the device less an
allocator margin, and the largest micro-batch that fits a rank's share of a global batch (strong scaling,
as users run it: the micro-batch that fits, and gradient accumulation for the rest). `harness select`
sizes every candidate so, and `harness predict --global-batch` each N.
"""

from __future__ import annotations

from backends import get_backend
from core.config import RunConfig
from harness.analyze.summary import fmt_bytes
from harness.predict.model import memory

# What the caching allocator and the framework's runtime take beyond the modelled terms: a fraction of the
# device kept free (fragmentation, the CUDA context, NCCL's own buffers, cuBLAS workspaces).
ALLOCATOR_MARGIN = 0.10
MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)  # tried largest first: the largest that fits is taken


def peak_memory(cfg: RunConfig, factor: float = 1.0, plan=None) -> dict:
    """Bytes per rank: the predictor's terms (model state as the stack holds it, gathered parameters and
    prefetch, communication buffers, activations) and the attention a stack materialises where its
    settings say so (backend.settings()["attention"]: TF's (B,H,T,T) logits, and Paddle's off a GPU)."""
    backend = get_backend(cfg.backend)
    terms = memory(cfg, factor, plan)
    terms.pop("total")
    attention = (backend.settings(cfg) or {}).get("attention") or {}
    terms["materialised_attention"] = float(attention.get("bytes_held_for_backward", 0))
    return {**terms, "total": sum(terms.values())}


def fit_check(terms: dict, capacity: float | None, margin: float = ALLOCATOR_MARGIN) -> str | None:
    """None when the terms fit the device less the allocator margin; else why not, naming the term that
    broke it (the one whose addition, in order, first passes the usable memory)."""
    if not capacity:
        return None
    usable = capacity * (1 - margin)
    running = 0.0
    for name, value in terms.items():
        if name == "total":
            continue
        running += value
        if running > usable:
            return (
                f"{name.replace('_', ' ')} ({fmt_bytes(value)}) breaks it: "
                f"{fmt_bytes(terms['total'])} a rank > {fmt_bytes(usable)} usable "
                f"({fmt_bytes(capacity)} less {margin:.0%} allocator margin)"
            )
    return None


def largest_fitting(
    cfg: RunConfig, share: int, capacity: float | None
) -> tuple[RunConfig | None, dict, str | None]:
    """`cfg` at the largest micro-batch that divides `share` (a rank's sequences a step) and fits, with
    the accumulation that makes up the share: (that config, its memory terms, None); or, where none fits,
    (None, the terms at the smallest micro-batch tried, why it does not fit)."""
    terms: dict = {}
    why: str | None = f"no micro-batch of {MICRO_BATCHES} divides {share}"
    for micro in MICRO_BATCHES:
        if share % micro:
            continue
        trial = cfg.evolve(micro_batch=micro, grad_accum=share // micro)
        terms = peak_memory(trial)
        why = fit_check(terms, capacity)
        if why is None:
            return trial, terms, None
    return None, terms, why
