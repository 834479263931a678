"""Hand-made run records with known answers, built the way the runner builds them: raw rank records in the
shape harness.run.record folds from a rank's events (core.events.rank_record), assembled by
harness.run.record.assemble_record with the registered adapter, so the record schema and the summary live
only there and in harness.analyze.metrics. Lets analysis/report/compare tests cover every backend without
launching one.

What a test fixes by hand (step times, memory, the measured model state) is an independent known number;
nothing here is computed by the code under test, so a broken formula cannot agree with itself."""

from __future__ import annotations

from backends import get_backend
from core.commbench_spec import CommbenchSpec
from core.config import RunConfig
from harness.run.record import assemble_commbench_record, assemble_record
from workloads.spec import PRESETS, ModelSpec

DEVICE = "cpu: Test CPU"
STEPS = 4
VERSIONS = {"python": "3.11", "torch": "test"}
START = "2026-01-01T00:00:00+00:00"

# label -> (backend, backend options) for the six stacks; everything else in backend_info (framework,
# launcher, sharding, precision scheme, comm pattern) comes from the registered adapter.
BACKENDS = {
    "torch-ddp": ("torch-ddp", {}),
    "torch-fsdp": ("torch-fsdp", {}),
    "deepspeed-zero3": ("deepspeed", {"zero_stage": 3}),
    "horovod": ("horovod", {}),
    "tf-mwms": ("tf-mwms", {}),
    "paddle-fleet": ("paddle-fleet", {}),
}
# The labels whose default configuration shards parameters, gradients and optimizer state over the ranks.
FULLY_SHARDED = {"torch-fsdp", "deepspeed-zero3"}

# The tiny preset's parameters, counted by hand (d_model 128, d_ff 512, 4 blocks, vocab 2048, seq 128):
#   token embedding 2048 x 128 = 262,144; position embedding 128 x 128 = 16,384
#   per block: 2 LayerNorms 2 x (128 + 128) = 512; qkv 128 x 384 + 384 = 49,536; attn proj 128 x 128 + 128
#   = 16,512; fc 128 x 512 + 512 = 66,048; mlp proj 512 x 128 + 128 = 65,664 -> 198,272; x 4 = 793,088
#   final LayerNorm 256; the LM head is tied to the token embedding (0)
#   total 262,144 + 16,384 + 793,088 + 256 = 1,071,872
TINY_PARAMS = 1_071_872
# AdamW model state per rank, unsharded: param 4 + grad 4 + two moments 8 = 16 bytes per parameter (fp32 or
# autocast; ZeRO's master scheme is 2 + 2 + 12 = 16 too) = 17,149,952 bytes. Fully sharded over N ranks: / N.
TINY_MODEL_STATE = 17_149_952  # 16 x TINY_PARAMS


def environment(
    device_kind: str | None = DEVICE,
    world: int = 1,
    *,
    start_time: str = START,
    versions: dict | None = None,
    commit: str = "abc123",
    **overrides,
) -> dict:
    """A fixed environment, as the runner records it on a test machine."""
    versions = versions or VERSIONS
    return {
        "device_type": "cpu",
        "device_kind": device_kind,
        "device_names": [device_kind] * world,
        "hostnames": ["testhost"],
        "world_size": world,
        "threads_per_worker": 1,
        "process_settings": None,
        "harness_host": "testhost",
        "cpu_count": 2,
        "platform": "Linux-test",
        "python": versions["python"],
        "versions": versions,
        "git": {"commit": commit, "dirty": False},
        "command_line": ["harness"],
        "start_time": start_time,
        "end_time": start_time,
        **overrides,
    }


def rank_record(
    rank: int,
    step_times: list[float],
    *,
    device: str = DEVICE,
    compute_times: list[float] = (),
    losses: list[float] | None = None,
    peak_rss: int = 400 << 20,
    state_total: float = TINY_MODEL_STATE,
    allocated: int | None = None,
    versions: dict | None = None,
) -> dict:
    """A raw rank record of a rank that finished, in the shape the runner folds from its events."""
    n = len(step_times)
    memory = {"peak_rss": peak_rss}
    if allocated is not None:
        memory.update(allocated_peak=allocated, reserved_peak=allocated)
    quarter = state_total / 4  # params : grads : moments = 1 : 1 : 2 (16 bytes per parameter)
    return {
        "rank": rank,
        "host": "testhost",
        "device": device,
        "pid": 1000 + rank,
        "status": "ok",
        "step_times": list(map(float, step_times)),
        "losses": losses if losses is not None else [7.0 - 0.1 * i for i in range(n)],
        "warmup_losses": [7.1],
        "compute_only_step_times": list(compute_times),
        "memory": memory,
        "model_state_bytes": {
            "params": quarter,
            "grads": quarter,
            "optimizer": 2 * quarter,
            "total": state_total,
        },
        "minor_faults_per_step": 0.0,
        "versions": versions or VERSIONS,
        "threads": 1,
        "process_settings": None,
    }


def failed_rank(
    rank: int,
    status: str = "failed",
    error: str = "RuntimeError: injected fault at step 1",
    terminated: bool = False,
    peak_rss: int = 400 << 20,
) -> dict:
    """A raw rank record of a rank that raised, in the shape backends.faults.failure_record returns."""
    return {
        "rank": rank,
        "host": "testhost",
        "pid": 1000 + rank,
        "status": status,
        "error": error,
        "failed_at": 1.0e9 + rank,
        "terminated": terminated,
        "traceback": error,
        "memory": {"peak_rss": peak_rss},
    }


def config(
    label: str = "torch-ddp",
    gpus: int = 1,
    *,
    workload: str = "tiny",
    spec: ModelSpec | None = None,
    variant: str = "default",
    **fields,
) -> RunConfig:
    """A RunConfig as harness.run.options.build_config resolves it: the adapter's options with their
    defaults filled in (a tuned variant: its tuned set over them), and the t_compute method 'auto'
    resolved to the adapter's preferred one."""
    name, options = BACKENDS.get(label, (label, {}))
    backend = get_backend(name)
    opts = backend.Options.from_dict(options)
    fields.setdefault("compute_method", backend.compute_methods_for(opts)[0])
    fields.setdefault("device", "cpu")
    cfg = RunConfig.build(
        backend=name,
        workload=workload,
        spec=spec or PRESETS[workload],
        world_size=gpus,
        backend_options=opts.to_dict(),
        **fields,
    )
    if variant == "default":
        return cfg
    tuned = {k: t.value for k, t in backend.tuned(cfg).items()}
    return cfg.evolve(backend_options={**opts.to_dict(), **tuned}, variant=variant)


def assemble(
    cfg: RunConfig,
    run_id: str,
    ranks: list[dict],
    *,
    compute_time: list[float] | None = None,
    isolated_ranks: list[dict] = (),
    status: str = "ok",
    error: dict | None = None,
    environment: dict,
    sweep: dict | None = None,
) -> dict:
    """The run record the runner would write for these raw ranks. `compute_time`: the compute-only step
    times of every rank, put where the configuration's method puts them (the ranks' sync-off steps for
    no_sync, the isolated workers' records for isolated); or give the isolated workers' records themselves."""
    isolated = list(isolated_ranks)
    if compute_time and cfg.topology.world_size > 1:
        if cfg.measurement.compute_method == "no_sync":
            ranks = [
                {**r, "compute_only_step_times": list(compute_time)} if r.get("status") == "ok" else r
                for r in ranks
            ]
        elif cfg.measurement.compute_method == "isolated":
            isolated = [
                rank_record(0, compute_time, device=environment.get("device_kind") or DEVICE)
                for _ in range(cfg.topology.world_size)
            ]
    return assemble_record(
        get_backend(cfg.backend),
        cfg,
        run_id,
        ranks,
        status=status,
        error=error,
        isolated_ranks=isolated,
        launch={
            "returncodes": [0 if status == "ok" else 1],
            "elapsed_s": 1.0,
            "log_dir": f"logs/{run_id}",
            "nodes": [],
        },
        environment=environment,
        sweep=sweep,
    )


def default_state(label: str, gpus: int, workload: str) -> float:
    if workload != "tiny":
        raise ValueError("give state_total: only the tiny preset's model state is written out here")
    return TINY_MODEL_STATE / gpus if label in FULLY_SHARDED else TINY_MODEL_STATE


def make_record(
    label: str = "torch-ddp",
    gpus: int = 1,
    step_time: float = 0.1,
    compute_time: float | None = None,
    peak_rss: int = 400 << 20,
    state_total: float | None = None,
    allocated: int | None = None,
    status: str = "ok",
    repeat: int = 0,
    sweep_id: str = "sweep-test",
    precision: str = "fp32",
    workload: str = "tiny",
    micro_batch: int = 8,
    scaling: str = "weak",
    run_id: str | None = None,
    start_time: str = START,
    variant: str = "default",
) -> dict:
    """A valid run record whose every rank took `step_time` per step (and `compute_time` per step with sync
    off, or in the isolated counterfactual, whichever the backend uses). `state_total`: the measured model
    state per rank; by default the hand-computed TINY_MODEL_STATE above (/ N where fully sharded), never
    the analytic formula's. A failed run: rank 1 (or 0) raised at step 1, the others were stopped."""
    cfg = config(
        label,
        gpus,
        workload=workload,
        precision=precision,
        micro_batch=micro_batch,
        steps=STEPS,
        warmup=1,
        threads_per_worker=1,
        scaling=scaling,
        variant=variant,
    )
    state_total = default_state(label, gpus, workload) if state_total is None else state_total
    tag = "" if variant == "default" else f"-{variant}"
    run_id = run_id or f"test-{label}{tag}-n{gpus}-r{repeat}-{status}"
    if status == "ok":
        ranks = [
            rank_record(
                r, [step_time] * STEPS, peak_rss=peak_rss, state_total=state_total, allocated=allocated
            )
            for r in range(gpus)
        ]
        error = None
    else:
        culprit = min(1, gpus - 1)
        stopped = "Terminated: stopped by SIGTERM (from its launcher or the harness)"
        ranks = [  # a rank says failed or oom of itself; timeout and crashed are verdicts on the run
            failed_rank(r, status if status == "oom" else "failed")
            if r == culprit
            else failed_rank(r, "failed", stopped, terminated=True, peak_rss=peak_rss)
            for r in range(gpus)
        ]
        error = {"rank": culprit, "message": ranks[culprit]["error"], "log_tail": []}
    env = environment(DEVICE if status == "ok" else None, gpus, start_time=start_time)
    return assemble(
        cfg,
        run_id,
        ranks,
        compute_time=[compute_time] * STEPS if compute_time else None,
        status=status,
        error=error,
        environment=env,
        sweep={"id": sweep_id, "repeat": repeat},
    )


def tokens_per_step(gpus: int, micro_batch: int = 8, workload: str = "tiny") -> int:
    return micro_batch * gpus * PRESETS[workload].seq_len


def call_time(op: str, size: int) -> float:
    """A commbench call's seconds, fixed by hand: 50 us of latency plus the size at 1 GB/s."""
    return 50e-6 + size / 1e9


def commbench_rank(rank: int, spec: CommbenchSpec, *, device: str = DEVICE) -> dict:
    """A raw rank record of a commbench rank that finished, in the shape backends.commbench returns: every
    op at every size, each of its `iters` calls taking call_time."""
    return {
        "rank": rank,
        "host": "testhost",
        "device": device,
        "pid": 1000 + rank,
        "status": "ok",
        "collectives": [
            {"op": op, "bytes": size, "times": [call_time(op, size)] * spec.iters}
            for op in spec.ops
            for size in spec.sizes
        ],
        "versions": VERSIONS,
        "threads": 1,
        "process_settings": None,
    }


def make_commbench_record(
    label: str = "torch-ddp",
    gpus: int = 2,
    *,
    ops: tuple[str, ...] = ("all_reduce", "all_gather"),
    sizes: tuple[int, ...] = (1024, 65536, 1 << 20),
    status: str = "ok",
) -> dict:
    """The record `harness commbench` would write for these calls (a failed one: rank 0 raised)."""
    spec = CommbenchSpec(ops=ops, sizes=sizes, iters=4, warmup=1)
    cfg = config(label, gpus, commbench=spec.to_dict(), threads_per_worker=1)
    run_id = f"test-{label}-commbench-n{gpus}-{status}"
    if status == "ok":
        ranks, error = [commbench_rank(r, spec) for r in range(gpus)], None
    else:
        ranks = [failed_rank(0)] + [commbench_rank(r, spec) for r in range(1, gpus)]
        error = {"rank": 0, "message": ranks[0]["error"], "log_tail": []}
    return assemble_commbench_record(
        get_backend(cfg.backend),
        cfg,
        run_id,
        ranks,
        status=status,
        error=error,
        launch={"returncodes": [0 if status == "ok" else 1], "elapsed_s": 1.0, "log_dir": f"logs/{run_id}"},
        environment=environment(DEVICE, gpus),
    )
