"""`harness predict`: the schedules add up to each stack's analytic volume, the replay and the collective
model give what is worked out by hand, memory follows the ZeRO paper's rules, calibration reproduces the run
it came from, bad input is one line, and predictions are records of their own kind.

Every expected number here is worked out by hand from catalogue constants or a hand-made record, not by
calling the code under test a second time.
"""

from __future__ import annotations

import dataclasses

import pytest
from record_factory import TINY_PARAMS, make_record

from backends import get_backend
from core.config import RunConfig
from harness.analyze.metrics import bus_factor, comm_bytes_per_rank
from harness.cli import main
from harness.predict.hardware import load_profile, local_profile
from harness.predict.model import calibrate, memory, predict_point, replay
from harness.predict.schedule import Message, schedule
from workloads.spec import resolve

unit = pytest.mark.unit
GiB = 2**30


def cfg_for(backend="torch-ddp", world=8, accum=1, workload="tiny", precision="bf16", micro=8, **options):
    spec = resolve(workload)
    return RunConfig(
        backend=backend,
        workload=workload,
        spec=spec,
        world_size=world,
        device="cuda",
        precision=precision,
        micro_batch=micro,
        grad_accum=accum,
        nodes=max(1, world // 8),
        gpus_per_node=min(world, 8),
        backend_options=get_backend(backend).Options.from_dict(options).to_dict(),
    )


STACKS = [
    ("torch-ddp", {}),
    ("torch-fsdp", {}),
    ("torch-fsdp", {"reshard_after_forward": False}),
    ("horovod", {}),
    ("tf-mwms", {}),
    ("paddle-fleet", {}),
    ("paddle-fleet", {"sharding_stage": 1}),
    ("deepspeed", {"zero_stage": 0}),
    ("deepspeed", {"zero_stage": 1}),
    ("deepspeed", {"zero_stage": 2}),
    ("deepspeed", {"zero_stage": 3}),
]


@unit
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize(
    "backend, options, workload",
    [(b, o, "tiny") for b, o in STACKS] + [("deepspeed", {"zero_stage": 3}, "1b"), ("torch-fsdp", {}, "1b")],
)
def test_every_schedule_sends_the_stack_s_analytic_volume(backend, options, workload, accum):
    """The messages a schedule spreads over a step (buckets, fused tensors, per-block gathers) add up to
    the adapter's analytic terms, which the collective trace checked against measured bytes (1b: ZeRO-3
    partitions every block and re-gathers the early blocks for backward)."""
    cfg = cfg_for(backend, world=8, accum=accum, workload=workload, **options)
    messages, _ = schedule(cfg)
    sent = sum(m.size_bytes * bus_factor(m.op, 8) for m in messages)
    terms = [dataclasses.asdict(t) for t in get_backend(backend).comm_pattern(cfg).terms]
    assert sent == pytest.approx(comm_bytes_per_rank(terms, 8), rel=1e-9)


@unit
def test_ddp_buckets_follow_reverse_parameter_order_with_a_small_first_bucket():
    """tiny at fp32: 1,071,872 gradients x 4 B = 4.09 MiB. In reverse order ln_f (256) and block 3
    (198,272) make 794,112 B, under 1 MiB, so block 2's last two tensors (mlp.proj bias 128 and weight
    65,536) join the first bucket, which closes at 1,056,768 B; the other 3,230,720 B stay under 25 MiB:
    one bucket, ready when the embedding's backward (the last segment) ends."""
    messages, _ = schedule(cfg_for("torch-ddp", precision="fp32"))
    first = (256 + 198_272 + 128 + 65_536) * 4
    assert [m.size_bytes for m in messages] == [first, TINY_PARAMS * 4 - first]
    assert messages[1].after > messages[0].after


@unit
def test_replay_overlaps_a_collective_with_compute_and_bills_only_the_wait():
    """Three 1 s segments; a 1.5 s collective ready after the first, needed by the third: it runs from 1
    to 2.5 beside the second segment, so the third starts at 2.5 and the step takes 3.5 s (0.5 s exposed,
    1 s overlapped)."""
    result = replay([1.0, 1.0, 1.0], [Message("all_reduce", 1, 0, 2, "x")], lambda m: 1.5)
    assert result["step_s"] == pytest.approx(3.5)
    assert result["compute_s"] == pytest.approx(3.0)
    assert result["overlapped_s"] == pytest.approx(1.0)
    # A collective nothing waits for still ends the step: ready after the last segment, 0.5 s.
    tail = replay([1.0, 1.0], [Message("all_gather", 1, 1, None, "after")], lambda m: 0.5)
    assert tail["step_s"] == pytest.approx(2.5)


@unit
def test_collective_time_uses_nvlink_in_a_node_and_the_nics_across_nodes():
    """h100-sxm nominal: busbw 430 GB/s in a node, across nodes min(430, 8 NICs x 47 GB/s = 376 GB/s);
    α as NCCL's tuning model: base 8.4 µs + hops (NVLink 3.4 µs, network 14 µs), ring or tree, whichever
    is faster."""
    h100 = load_profile("h100-sxm")
    size = GiB
    # 8 ranks, one node: ring 14 x 3.4 = 47.6 µs = tree 2 x 7 x 3.4.
    expected = 8.4e-6 + 47.6e-6 + size * 2 * 7 / 8 / 430e9
    assert h100.collective_time("all_reduce", size, 8, "nominal") == pytest.approx(expected)
    # 16 ranks, two nodes: ring 28 x 3.4 + 2 x 14 = 123.2 µs; tree 2 x (7 x 3.4 + 1 x 14) = 75.6 µs.
    expected = 8.4e-6 + 75.6e-6 + size * 2 * 15 / 16 / 376e9
    assert h100.collective_time("all_reduce", size, 16, "nominal") == pytest.approx(expected)
    # all_gather is a ring only: 15 steps, one across the node boundary: 14 x 3.4 + 14 = 61.6 µs.
    expected = 8.4e-6 + 61.6e-6 + size * 15 / 16 / 376e9
    assert h100.collective_time("all_gather", size, 16, "nominal") == pytest.approx(expected)


@unit
@pytest.mark.parametrize(
    "backend, options, bytes_per_param",
    [
        ("torch-ddp", {}, lambda n: 16),  # autocast: fp32 params, grads, two moments
        ("deepspeed", {"zero_stage": 1}, lambda n: 4 + 12 / n),  # bf16 params + grads, 12 B sharded
        ("deepspeed", {"zero_stage": 2}, lambda n: 2 + 14 / n),
        ("deepspeed", {"zero_stage": 3}, lambda n: 16 / n),
        ("torch-fsdp", {}, lambda n: 16 / n),
    ],
)
def test_model_state_per_rank_follows_the_zero_paper(backend, options, bytes_per_param):
    """Mixed-precision Adam, Ψ parameters over N = 64 ranks (ZeRO, Rajbhandari et al. 2020, Fig. 1)."""
    cfg = cfg_for(backend, world=64, workload="1b", **options)
    assert memory(cfg, 1.0)["model_state"] == pytest.approx(cfg.spec.n_params * bytes_per_param(64))


@unit
def test_activations_follow_korthikanti_without_stored_attention_scores():
    """1b (24 layers, d_model 2048, vocab 50,304) at bf16, 4 sequences of 2,048: 34 bytes per layer, token
    and d_model unit (Korthikanti et al. 2022, no s² term under SDPA) = 24 x 34 x 8,192 x 2,048 B, plus
    the logits (2 B) with their fp32 softmax and gradient (8 B): 8,192 x 50,304 x 10 B. With full
    checkpointing only each block's input (2 B per element) and one block's activations stay."""
    cfg = cfg_for("torch-ddp", workload="1b", micro=4)
    tokens = 4 * 2048
    logits = tokens * 50_304 * 10
    assert memory(cfg, 1.0)["activations"] == 24 * 34 * tokens * 2048 + logits
    ckpt = dataclasses.replace(cfg, activation_checkpointing=True)
    assert memory(ckpt, 1.0)["activations"] == 24 * 2 * tokens * 2048 + 34 * tokens * 2048 + logits


@unit
def test_a_configuration_that_cannot_fit_says_which_term_dominates(capsys):
    """1b under DDP, micro-batch 64 at seq 2048 on an 80 GB A100: activations alone are 24 layers x 17 x
    131,072 tokens x 2,048 x 2 B = 209 GiB, so it cannot fit and activations dominate; a 20B model under
    DDP with one sequence cannot hold its 16 B per parameter (298 GiB)."""
    args = [
        "predict",
        "--backend",
        "torch-ddp",
        "--workload",
        "1b",
        "--gpus",
        "8",
        "--hardware",
        "a100-80g-sxm",
    ]
    assert main([*args, "--micro-batch", "64"]) == 0
    text = capsys.readouterr().out
    assert "fits no: activations dominates" in text
    big = ["--layers", "48", "--d-model", "5760", "--heads", "48", "--micro-batch", "1"]
    assert main([*args, *big]) == 0
    assert "fits no: model state dominates" in capsys.readouterr().out


def calibration_record(step_s: float, optimizer_s: float, backend="tf-mwms") -> dict:
    record = make_record(backend, gpus=1, step_time=step_s, run_id="calib-1")
    for rank in record["ranks"]:
        rank["optimizer_step_times"] = [optimizer_s] * len(rank["step_times"])
    return record


def commbench_record(backend: str, points: dict[str, tuple[list[int], list[float]]], world=2) -> dict:
    """A commbench record whose every rank timed op's sizes at the given times (5 calls each)."""
    calls = [
        {"op": op, "bytes": size, "times": [t] * 5}
        for op, (sizes, times) in points.items()
        for size, t in zip(sizes, times)
    ]
    return {
        "kind": "commbench",
        "run_id": f"bench-{backend}-{world}",
        "status": "ok",
        "config": {"backend": backend, "device": "cpu", "world_size": world, "commbench": {"dtype": "fp32"}},
        "environment": {"start_time": "2026-01-01T00:00:00+00:00"},
        "ranks": [{"status": "ok", "collectives": calls} for _ in range(world)],
    }


@unit
def test_calibration_reproduces_its_run_and_adds_the_measured_collective():
    """A 1-rank tf-mwms run of 0.1 s per step (0.02 s of it the optimizer) predicts 0.1 s at N = 1; at
    N = 2, TF's one packed all-reduce of 1,071,872 x 4 B (priced at the commbench record's 8 ms for
    exactly that size) follows the whole backward, so the step is 0.108 s and 8 / 108 of it exposed."""
    pack = TINY_PARAMS * 4
    records = [
        calibration_record(0.1, 0.02),
        commbench_record("tf-mwms", {"all_reduce": ([1024, pack], [1e-4, 8e-3])}),
    ]
    profile = local_profile([records[1]], "tf-mwms", cpus=2)
    cfg = dataclasses.replace(
        cfg_for("tf-mwms", world=2, precision="fp32"), device="cpu", nodes=1, gpus_per_node=2
    )
    calib = calibrate([records[0]], cfg, profile)
    assert calib.sources[0]["run_id"] == "calib-1"
    one = dataclasses.replace(cfg, world_size=1, gpus_per_node=1)
    assert predict_point(one, profile, calib, 1e6, None)["corners"]["nominal"][
        "step_time_s"
    ] == pytest.approx(0.1)
    nominal = predict_point(cfg, profile, calib, 1e6, None)["corners"]["nominal"]
    assert nominal["step_time_s"] == pytest.approx(0.108)
    assert nominal["exposed_comm_ratio"] == pytest.approx(0.008 / 0.108)


@unit
def test_a_sharded_optimizer_step_shrinks_with_n():
    """ZeRO-3 steps 1/N of the optimizer: calibrated at 0.02 s of a 0.1 s step at N = 1, the compute at
    N = 4 is 0.08 + 0.02 / 4 = 0.085 s."""
    bench = commbench_record(
        "deepspeed",
        {"all_gather": ([1024, 1 << 24], [1e-4, 1e-2]), "reduce_scatter": ([1024, 1 << 24], [1e-4, 1e-2])},
        4,
    )
    profile = local_profile([bench], "deepspeed", cpus=4)
    cfg = dataclasses.replace(
        cfg_for("deepspeed", world=4, precision="fp32", zero_stage=3), device="cpu", nodes=1, gpus_per_node=4
    )
    calib = calibrate([calibration_record(0.1, 0.02, backend="deepspeed-zero3")], cfg, profile)
    nominal = predict_point(cfg, profile, calib, 1e6, None)["corners"]["nominal"]
    assert nominal["t_compute_s"] == pytest.approx(0.085)
