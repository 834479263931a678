"""Horovod's collectives in a step: its tensor fusion during backward (framework-free)."""

from __future__ import annotations

from backends.base import parameter_numels
from backends.schedule import Call, MiB, Schedule, Steps, Term, buckets, unit_of
from core.config import RunConfig

FUSION_BYTES = 128 * MiB  # HOROVOD_FUSION_THRESHOLD's default
CYCLE_S = 0.001  # HOROVOD_CYCLE_TIME's default (1 ms): a ready tensor waits half a cycle on average


def horovod_schedule(cfg: RunConfig, dtype_bytes: int) -> Schedule:
    """DistributedOptimizer submits each gradient (`dtype_bytes` a element: fp32, or fp16 compressed) when
    its backward ends, once a step (backward_passes_per_step = the accumulation steps); the background
    thread fuses what is ready in one cycle, up to the fusion threshold: tensors ready in the same segment
    go together, half a cycle after it ends."""
    steps = Steps(cfg)
    by_segment: dict[int, list[tuple[str, int]]] = {}
    for name, n in reversed(parameter_numels(cfg).items()):
        by_segment.setdefault(steps.at("backward", unit_of(name)), []).append((name, n))
    calls = [
        Call(elements, ready, steps.optimizer, "gradients (fused)", CYCLE_S / 2)
        for ready, tensors in sorted(by_segment.items())
        for _names, elements in buckets(tensors, FUSION_BYTES, FUSION_BYTES, dtype_bytes)
    ]
    return Schedule(
        (Term("all_reduce", "gradients", dtype_bytes, 1, calls),),
        "Horovod fusion (128 MiB, 1 ms cycle) during backward",
    )
