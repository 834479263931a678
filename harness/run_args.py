"""The parts of turning CLI input into a RunConfig that `harness run` (and sweep, plan, slurm, k8s) and
`harness predict` share: the workload spec with its overrides, the micro-batch from a global batch, and
backend options given to the wrong backend. Below both harness.run and harness.predict."""

from __future__ import annotations

from backends import all_backends
from core.config import BatchConfig
from harness.usage import UsageError, choice
from workloads.spec import OVERRIDES, PRESETS, ModelSpec, resolve


def foreign_flags(args, backends: list[str]) -> None:
    """Refuse a backend option given for a run of another backend: it would be silently ignored. A flag
    several stacks share (--compile) is refused only where none of `backends` takes it."""
    taken = {flag for b in all_backends() if b.name in backends for flag in b.Options.flags()}
    for other in all_backends():
        if other.name in backends:
            continue
        for flag in set(other.Options.given(args)) - taken:
            owners = [b.name for b in all_backends() if flag in b.Options.flags()]
            whose = f"backend{'s' if len(owners) > 1 else ''} {', '.join(owners)}"
            raise UsageError(f"{flag} is an option of {whose}, not of {', '.join(backends)}")


def spec_from_args(args) -> ModelSpec:
    """The preset with the overrides given (--layers, --d-model, ...)."""
    choice(args.workload, list(PRESETS), "workload")
    try:
        return resolve(args.workload, **{k: getattr(args, k) for k in OVERRIDES})
    except ValueError as exc:
        raise UsageError(f"invalid workload: {exc}") from None


def micro_batch_for(args, n: int) -> int:
    """--micro-batch, or --global-batch split over n ranks x --grad-accum micro-steps (strong scaling)."""
    if args.micro_batch and args.global_batch:
        raise UsageError("give --micro-batch or --global-batch, not both")
    if not args.global_batch:
        return args.micro_batch or BatchConfig.micro_batch
    if args.global_batch % (n * args.grad_accum):
        raise UsageError(
            f"--global-batch {args.global_batch} is not divisible by gpus x grad-accum = "
            f"{n} x {args.grad_accum} = {n * args.grad_accum}"
        )
    return args.global_batch // (n * args.grad_accum)
