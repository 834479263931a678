"""The GPU acceptance tier: does every installed stack work on this node's GPUs, in every precision, at one
GPU and at all of them? `pytest -m gpu` on a GPU node answers it in one pass (docs/gpus.md says how to run
and read it); on a machine without a GPU every GPU check skips with its reason.

The stacks come from the registry and the precisions from core.config, so a stack added to the registry is
checked here with no edit. Every run is a real `harness run` on the node's GPUs, judged by the product's own
code: the record's schema (core.records.validate_record), its derived figures (harness.analyze.metrics)
and the precision definition (core.precision.definition). The tiny runs are launched together, several on
the GPUs at once (they are start-up bound, and none of their checks is a timing); the 1b runs, whose MFU is
a measurement, one at a time after them.

Where a check means something on a CPU (a sound run, its numerics, the peak reset after warm-up, the traced
bytes against the analytic volume, sharded state against replicated), the same tests run in the normal suite
as the tier's CPU rehearsal, on 2-rank fp32 runs the suite launches anyway: torch-ddp's reference and the
full-record runs of the stacks that shard parameters (tests/test_torch_family.py), which take the same
transient before their first step.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import CPU_WARMUP_TRANSIENT_BYTES

from backends import REFERENCE_BACKEND, backend_names, get_backend
from core.config import PRECISIONS, RunConfig
from core.precision import definition
from core.records import load_record, run_config, validate_record
from harness.analyze.metrics import summarize
from harness.run.devices import query_gpus, visible_gpus
from workloads.spec import PRESETS

REPO = Path(__file__).resolve().parent.parent
GPUS = visible_gpus()
NO_GPU = "needs a CUDA GPU: nvidia-smi lists none on this machine"
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1200)]

# The 1b bf16 MFU a sound run lands in, as a fraction of the device's dense bf16 peak
# (harness.analyze.metrics.PEAK_FLOPS). The band checks the counting, not a stack's speed. Above 0.75 the
# FLOPs or the peak are counted wrong: a whole training step (attention, LayerNorm, the optimizer, activation
# checkpointing's recomputed forward, which model FLOPs do not count) cannot beat a plain large bf16 matmul,
# which reaches about 0.8 of the datasheet peak on Hopper. Below 0.08 its matmuls may not have run in bf16:
# IEEE fp32 peaks at 0.068 of the bf16 peak on Hopper (67 of 989 TFLOP/s). A stack may land well below
# eager DDP's 0.3-0.5 and still pass: ZeRO-3's per-module gathers dominate a micro-batch of 2 on one GPU.
MFU_BAND = (0.08, 0.75)
# Taken and freed by every rank before its first warm-up step (core.hooks): far above a tiny run's whole
# steady-state peak, so a peak that still holds it was not reset. On a GPU that peak includes the stack's
# communication buffers: DeepSpeed's fp32 reduce bucket of 5e8 elements alone is 1.9 GiB, so 4 GiB there;
# on a CPU the process RSS (conftest.CPU_WARMUP_TRANSIENT_BYTES, which the rehearsal's runs take).
TRANSIENT_BYTES = 4 << 30 if GPUS else CPU_WARMUP_TRANSIENT_BYTES
SHAPE = "--workload tiny --steps 10 --warmup 3 --threads-per-worker 2".split()
# Each stack at the micro-batch that fills the device (--micro-batch max, harness/run/fill.py), default and
# tuned: a stack measured at a micro-batch that leaves the GPU idle is measured unfairly.
MFU_ARGS = "--workload 1b --precision bf16 --micro-batch max --steps 5 --warmup 2".split()
MFU_VARIANTS = {"default": [], "tuned": ["--tuned"]}
WORLDS = sorted({1, len(GPUS)}) if GPUS else [2]


def default_config(name: str) -> RunConfig:
    """A stack's default configuration at 2 ranks, as its adapter reads it for sharding and labels."""
    return RunConfig.build(name, workload="tiny", spec=PRESETS["tiny"], world_size=2, device="cpu")


def sharded(name: str) -> bool:
    """Whether a stack's default configuration shards its parameters (FSDP2, ZeRO-3): the adapter says."""
    return get_backend(name).sharding(default_config(name)) == "parameters"


def stacks() -> list[str]:
    """The stacks this tier runs: every registered one on a GPU; on the CPU rehearsal the reference and
    the stacks that shard parameters."""
    if GPUS:
        return backend_names()
    return [n for n in backend_names() if n == REFERENCE_BACKEND or sharded(n)]


def harness_run(key: str, out: Path, argv: list[str], timeout: float = 600) -> tuple[dict | None, str]:
    """`harness run ARGV` as run id `key`: its record (None if it wrote none) and its last output lines."""
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "run", *argv, "--out", str(out), "--run-id", key, "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    path = out / f"{key}.json"
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return (load_record(path) if path.exists() else None), f"exit {proc.returncode}: {tail}"


def records_folder(name: str) -> Path:
    """Where the tier's records go: $DISTBENCH_GPU_TIER_OUT/NAME, to keep them (`harness report` reads
    them), else a temporary folder."""
    keep = os.environ.get("DISTBENCH_GPU_TIER_OUT")
    if not keep:
        return Path(tempfile.mkdtemp(prefix=f"distbench-gpu-tier-{name}-"))
    (Path(keep) / name).mkdir(parents=True, exist_ok=True)
    return Path(keep) / name


def launch(plan: dict[str, list[str]], jobs: int) -> dict[str, tuple[dict | None, str]]:
    out = records_folder("tiny")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = {key: pool.submit(harness_run, key, out, argv) for key, argv in plan.items()}
        return {key: future.result() for key, future in done.items()}


def key(stack: str, precision: str, world: int, variant: str = "") -> str:
    """The run's id (letters, digits, '-', '.', '_', as `harness run --run-id` takes them) and test id."""
    return f"{stack}-{precision}-n{world}" + (f"-{variant}" if variant else "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict | None, str]]:
    """Every tiny run of the tier, launched together: per stack, each precision at each world size, fp32
    with --tf32, and bf16 --tuned. On a CPU: the rehearsal's runs (cpu_rehearsal_runs)."""
    if not GPUS:
        return cpu_rehearsal_runs(tmp_path_factory)
    plan: dict[str, list[str]] = {}
    hook = ["--warmup-transient", str(TRANSIENT_BYTES)]
    for stack in [s for s in stacks() if get_backend(s).availability()[0]]:
        base = ["--backend", stack, "--device", "cuda", *SHAPE]
        for world in WORLDS:
            for precision in PRECISIONS:
                argv = [*base, "--gpus", str(world), "--precision", precision, *hook]
                plan[key(stack, precision, world)] = argv
        plan[key(stack, "fp32", 1, "tf32")] = [*base, "--gpus", "1", "--precision", "fp32", "--tf32"]
        plan[key(stack, "bf16", 1, "tuned")] = [*base, "--gpus", "1", "--precision", "bf16", "--tuned"]
    return launch(plan, jobs=gpu_jobs())


def cpu_rehearsal_runs(tmp_path_factory) -> dict[str, tuple[dict | None, str]]:
    """The 2-rank fp32 runs the suite launches anyway, once per test run whichever module asks first:
    torch-ddp's ISSUE_SHAPE reference and the full-record run of each stack's default configuration,
    which tests/test_torch_family.py names by the adapter's label (FSDP2, ZeRO-3)."""
    from test_equivalence import ISSUE_SHAPE, ddp_reference
    from test_torch_family import FAMILY, full_record

    runs = {key(REFERENCE_BACKEND, "fp32", 2): (ddp_reference(ISSUE_SHAPE, tmp_path_factory), "")}
    for stack in [s for s in stacks() if s != REFERENCE_BACKEND and get_backend(s).availability()[0]]:
        label = get_backend(stack).label(default_config(stack))
        assert label in FAMILY, f"{stack}'s default ({label}) has no full-record run to rehearse on"
        runs[key(stack, "fp32", 2)] = (full_record(label, tmp_path_factory), "")
    return runs


def gpu_jobs() -> int:
    """Runs at once on the GPUs: 2 CPU threads each, and room on the smallest GPU for every run's
    transient and tiny steady state (8 GiB a run)."""
    memory_gib = min(int(g["memory.total"].split()[0]) for g in query_gpus(("memory.total",))) // 1024
    return max(1, min(8, (os.cpu_count() or 2) // 2, memory_gib // 8))


def available(stack: str) -> None:
    ok, why = get_backend(stack).availability()
    if not ok:
        pytest.skip(f"{stack}: {why}")


def record_of(runs, name: str) -> dict:
    """The record of run `name`, judged sound: schema-valid, status ok on the device asked for, losses
    finite and falling (mean of the last third below the first third's, so one noisy batch cannot fake a
    fall), throughput above zero. Fails with the run's last output lines."""
    record, tail = runs[name]
    assert record is not None, f"{name} wrote no record; {tail}"
    validate_record(record)
    assert record["status"] == "ok", f"{name}: status {record['status']}: {record.get('error')}; {tail}"
    for rank in record["ranks"]:
        assert rank["status"] == "ok", (name, rank["rank"], rank.get("error"))
        assert rank["device"] in (GPUS if GPUS else [rank["device"]]), (name, rank["device"], GPUS)
        assert rank["device"].startswith("cpu") != bool(GPUS), (name, rank["device"])
        losses = [*rank.get("warmup_losses", []), *rank["losses"]]
        assert all(math.isfinite(x) for x in losses), (name, rank["rank"], losses)
        third = max(1, len(losses) // 3)
        assert statistics.fmean(losses[-third:]) < statistics.fmean(losses[:third]), (name, losses)
    assert summarize(record)["throughput_tokens_per_s"] > 0
    return record


def precision_world_cases() -> list:
    return [
        pytest.param(stack, precision, world, id=key(stack, precision, world))
        for stack in stacks()
        for world in WORLDS
        for precision in PRECISIONS
    ]


def skip_unless_run(runs, name: str) -> None:
    if name not in runs:
        pytest.skip(NO_GPU if not GPUS else f"{name} is not in this node's plan")


@pytest.mark.parametrize("stack,precision,world", precision_world_cases())
def test_each_stack_trains_in_each_precision_with_the_defined_numerics(runs, stack, precision, world):
    """A sound run whose recorded numerics are the definition (core.precision; docs/gpus.md), with no
    deviation, TF32 off (fp32 is IEEE unless --tf32) and MFU, where known, against that precision's peak."""
    available(stack)
    skip_unless_run(runs, key(stack, precision, world))
    record = record_of(runs, key(stack, precision, world))
    summary, cfg = summarize(record), run_config(record)
    numerics = summary["numerics"]
    assert numerics["deviations"] == [], numerics
    assert {k: numerics[k] for k in definition(cfg)} == definition(cfg)
    assert summary["tf32"] is (False if GPUS else None), summary["tf32"]
    if summary["mfu"] is not None:
        assert summary["device_peak_precision"] == precision


@pytest.mark.parametrize("stack,precision,world", precision_world_cases())
def test_the_peak_memory_is_reset_after_warm_up(runs, stack, precision, world):
    """Each rank held TRANSIENT_BYTES before its first warm-up step where its peaks are read (the
    allocator on a GPU, the RSS on a CPU), so its lifetime peak holds them; the recorded peak, reset after
    warm-up, must not, and must still hold the model state the rank counted."""
    available(stack)
    skip_unless_run(runs, key(stack, precision, world))
    for rank in record_of(runs, key(stack, precision, world))["ranks"]:
        memory, state = rank["memory"], rank["model_state_bytes"]["total"]
        if memory.get("warmup_transient") != ("device" if GPUS else "host"):
            pytest.skip(f"{stack}'s trainer holds no transient where its peak is read ({memory})")
        peak = memory["allocated_peak"] if GPUS else memory["peak_rss"]
        assert memory["peak_rss_scope"] == "after warm-up"
        assert state <= peak < TRANSIENT_BYTES, (rank["rank"], peak, state)


@pytest.mark.parametrize("stack,precision,world", precision_world_cases())
def test_a_traced_step_counts_the_analytic_collective_bytes(runs, stack, precision, world):
    """At two ranks or more the traced steps' collectives carry, per op, the bytes the stack's schedule
    declares (harness.analyze.metrics.measured_comm), none of them zero; one GPU is checked by the
    traced NCCL all_reduce of `harness doctor --gpu` (test_doctor_gpu_passes_on_this_node)."""
    available(stack)
    if world < 2:
        pytest.skip("one rank traces no collective: see test_doctor_gpu_passes_on_this_node")
    skip_unless_run(runs, key(stack, precision, world))
    measured = summarize(record_of(runs, key(stack, precision, world)))["comm_measured"]
    assert measured and measured.get("ops"), measured
    for op, figures in measured["ops"].items():
        assert figures["size_bytes_per_step"] > 0, (op, figures)
        assert figures["size_bytes_per_step"] == pytest.approx(
            figures["analytic_size_bytes_per_step"], rel=0.01
        )
    assert measured["vs_analytic"] == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1] or [2])
def test_sharded_stacks_hold_less_model_state_than_the_replicated_reference(runs, world, precision):
    """FSDP2 and ZeRO-3 (whichever stacks the registry says shard parameters) hold less parameter,
    gradient and optimizer state per rank than the reference stack's replicas, in the same run shape."""
    skip_unless_run(runs, key(REFERENCE_BACKEND, precision, world))
    reference = record_of(runs, key(REFERENCE_BACKEND, precision, world))
    replicated = summarize(reference)["model_state_bytes_per_rank"]
    checked = []
    for stack in [s for s in stacks() if s != REFERENCE_BACKEND and key(s, precision, world) in runs]:
        record = record_of(runs, key(stack, precision, world))
        if record["backend_info"].get("sharding") == "parameters":
            assert summarize(record)["model_state_bytes_per_rank"] < replicated, stack
            checked.append(stack)
    if not checked:
        pytest.skip("no stack that shards parameters is installed")


@pytest.mark.parametrize("stack", backend_names())
def test_tf32_is_on_only_where_asked(runs, stack):
    """--tf32 turns TF32 on for an fp32 run: every rank says so and MFU is taken at the TF32 peak."""
    available(stack)
    skip_unless_run(runs, key(stack, "fp32", 1, "tf32"))
    record = record_of(runs, key(stack, "fp32", 1, "tf32"))
    summary = summarize(record)
    assert summary["tf32"] is True and summary["numerics"]["tf32"] is True
    assert summary["device_peak_precision"] in (None, "tf32")


@pytest.mark.parametrize("stack", backend_names())
def test_the_tuned_variant_runs(runs, stack):
    """--tuned in bf16: a sound run that records its tuned set as applied and its first (compiling) step."""
    available(stack)
    skip_unless_run(runs, key(stack, "bf16", 1, "tuned"))
    record = record_of(runs, key(stack, "bf16", 1, "tuned"))
    info = record["backend_info"]
    assert info["variant"] == "tuned" and info["tuned"], info.get("tuned")
    assert all(t["value"] == t["tuned_value"] for t in info["tuned"].values()), info["tuned"]
    assert summarize(record)["first_step_s"] is not None


@pytest.fixture(scope="module")
def mfu_runs() -> dict[str, tuple[dict | None, str]]:
    """The 1b bf16 runs, default and tuned, one at a time: their throughput is the measurement."""
    if not GPUS:
        pytest.skip(NO_GPU)
    out = records_folder("1b")
    plan = {
        f"{s}-{variant}": ["--backend", s, "--gpus", "1", *MFU_ARGS, *extra]
        for s in stacks()
        if get_backend(s).availability()[0]
        for variant, extra in MFU_VARIANTS.items()
    }
    return {k: harness_run(f"{k}-1b", out, argv, timeout=900) for k, argv in plan.items()}


@pytest.mark.parametrize("variant", MFU_VARIANTS)
@pytest.mark.parametrize("stack", backend_names())
def test_1b_bf16_mfu_is_inside_the_band_at_the_micro_batch_that_fills_the_gpu(mfu_runs, stack, variant):
    """MFU inside the counting band, the micro-batch chosen by --micro-batch max and recorded, and the
    step's anatomy printed beside it (`pytest -m gpu -s` shows where each stack's time goes)."""
    from harness.analyze.anatomy import anatomy_text

    available(stack)
    record = record_of(mfu_runs, f"{stack}-{variant}")
    summary = summarize(record)
    choice = record["micro_batch_choice"]
    print(
        f"\n{stack} {variant}: micro-batch {choice['chosen']} (predicted {choice['predicted']}), "
        f"MFU {summary['mfu']:.1%}, step {summary['step_time_s']['median'] * 1e3:.1f} ms; "
        f"{anatomy_text(summary['anatomy'])}"
    )
    assert choice["chosen"] == run_config(record).batch.micro_batch >= 1
    assert summary["device_peak_precision"] == "bf16", summary["device_peak_precision"]
    lo, hi = MFU_BAND
    assert lo <= summary["mfu"] <= hi, f"{stack} 1b bf16 MFU {summary['mfu']:.1%} outside {lo:.0%}-{hi:.0%}"
    parts = summary["anatomy"]["parts"]
    assert all(parts[p]["status"] == "measured" for p in ("forward", "backward", "optimizer")), parts


def test_doctor_gpu_passes_on_this_node():
    """`harness doctor --gpu`: driver, CUDA runtime and NCCL versions agree, and a traced NCCL all_reduce
    over every local GPU (one included) sums right and is read with its bytes."""
    if not GPUS:
        pytest.skip(NO_GPU)
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "doctor", "--gpu", "--backends", REFERENCE_BACKEND],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cuda versions" in proc.stdout and f"collective (nccl, {len(GPUS)} rank" in proc.stdout
