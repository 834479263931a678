"""The analytic communication of each stack (its schedule's terms summed), against volumes worked out by
hand: what each really sends under gradient accumulation, ZeRO-3's persistence and reuse settings, the ZeRO
optimizer's scalars and FSDP2's root."""

import dataclasses

import pytest

from backends import get_backend
from backends.base import parameter_numels
from backends.deepspeed_zero.comm import regathered_for_backward
from core.config import RunConfig
from harness.analyze.metrics import comm_bytes_per_rank
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit

# The tiny preset by hand: tok_emb 2048 x 128 = 262,144; pos_emb 128 x 128 = 16,384; ln_f 2 x 128 = 256
# (the root's: 278,784); four blocks of 198,272 (793,088); 1,071,872 in all. Only tok_emb has more than
# 100,000 elements (the largest block tensors have 65,536).
TINY = 1_071_872
TINY_ROOT = 278_784
TINY_BLOCKS = 793_088
TINY_TOK_EMB = 262_144


def volume(
    backend: str,
    world: int = 2,
    accum: int = 1,
    precision: str = "fp32",
    workload: str = "tiny",
    device: str = "cpu",
    **options,
) -> float:
    cfg = RunConfig.build(
        backend=backend,
        workload=workload,
        spec=PRESETS[workload],
        world_size=world,
        device=device,
        precision=precision,
        grad_accum=accum,
        backend_options=options,
    )
    pattern = dataclasses.asdict(get_backend(backend).comm_pattern(cfg))
    return comm_bytes_per_rank(pattern["terms"], world)


@pytest.mark.parametrize(
    "backend,options",
    [
        ("torch-ddp", {}),
        ("horovod", {}),
        ("tf-mwms", {}),
        ("paddle-fleet", {}),
        ("deepspeed", {"zero_stage": 0}),
    ],
)
def test_data_parallel_all_reduces_fp32_gradients_once_per_step(backend, options):
    once = 2 * 1 / 2 * TINY * 4  # ring all-reduce at N=2
    assert volume(backend, **options) == pytest.approx(once)
    assert volume(backend, accum=4, **options) == pytest.approx(once)  # accumulation adds no traffic


def test_horovod_fp16_compression_halves_the_bytes():
    assert volume("horovod", compression="fp16") == pytest.approx(TINY * 2)


def test_zero1_reduces_at_the_boundary_zero2_every_micro_batch():
    # DeepSpeed 0.19 reduces gradients with an all-reduce (2(N-1)/N = 1 of 4 B x TINY at N=2; the collective
    # trace shows c10d::allreduce_ of every element), then all-gathers the updated parameters ((N-1)/N = 1/2);
    # and once a step all-reduces two fp32 gradient-norm scalars (8 B at N=2)
    norms = 2 * 4
    assert volume("deepspeed", accum=3, zero_stage=1) == TINY * 4 * (1 + 0.5) + norms
    assert volume("deepspeed", accum=3, zero_stage=2) == TINY * 4 * (3 + 0.5) + norms
    # bf16 under torch_autocast (the default) keeps fp32 parameters and gradients: the same bytes as fp32;
    # a native bf16 module halves them, and adds a 1-byte overflow flag
    assert volume("deepspeed", accum=3, zero_stage=2, precision="bf16") == TINY * 4 * (3 + 0.5) + norms
    assert (
        volume("deepspeed", accum=3, zero_stage=2, precision="bf16", mixed_precision="native")
        == TINY * 2 * (3 + 0.5) + norms + 1
    )


def test_zero3_gathers_partitioned_tensors_per_micro_batch_and_persistent_ones_per_step():
    # tok_emb is the only tensor over the persistence threshold: one gather of it per micro-batch (reused in
    # backward); the persistent rest is gathered once after each optimizer step (its update is partitioned);
    # a reduce-scatter of every gradient per micro-batch; two fp64 gradient-norm scalars all-reduced a step
    assert (
        volume("deepspeed", accum=2, zero_stage=3)
        == 0.5 * 4 * (2 * TINY_TOK_EMB + (TINY - TINY_TOK_EMB) + 2 * TINY) + 2 * 8
    )


def test_zero3_regathers_blocks_whose_reuse_distance_is_too_long():
    # 1b: 24 blocks of 50,331,648 partitioned elements; block i is fetched again for backward when the later
    # blocks, fetched twice in between, reach 1e9: 2 x (23 - i) x 50,331,648 >= 1e9 for i <= 13 (14 blocks)
    cfg = RunConfig.build(backend="deepspeed", workload="1b", spec=PRESETS["1b"], world_size=8, device="cpu")
    assert regathered_for_backward(parameter_numels(cfg)) == 14 * 50_331_648


def test_paddle_stage_1_on_cpu_also_gathers_each_reduced_chunk_to_its_owner():
    """Each gradient reduced to its owner and each updated tensor broadcast back: a reduce-scatter's and an
    all-gather's bytes, 2(N-1)/N x 4 x TINY; on CPU gloo's reduce also gathers each rank's reduced chunk to
    the owner, (N-1)/N x 4 x TINY/N more on average: 1 + 1/(2N) times in all."""
    for world in (2, 4):
        ring = 2 * (world - 1) / world * 4 * TINY
        assert volume("paddle-fleet", world=world, sharding_stage=1) == pytest.approx(
            ring * (1 + 1 / (2 * world)), abs=4
        )
    nccl = volume("paddle-fleet", world=4, device="cuda", sharding_stage=1)
    assert nccl == pytest.approx(2 * 3 / 4 * 4 * TINY)  # NCCL's reduce sends no more than a reduce-scatter


def test_fsdp2_gathers_root_once_blocks_twice_per_micro_batch_and_reduces_once():
    per_micro = TINY_ROOT + 2 * TINY_BLOCKS  # root kept gathered for backward; blocks resharded after forward
    assert volume("torch-fsdp", accum=2) == pytest.approx(0.5 * 4 * (2 * per_micro + TINY))
    kept = TINY_ROOT + TINY_BLOCKS  # --reshard-after-forward off: one gather of everything per micro-batch
    assert volume("torch-fsdp", accum=2, reshard_after_forward=False) == pytest.approx(
        0.5 * 4 * (2 * kept + TINY)
    )
    # bf16 gathers with an fp32 reduce-scatter (the default), or a bf16 one (--fp32-reduce off)
    assert volume("torch-fsdp", precision="bf16") == pytest.approx(
        0.5 * (2 * (TINY_ROOT + 2 * TINY_BLOCKS) + 4 * TINY)
    )
    assert volume("torch-fsdp", precision="bf16", fp32_reduce=False) == pytest.approx(
        0.5 * 2 * (TINY_ROOT + 2 * TINY_BLOCKS + TINY)
    )


def test_tiny_preset_counts_by_hand():
    numels = parameter_numels(
        RunConfig.build(backend="x", workload="tiny", spec=PRESETS["tiny"], world_size=1, device="cpu")
    )
    assert sum(numels.values()) == TINY
    assert sum(n for k, n in numels.items() if not k.startswith("blocks.")) == TINY_ROOT
    assert [k for k, n in numels.items() if n > 100_000] == ["tok_emb"]
