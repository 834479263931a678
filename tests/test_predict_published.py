"""`harness predict` against published scaling results: per-GPU throughput at a large N over that at 8, each
predicted with a catalogue profile (or a profile of the published cluster) and a shape of the same size,
within 5 points of the published ratio.

Nothing in the model is fitted to any of these rows (no constant is fitted to published data at all), so
every row is predicted leave-one-out by construction. Compute is the assumed MFU at both N, so the ratio
turns on the communication model and the straggler term. Two rows are missed, and marked so (strict
xfail: the day the model gets them right, the marks must go).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.cli import make_parser
from harness.predict.command import configs
from harness.predict.hardware import load_profile
from harness.predict.model import Calibration, predict_point

unit = pytest.mark.unit
DATA = Path(__file__).parent / "data" / "profiles"

# torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, 1D FSDP (bf16 parameters, fp32
# reduce-scatter: torchtitan's defaults), local batch 2, seq 8192, selective activation checkpointing; H100
# with 400 Gb/s per GPU. "| FSDP | 5,762 | 82.4 |" at 8 GPUs, "| FSDP | 5,605 | 67.0 |" at 128. Same size:
# 32 layers of d_model 4096 with a 2-matrix MLP of 21,504 (SwiGLU's 3 x 14,336 parameters), vocab 65,536
# (the spec's uint16 limit; 8.09B parameters against Llama's 8.03B).
LLAMA_8B = ["--layers", "32", "--d-model", "4096", "--heads", "32", "--ffn", "21504", "--vocab", "65536"]
TORCHTITAN = [
    "--backend",
    "torch-fsdp",
    "--fp32-reduce",
    "on",
    *LLAMA_8B,
    "--seq-len",
    "8192",
    "--micro-batch",
    "2",
]
# llm-foundry scripts/train/benchmarking/README.md: MPT-7B (d_model 4096, 32 layers, 32 heads, vocab 50,368,
# MLP 4x), seq 2048, micro-batch 6, no activation checkpointing, FSDP FULL_SHARD, amp_bf16 (fp32 reduce),
# H100 80GB (interconnect not stated: the H100 SXM profile, 8 x NDR400, is an assumption). T/s/GPU: 10,643 at
# 8, 10,475 at 128, 10,119 at 256, 9,670 at 512.
MPT_7B = ["--layers", "32", "--d-model", "4096", "--heads", "32", "--vocab", "50368", "--seq-len", "2048"]
FOUNDRY = ["--backend", "torch-fsdp", "--fp32-reduce", "on", *MPT_7B, "--micro-batch", "6"]
# InternLM doc/en/train_performance.md: InternLM-7B (hidden 4096, 32 layers, 32 heads, SwiGLU of 8/3 x 4096,
# vocab 103,168), seq 2048, micro-batch 2 x 4 micro-steps, bf16, pure data parallel with the optimizer state
# sharded over every rank ("(tp=1, zero1=-1)"), A100-SXM4-80GB, "4 * 100Gb RoCE" between machines. TGS:
# 4,062 at 8, 3,690 at 64, 3,571 at 128, 2,271 at 1,024. As DeepSpeed ZeRO-1 (gradients reduced after
# backward, parameters gathered after the step) with a bf16 model and fp32 master weights, as InternLM keeps
# them (--ds-mixed-precision native), with a 4,096 x 16,384 2-matrix MLP and vocab 65,536.
INTERNLM_7B = ["--layers", "32", "--d-model", "4096", "--heads", "32", "--ffn", "16384", "--vocab", "65536"]
INTERNLM = ["--backend", "deepspeed", "--zero-stage", "1", "--ds-mixed-precision", "native", *INTERNLM_7B]
INTERNLM += ["--seq-len", "2048"]
INTERNLM += ["--micro-batch", "2", "--grad-accum", "4"]
INTERNLM_CLUSTER = str(DATA / "a100-80g-4x100g-roce.yaml")

MISSED_AT_SCALE = pytest.mark.xfail(
    strict=True,
    reason="at 512+ ranks the published runs lose 9-44% that no modelled term (bandwidth, NCCL's latency, "
    "overlap, stragglers) accounts for",
)
ROWS = [  # (name, argv, hardware, N, published per-GPU throughput at 8, at N)
    ("torchtitan llama3.1-8b fsdp", TORCHTITAN, "h100-sxm", 128, 5762, 5605),
    ("llm-foundry mpt-7b fsdp", FOUNDRY, "h100-sxm", 128, 10643, 10475),
    ("llm-foundry mpt-7b fsdp", FOUNDRY, "h100-sxm", 256, 10643, 10119),
    pytest.param("llm-foundry mpt-7b fsdp", FOUNDRY, "h100-sxm", 512, 10643, 9670, marks=MISSED_AT_SCALE),
    ("internlm-7b zero1", INTERNLM, INTERNLM_CLUSTER, 64, 4062, 3690),
    ("internlm-7b zero1", INTERNLM, INTERNLM_CLUSTER, 128, 4062, 3571),
    pytest.param("internlm-7b zero1", INTERNLM, INTERNLM_CLUSTER, 1024, 4062, 2271, marks=MISSED_AT_SCALE),
]


def predicted_per_gpu(argv: list[str], hardware: str, ranks: list[int]) -> list[float]:
    """Nominal per-GPU tokens/s at each N, as `harness predict ARGV --hardware H --gpus ...` prints them."""
    args = make_parser().parse_args(
        ["predict", *argv, "--workload", "1b", "--precision", "bf16", "--hardware", hardware]
        + ["--gpus", ",".join(map(str, ranks))]
    )
    profile = load_profile(hardware)
    return [
        predict_point(cfg, profile, Calibration(), 1e9, None)["corners"]["nominal"]["per_device_tokens_per_s"]
        for cfg in configs(args, profile)
    ]


@unit
@pytest.mark.parametrize("name, argv, hardware, n, at_8, at_n", ROWS)
def test_the_published_scaling_ratio_is_predicted_within_5_points(name, argv, hardware, n, at_8, at_n):
    base, scaled = predicted_per_gpu(argv, hardware, [8, n])
    assert abs(scaled / base - at_n / at_8) <= 0.05, (name, n, scaled / base, at_n / at_8)
