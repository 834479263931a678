"""The options of `harness run` (shared by sweep, plan, slurm and k8s) and their validation into a RunConfig.

Everything is checked here, before anything launches: bad input is a UsageError (one line, exit 2).
"""

from __future__ import annotations

import argparse
import errno
import tempfile
from pathlib import Path

from backends import all_backends, backend_names, get_backend
from core.config import COMPUTE_METHODS, DEVICES, PRECISIONS, VARIANTS, InvalidConfig, RunConfig
from core.hooks import FAULT_KINDS
from core.process import available_cpus
from harness.arguments import (
    fault_spec,
    foreign_flags,
    hooks_from_args,  # noqa: F401 (importable from here a while)
    micro_batch_for,
    node_layout,
    non_negative,
    positive,
    seconds,
    spec_from_args,
    worker_python,
)
from harness.run.devices import resolve_device
from harness.run.nodes import add_node_arguments
from harness.usage import UsageError, choice
from workloads.spec import OVERRIDES, PRESETS

DEFAULT_OUT = Path("results")


def check_out_dir(out: Path) -> None:
    """`--out` must be a folder this process can write records into: checked before anything launches,
    so a typo or a read-only mount is one line, not a traceback after the run."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out, prefix=".write-check.").close()
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write records there ({exc.strerror or exc})") from None


# Errors of a filesystem that no longer takes writes: full, over quota, read-only.
FILESYSTEM_FULL_OR_SHUT = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def os_error_line(exc: OSError, out: Path) -> str:
    """One line for an OSError that ended a run: one on a path under the results folder (full, read-only,
    over quota) names the folder; any other (a launcher that cannot start, a pipe) says what it was."""
    what = exc.strerror or str(exc)
    where = Path(exc.filename).resolve() if exc.filename else None
    root = Path(out).resolve()
    under_out = where is not None and (where == root or root in where.parents)
    if under_out or (where is None and exc.errno in FILESYSTEM_FULL_OR_SHUT):
        return f"harness: error: cannot write under {out}: {what}"
    return f"harness: error: {what}" + (f": {exc.filename}" if exc.filename else "")


def add_python_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--python",
        action="append",
        metavar="[BACKEND=]PATH",
        help="the interpreter the launcher and workers run under, e.g. a venv of the backend's own stack; "
        "BACKEND=PATH names one backend (a sweep of several); default: $DISTBENCH_PYTHON_<BACKEND>, else "
        ".venvs/<stack>/bin/python (./setup.sh --stack), else the harness's own",
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `sweep` (everything that defines the work and how it is measured)."""
    p.add_argument(
        "--quiet",
        action="store_true",
        help="plain progress lines instead of the live display (the default when stdout is not a terminal)",
    )
    p.add_argument(
        "--tensorboard",
        type=Path,
        metavar="DIR",
        help="also write each run's per-step curves as TensorBoard event files under DIR/<run>/",
    )
    p.add_argument("--workload", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    for flag in OVERRIDES:
        p.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            type=positive,
            help=f"override the preset's {OVERRIDES[flag]}",
        )
    p.add_argument("--precision", default="fp32", help=f"{', '.join(PRECISIONS)}")
    p.add_argument(
        "--tf32",
        action="store_true",
        help="fp32 runs: let fp32 matmuls and convolutions run as TF32 in every framework (default: IEEE "
        "fp32 everywhere, whatever each framework's own default)",
    )
    p.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)} (auto: cuda if a GPU is visible)")
    p.add_argument("--micro-batch", type=positive, help="sequences per rank per micro-step (default 8)")
    p.add_argument(
        "--global-batch", type=positive, help="global batch; micro-batch = global / (gpus x accum)"
    )
    p.add_argument("--grad-accum", type=positive, default=1)
    p.add_argument("--steps", type=positive, default=20, help="measured steps")
    p.add_argument(
        "--warmup", type=non_negative, default=3, help="steps run first and excluded from statistics"
    )
    p.add_argument(
        "--compute-steps", type=non_negative, default=5, help="sync-off steps for t_compute (no_sync method)"
    )
    p.add_argument(
        "--isolated-repeats",
        type=positive,
        default=2,
        help="launches of the isolated counterfactual (isolated method), one after the other",
    )
    p.add_argument(
        "--trace-comm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the measured steps, profile --trace-steps more with the stack's own instrument for the "
        "collective trace: measured bytes, time and compute overlap per op (default on)",
    )
    p.add_argument("--trace-steps", type=positive, default=2, help="steps profiled for the collective trace")
    p.add_argument(
        "--compute-method", default="auto", help=f"{', '.join(COMPUTE_METHODS)}: how t_compute is measured"
    )
    p.add_argument(
        "--threads-per-worker", type=positive, help="CPU threads per worker (default: cores / gpus)"
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument(
        "--tuned",
        action="store_true",
        help="the stack's tuned set: the settings its own documentation and reference trainers use (each "
        "listed in the record with its source; a flag given as well overrides its setting)",
    )
    p.add_argument(
        "--data",
        help="flat token file (memory-mapped; uint16, uint32 where the vocabulary is above 65,536) instead "
        "of synthetic tokens",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=seconds, default=900.0, help="seconds before the whole run is killed")
    p.add_argument(
        "--collective-timeout",
        type=seconds,
        help="seconds a collective waits for a dead or hung peer "
        "before the ranks give up (default: --timeout)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for run records")
    testing = p.add_argument_group("testing (never for real measurements)")
    testing.add_argument(
        "--inject-fault",
        metavar="RANK:STEP:KIND",
        type=fault_spec,
        help=f"make one rank fail; KIND: {', '.join(FAULT_KINDS)}",
    )
    testing.add_argument("--step-delay", type=float, default=0.0, help="seconds of sleep added to every step")
    testing.add_argument(
        "--warmup-transient",
        metavar="BYTES",
        type=positive,
        help="each rank takes and frees this much memory before its first warm-up step",
    )
    testing.add_argument(
        "--dump-weights", action="store_true", help="rank 0 saves its final weights in the log dir"
    )
    add_python_argument(p)
    for backend in all_backends():
        backend.Options.add_arguments(p, backend.name)
    add_node_arguments(p)


def build_config(
    args,
    backend_name: str,
    n: int,
    threads: int | None = None,
    check_devices: bool = True,
    node_rank: int | None = None,
    backends_in_use: list[str] | None = None,
    variant: str | None = None,
) -> RunConfig:
    """Validate CLI input into a RunConfig (raises UsageError with the valid choices). `check_devices`
    False: for a plan made elsewhere, do not require the GPUs to be visible here. `backends_in_use`: the
    backends a sweep runs, whose options may all be given (default: this one). `variant`: one of VARIANTS
    (default: "tuned" under --tuned); a tuned run's options are the stack's tuned set on its device, under
    the flags given."""
    backend = get_backend(choice(backend_name, backend_names(), "backend"))
    foreign_flags(args, backends_in_use or [backend.name])
    options = backend.Options.from_args(args)
    spec = spec_from_args(args)
    choice(args.precision, PRECISIONS, "precision")
    if getattr(args, "tf32", False) and args.precision != "fp32":
        raise UsageError(
            f"--tf32 applies to --precision fp32 only: a {args.precision} run computes its matmuls in "
            f"{args.precision} and keeps what it computes in fp32 IEEE; drop --tf32 or use --precision fp32"
        )
    choice(args.device, DEVICES, "device")
    choice(args.compute_method, COMPUTE_METHODS, "compute method")
    micro = micro_batch_for(args, n)
    if args.data and not Path(args.data).is_file():
        raise UsageError(f"--data {args.data}: no such file")
    method, methods = args.compute_method, backend.compute_methods_for(options)
    if method == "auto":
        method = methods[0]
    elif method not in (*methods, "none"):
        raise UsageError(
            f"backend {backend.name} cannot use compute method '{method}'; valid: {', '.join(methods)}, none"
        )
    layout = node_layout(args, n, node_rank)
    if layout["nodes"] > 1 and not backend.multi_node:
        raise UsageError(f"backend {backend.name} runs on one node only; drop --nodes/--hosts")
    per_node = n // layout["nodes"]
    launcher_only = bool(getattr(args, "launcher_only", False))
    if launcher_only:
        if not backend.starts_remote_ranks:
            raise UsageError(
                f"--launcher-only: {backend.name}'s launcher does not start the other hosts' ranks; "
                f"valid: {', '.join(b.name for b in all_backends() if b.starts_remote_ranks)}"
            )
        if args.device == "auto":
            raise UsageError(
                "--launcher-only needs --device cuda or cpu: the ranks' hosts decide, not this one"
            )
        if not layout["hosts"]:
            raise UsageError("--launcher-only needs the ranks' hosts: --hosts or --hostfile")
        if method != "none":
            raise UsageError(
                "--launcher-only runs no rank here, so no isolated counterfactual either: "
                "add --compute-method none"
            )
        check_devices = False
    device = resolve_device(args.device, per_node) if check_devices or args.device == "auto" else args.device
    cores = available_cpus()
    cfg = RunConfig.build(
        backend=backend.name,
        workload=args.workload,
        spec=spec,
        world_size=n,
        device=device,
        precision=args.precision,
        tf32=bool(getattr(args, "tf32", False)),
        micro_batch=micro,
        grad_accum=args.grad_accum,
        steps=args.steps,
        warmup=args.warmup,
        compute_steps=args.compute_steps,
        isolated_repeats=args.isolated_repeats,
        trace_comm=args.trace_comm,
        trace_steps=args.trace_steps,
        compute_method=method,
        threads_per_worker=threads or args.threads_per_worker or max(1, cores // per_node),
        seed=args.seed,
        data_path=str(Path(args.data).resolve()) if args.data else None,
        activation_checkpointing=args.activation_checkpointing,
        scaling="strong" if args.global_batch else "weak",
        timeout_s=args.timeout,
        collective_timeout_s=getattr(args, "collective_timeout", None),
        **layout,
        launcher_only=launcher_only,
        backend_options=options.to_dict(),
        python=worker_python(args, backend.name, backends_in_use or [backend.name], check_devices),
        dump_weights=args.dump_weights,
    )
    variant = variant or ("tuned" if getattr(args, "tuned", False) else "default")
    choice(variant, VARIANTS, "variant")
    if variant == "tuned":
        tuned = {name: setting.value for name, setting in backend.tuned(cfg).items()}
        cfg = cfg.evolve(backend_options=backend.Options.from_args(args, tuned).to_dict(), variant=variant)
    try:
        backend.validate(cfg)
    except InvalidConfig as exc:
        raise UsageError(str(exc)) from None
    return cfg
