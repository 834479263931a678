"""From a verb's parsed arguments to the parts of a RunConfig that `harness run` (and sweep, plan, slurm,
k8s) and `harness predict` share: the workload spec with its overrides, the micro-batch from a global
batch, backend options given to the wrong backend, the workers' interpreter and the test hooks."""

from __future__ import annotations

from backends import all_backends, get_backend, interpreter
from core.config import BatchConfig
from core.hooks import TestHooks
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


def worker_python(args, backend: str, in_use: list[str], check: bool = True) -> str:
    """The interpreter `backend`'s workers run under: --python (BACKEND=PATH before a bare PATH), else what
    backends.interpreter.configured finds. `check` False (a plan or job file for another machine): a path
    given is taken as it is, unchecked here."""
    named: dict[str, str] = {}
    for item in getattr(args, "python", None) or []:
        name, sep, path = item.partition("=")
        key = name if sep and "/" not in name else ""
        if key and key not in in_use:
            raise UsageError(f"--python {item}: backend '{key}' is not run here; valid: {', '.join(in_use)}")
        if key in named:
            what = f"for backend {key}" if key else "without a backend (name it: --python BACKEND=PATH)"
            raise UsageError(f"--python {item}: a second interpreter {what}")
        named[key] = path if key else item
    given = named.get(backend) or named.get("")
    try:
        if given:
            return interpreter.usable(given, "--python") if check else given
        return interpreter.configured(backend, get_backend(backend).framework)[0]
    except interpreter.InterpreterError as exc:
        raise UsageError(str(exc)) from None


def hooks_from_args(args) -> TestHooks:
    """The test hooks the testing flags set (--inject-fault, and --step-delay where the command has it):
    kept out of the RunConfig, the runner hands them to the workers (core.hooks)."""
    return TestHooks(
        fault=getattr(args, "inject_fault", None),
        step_delay_s=getattr(args, "step_delay", None) or 0.0,
        warmup_transient_bytes=getattr(args, "warmup_transient", None) or 0,
    )
