"""`harness sweep`: backends x N x repeats, every run through the same path as `harness run`.

Repeats are separate launches, and the matrix is walked repeat by repeat (all backends and N once, then
again), so launch-to-launch noise shows in the spread and a slow drift of the machine does not land on one
configuration only. Every run writes its own record, failed or not; `--resume` skips what is already done.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import math
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass

from backends import backend_names
from backends.base import Backend
from core.config import VARIANTS, BatchConfig, RunConfig
from core.process import available_cpus
from core.records import config_key, load_records
from harness.arguments import (
    RunRequest,
    add_flags,
    add_run_arguments,
    declared,
    gpu_list,
    hooks_from_args,
    positive,
)
from harness.arguments.parsers import FILL
from harness.arguments.request import FILL_PLACEHOLDER
from harness.run.launch import stop_on_sigterm, stopped
from harness.run.options import check_out_dir, os_error_line, run_request
from harness.run.progress import RunDisplay, make_progress
from harness.run.record import record_line
from harness.run.runner import execute
from harness.usage import EXIT_FAILED, EXIT_OK, UsageError, choice


@dataclass
class PlannedRun:
    backend: Backend
    cfg: RunConfig
    repeat: int


def selected_backends(text: str | None) -> list[str]:
    """--backends: the names given, in order, or every backend ("all", or none given)."""
    names = backend_names()
    if not text or text.strip() == "all":
        return names
    wanted = [v.strip() for v in text.split(",") if v.strip()]
    for name in wanted:
        choice(name, [*names, "all"], "backend")
    return list(dict.fromkeys(wanted))


def selected_variants(args) -> list[str]:
    """--variants 'default,tuned' -> ["default", "tuned"]; without it, what --tuned says (one variant)."""
    if not getattr(args, "variants", None):
        return ["tuned" if args.tuned else "default"]
    if args.tuned:
        raise UsageError("give --variants or --tuned, not both (--tuned is --variants tuned)")
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    for variant in wanted:
        choice(variant, list(VARIANTS), "variant")
    if not wanted:
        raise UsageError(f"--variants: expected a comma-separated list of {', '.join(VARIANTS)}")
    return list(dict.fromkeys(wanted))


def batch_args(args, scaling: str, ns: list[int]) -> argparse.Namespace:
    """The run options for one scaling mode. Weak: the per-device batch is fixed (--micro-batch).
    Strong: the global batch is fixed (--global-batch; by default micro-batch x grad-accum x lcm(N), so it
    splits evenly over every N, with the default micro-batch at the largest N)."""
    out = argparse.Namespace(**vars(args))
    if scaling == "weak":
        if args.global_batch:
            raise UsageError("--global-batch fixes the global batch: use it with --scaling strong")
        return out
    if args.micro_batch == FILL:
        raise UsageError(
            "--micro-batch max fills each run's device: it is weak scaling, not --scaling strong"
        )
    if not args.global_batch:
        micro = args.micro_batch or BatchConfig.micro_batch
        accum = args.grad_accum or BatchConfig.grad_accum
        out.global_batch, out.micro_batch = micro * accum * math.lcm(*ns), None
    return out


def refuse_multi_node(request: RunRequest) -> None:
    """A sweep runs on one node: each multi-node run needs a run id all its nodes agree on, and nodes
    other than 0 get no record to report, so a sweep cannot drive several nodes."""
    nodes = request.layout.nodes or len(request.layout.hosts) or 1
    if nodes > 1:
        raise UsageError(
            f"sweep runs on one node, not {nodes}: for multi-node runs submit one "
            "`harness slurm --nodes M --gpus-per-node G run ...` (or `harness k8s`) job per configuration"
        )


def plan(args) -> tuple[list[PlannedRun], dict[str, str]]:
    """Every run of the sweep in launch order, and the unavailable backends with the reason. All configs
    are validated before anything is launched, so bad input never stops a sweep half-way."""
    names = selected_backends(args.backends)
    scaling = args.scaling or ("strong" if args.global_batch else "weak")
    request = run_request(batch_args(args, scaling, args.gpus), names, fills=True)
    refuse_multi_node(request)
    # The same threads for every N: cores shared out over the largest N, so the hardware per worker is
    # constant along the sweep (recorded in each config).
    threads = args.threads_per_worker or max(1, available_cpus() // max(args.gpus))
    skipped, configs = {}, []
    variants = selected_variants(args)
    for name, backend in request.backends.items():
        ok, reason = backend.availability(request.python(name))
        if not ok:
            skipped[name] = reason
            continue
        configs += [
            (backend, request.config(name, n, threads, variant=variant))
            for variant in variants
            for n in args.gpus
        ]
    if not configs:
        raise UsageError(
            "no available backend to sweep: " + "; ".join(f"{k} ({v})" for k, v in skipped.items())
        )
    return [PlannedRun(b, cfg, r) for r in range(args.repeats) for b, cfg in configs], skipped


def as_planned(record: dict) -> dict:
    """The record as its run was planned: a micro-batch `--micro-batch max` chose (harness.run.fill) was
    the plan's placeholder until the probe, so a resumed sweep finds the run done whatever it chose."""
    if not record.get("micro_batch_choice"):
        return record
    config = {**record["config"], "batch": {**record["config"]["batch"], "micro_batch": FILL_PLACEHOLDER}}
    return {**record, "config": config}


def drop_done(runs: list[PlannedRun], out_dir) -> tuple[list[PlannedRun], int]:
    """Runs not yet recorded with status ok in out_dir (k ok records of a config stand for its first k
    repeats); failed runs are not done and run again."""
    done = (
        Counter(config_key(as_planned(r), "*") for r in load_records([out_dir]) if r["status"] == "ok")
        if out_dir.is_dir()
        else Counter()
    )
    todo = []
    for run in runs:
        planned = {"config": run.cfg.to_dict(), "backend_info": {"label": run.backend.label(run.cfg)}}
        key = config_key(planned, "*")
        if done[key]:
            done[key] -= 1
        else:
            todo.append(run)
    return todo, len(runs) - len(todo)


def clock(seconds: float) -> str:
    return str(dt.timedelta(seconds=round(seconds)))


def progress_line(
    k: int, n: int, run: PlannedRun, record: dict, took: float, elapsed: float, repeats: int
) -> str:
    """One line per finished run: which, outcome, its throughput, and the sweep's time so far and to go
    (ETA = mean launch time so far x runs left)."""
    tput = record["summary"]["throughput_tokens_per_s"]
    outcome = (
        f"{tput:,.0f} tok/s"
        if record["status"] == "ok" and tput
        else (record.get("error") or {}).get("message", "")
    )
    if record.get("incident"):
        outcome += f" (incident after the measured steps: {record['incident']['phase']})"
    eta = elapsed / k * (n - k)
    return (
        f"[{k}/{n}] {record['backend_info']['label']} N={run.cfg.topology.world_size} "
        f"repeat {run.repeat + 1}/{repeats}: "
        f"{record['status']} in {took:.1f} s, {outcome} | elapsed {clock(elapsed)}, ETA {clock(eta)}"
    )


def cmd_sweep(args) -> int:
    runs, skipped = plan(args)
    check_out_dir(args.out)
    sweep_id = f"{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
    cfg = runs[0].cfg
    print(
        f"sweep {sweep_id}: {len(runs)} runs = {len({r.backend.name for r in runs})} backend(s) x N in "
        f"{','.join(map(str, args.gpus))} x {args.repeats} repeat(s); {cfg.batch.scaling} scaling, "
        f"{cfg.topology.threads_per_worker} thread(s)/worker on {cfg.topology.device}"
    )
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    if args.resume:
        runs, n_done = drop_done(runs, args.out)
        print(f"resume: {n_done} run(s) already recorded ok in {args.out} are skipped")
    stop_on_sigterm()
    start, records = time.monotonic(), []
    live = sys.stdout.isatty() and not args.quiet
    bars = make_progress(sys.stdout) if live else None
    overall = bars.add_task("sweep", total=len(runs), status="") if bars is not None else None
    with bars or contextlib.nullcontext():
        for k, run in enumerate(runs, 1):
            if why := stopped():  # the run it stopped has its record; start no other
                print(
                    f"sweep {sweep_id}: stopped by {why}; {len(runs) - k + 1} run(s) not started "
                    "(--resume runs them)",
                    flush=True,
                )
                break
            t0 = time.monotonic()
            with RunDisplay(live=live, progress=bars) as display:
                display.phase(f"run {k}/{len(runs)}: {run.backend.name} N={run.cfg.topology.world_size}")
                cfg, choice = run.cfg, None
                if args.micro_batch == FILL:
                    from harness.run import fill  # here: the memory model's libraries load with it

                    display.phase("probing the largest micro-batch that fits (--micro-batch max)")
                    probe = functools.partial(fill.probe_run, timeout_s=cfg.measurement.timeout_s)
                    cfg, choice = fill.choose(cfg, probe)
                try:
                    record = execute(
                        run.backend,
                        cfg,
                        args.out,
                        sys.argv,
                        sweep={"id": sweep_id, "repeat": run.repeat},
                        display=display,
                        hooks=hooks_from_args(args),
                        annotations={"micro_batch_choice": choice} if choice else None,
                    )
                except OSError as exc:  # the results filesystem full or read-only: no run after it can
                    print(os_error_line(exc, args.out), file=sys.stderr)  # write its record either
                    print(
                        f"sweep {sweep_id}: stopped at run {k}; {len(runs) - k + 1} run(s) without a "
                        "record (--resume runs them)",
                        flush=True,
                    )
                    return EXIT_FAILED
                display.finish(record)
            records.append(record)
            if record.get("unwritten"):
                print(record_line(record, args.out / (record["run_id"] + ".json")), flush=True)
            if args.tensorboard:
                # imported here: tensorboard's protobufs and pandas cost every sweep's start about 0.25 s
                from harness.analyze.export import write_tensorboard

                write_tensorboard([record], args.tensorboard)
            now = time.monotonic()
            line = progress_line(k, len(runs), run, record, now - t0, now - start, args.repeats)
            if bars is not None and overall is not None:
                bars.update(overall, completed=k, status=f"ETA {clock((now - start) / k * (len(runs) - k))}")
                bars.console.print(line)
            else:
                print(line, flush=True)
    failed = [r for r in records if r["status"] != "ok" or r.get("unwritten")]
    print(
        f"sweep {sweep_id}: {len(records)} run(s), {len(records) - len(failed)} ok, {len(failed)} failed; "
        f"records in {args.out} (summarize with `harness report`)"
    )
    for r in failed:
        print(f"  {r['status']}: {r['run_id']}: {(r.get('error') or {}).get('message')}")
    return EXIT_FAILED if failed else EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run backends x N x repeats, one record per run")
    # A sweep runs several stacks at several N: --gpus is a list (run's is one N), in the order given.
    gpus = declared("--gpus").but(
        type=gpu_list, required=True, help="comma-separated N (ranks), e.g. 1,2,4,8"
    )
    add_flags(p, "--backends", gpus)
    p.add_argument("--repeats", type=positive, default=3, help="separate launches per backend x N")
    p.add_argument(
        "--variants",
        help=f"comma-separated, of {', '.join(VARIANTS)}: each backend x N in each (default: --tuned's one)",
    )
    add_flags(p, "--scaling")
    p.add_argument(
        "--resume", action="store_true", help="skip runs already recorded ok for the same config in --out"
    )
    add_run_arguments(p)
    p.set_defaults(func=cmd_sweep)
