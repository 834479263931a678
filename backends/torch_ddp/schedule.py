"""torch DDP's collectives in a step: its gradient buckets, all-reduced during backward (framework-free)."""

from __future__ import annotations

from backends.base import parameter_numels
from backends.schedule import Call, MiB, Schedule, Steps, Term, buckets, unit_of
from backends.torch_ddp.options import DDPOptions
from core.config import RunConfig

# DDP's defaults when bucket_cap_mb is not given: 25 MiB buckets, and the first closed early at
# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_MB = 25
FIRST_BUCKET_BYTES = 1 * MiB


def ddp_schedule(cfg: RunConfig) -> Schedule:
    """DDP all-reduces the fp32 .grad buckets (also under autocast) once a step (no_sync on the
    micro-batches before the last): whole tensors in reverse parameter order, by default the first bucket
    closed at 1 MiB and the others at 25 MiB (a bucket_cap_mb given closes every bucket at that size), each
    all-reduced once its last gradient is ready in the last micro-batch's backward, all finished before the
    optimizer step.

    With --compile (each block compiled before the wrapper, TorchDDP.tuned) a block's backward is one
    autograd node whose gradients are ready together when it ends, the segment this schedule already
    waits for: the buckets' count and ready segments are the same. DDP fills its buckets in the order
    gradients reach it, inside one compiled block the autograd engine's, so where a cap falls inside a
    block the bucket closes at another of its tensors and two buckets' sizes differ from these by some of
    that block's tensors; their total does not (tests/test_tuned_overlap.py holds both to a trace)."""
    given = DDPOptions.from_dict(cfg.backend_options).bucket_cap_mb
    bucket_mb = DEFAULT_BUCKET_MB if given is None else given
    first = FIRST_BUCKET_BYTES if given is None else given * MiB  # DDP's 1 MiB only by default
    steps = Steps(cfg)
    order = list(reversed(parameter_numels(cfg).items()))
    calls = [
        Call(elements, max(steps.at("backward", unit_of(n)) for n in names), steps.optimizer)
        for names, elements in buckets(order, bucket_mb * MiB, first, 4)
    ]
    return Schedule(
        (Term("all_reduce", "gradients", 4, 1, calls),),
        f"DDP buckets ({bucket_mb} MiB, first {first / MiB:g} MiB) in reverse order, overlapped with "
        "backward",
    )
