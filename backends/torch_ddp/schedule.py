"""torch DDP's collectives in a step: its gradient buckets, all-reduced during backward (framework-free)."""

from __future__ import annotations

from backends.base import parameter_numels
from backends.schedule import Call, MiB, Schedule, Steps, Term, buckets, unit_of
from backends.torch_ddp.options import DDPOptions
from core.config import RunConfig

# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: DDP closes its first bucket early, whatever bucket_cap_mb
FIRST_BUCKET_BYTES = 1 * MiB


def ddp_schedule(cfg: RunConfig) -> Schedule:
    """DDP all-reduces the fp32 .grad buckets (also under autocast) once a step (no_sync on the
    micro-batches before the last): whole tensors in reverse parameter order, the first bucket closed at
    1 MiB and the others at bucket_cap_mb (25 MiB by default), each all-reduced once its last gradient is
    ready in the last micro-batch's backward, all finished before the optimizer step."""
    bucket_mb = DDPOptions.from_dict(cfg.backend_options).bucket_cap_mb
    steps = Steps(cfg)
    order = list(reversed(parameter_numels(cfg).items()))
    calls = [
        Call(elements, max(steps.at("backward", unit_of(n)) for n in names), steps.optimizer)
        for names, elements in buckets(order, bucket_mb * MiB, FIRST_BUCKET_BYTES, 4)
    ]
    return Schedule(
        (Term("all_reduce", "gradients", 4, 1, calls),),
        f"DDP buckets ({bucket_mb} MiB, first 1 MiB) in reverse order, overlapped with backward",
    )
