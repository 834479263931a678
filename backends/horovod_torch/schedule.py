"""Horovod's collectives in a step: its tensor fusion during backward (framework-free)."""

from __future__ import annotations

from backends.base import parameter_numels
from backends.horovod_torch.options import HorovodOptions
from backends.schedule import Call, MiB, Schedule, Steps, Term, buckets, unit_of
from core.config import RunConfig


def horovod_schedule(cfg: RunConfig, dtype_bytes: int) -> Schedule:
    """DistributedOptimizer submits each gradient (`dtype_bytes` a element: fp32, or fp16 compressed) when
    its backward ends, once a step (backward_passes_per_step = the accumulation steps); the background
    thread fuses what is ready in one cycle, up to the fusion threshold: tensors ready in the same segment
    go together, half a cycle after it ends (a ready tensor waits half a cycle on average)."""
    opts = HorovodOptions.from_dict(cfg.backend_options)
    fusion_bytes, cycle_s = opts.fusion_threshold_mb * MiB, opts.cycle_time_ms / 1000
    steps = Steps(cfg)
    by_segment: dict[int, list[tuple[str, int]]] = {}
    for name, n in reversed(parameter_numels(cfg).items()):
        by_segment.setdefault(steps.at("backward", unit_of(name)), []).append((name, n))
    calls = [
        Call(elements, ready, steps.optimizer, "gradients (fused)", cycle_s / 2)
        for ready, tensors in sorted(by_segment.items())
        for _names, elements in buckets(tensors, fusion_bytes, fusion_bytes, dtype_bytes)
    ]
    return Schedule(
        (Term("all_reduce", "gradients", dtype_bytes, 1, calls),),
        f"Horovod fusion ({opts.fusion_threshold_mb} MiB, {opts.cycle_time_ms:g} ms cycle) during backward",
    )
