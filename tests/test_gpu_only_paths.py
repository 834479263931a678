"""Lines that only a GPU run reaches, executed here against the frameworks' own code where a CPU build has it.

Each test runs the real library code that the GPU path meets (Paddle's group_sharded clear_grad swap,
DeepSpeed's throughput timer) in a subprocess, since the pytest process imports no framework; the device
contract of every launcher is tests/test_device_contract.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, run_record

from backends.deepspeed_zero.ds_config import ds_config
from backends.horovod_torch import local_rank
from core.config import RunConfig
from workloads.spec import PRESETS


def run_python(code: str, *args: str, timeout: int = 180) -> str:
    """`python -c code args` from the repo root; its stdout, or the test fails with what it printed."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


# Paddle's group_sharded_parallel (stages 2 and 3, GPU only) swaps the optimizer's clear_grad for its own
# `_opt_clear(self)`. The swap is done here by Paddle's own methods on a CPU AdamW; the worker's step must
# then clear through it (the sharded buffers) and not fail on an argument it does not take.
PADDLE_SHARDED_STEP = r"""
import sys, types
import numpy as np
import paddle
from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import GroupShardedStage2
from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import GroupShardedStage3
from backends.paddle_fleet.worker import FleetTrainer

class Tiny(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.emb = paddle.nn.Embedding(16, 4)
    def forward(self, x, y):
        return self.emb(x).mean() + 0.0 * y.astype("float32").mean()

stage = int(sys.argv[1])
model = Tiny()
optimizer = paddle.optimizer.AdamW(parameters=model.parameters())
cleared = []
wrapper = types.SimpleNamespace(_clear_gradients=lambda: cleared.append(1))
if stage == 2:
    wrapper._sharding_optimizers = [optimizer]
    GroupShardedStage2._redefine_opt_clear(wrapper)
else:
    wrapper._optim = optimizer
    GroupShardedStage3._redefine_opt_clear(wrapper)
trainer = FleetTrainer.__new__(FleetTrainer)  # the sharded wrapping itself needs a GPU: only its result
trainer.stage, trainer.model, trainer.optimizer, trainer.scaler = stage, model, optimizer, None
trainer.amp_dtype, trainer.can_skip_grad_sync = None, False
batch = (np.zeros((2, 3), np.int64), np.zeros((2, 3), np.int64))
for _ in range(2):
    trainer.step([batch])
print(len(cleared))
"""


@pytest.mark.parametrize("stage", [2, 3])
def test_paddle_sharded_step_clears_gradients_through_group_shardeds_own_clear(stage):
    assert run_python(PADDLE_SHARDED_STEP, str(stage)).split()[-1] == "2"


# DeepSpeed's own config parser and throughput timer, on the configuration a cuda run hands the engine:
# every accelerator synchronize the timer would make inside the timed steps is counted.
DEEPSPEED_TIMER_SYNCS = r"""
import json, sys
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.config import get_timers_config
from deepspeed.utils.timer import ThroughputTimer

syncs = []
accelerator = get_accelerator()
accelerator.synchronize = lambda *a, **k: syncs.append(1)
timer = ThroughputTimer(get_timers_config(json.loads(sys.argv[1])), batch_size=8)
for step in range(5):  # the engine starts it in forward and stops it in step()
    timer.start()
    timer.stop(global_step=True)
print(len(syncs))
"""


def test_deepspeed_engine_makes_no_device_sync_inside_the_timed_step():
    cfg = RunConfig.build(
        "deepspeed", workload="tiny", spec=PRESETS["tiny"], world_size=2, device="cuda", precision="bf16"
    )
    out = run_python(DEEPSPEED_TIMER_SYNCS, json.dumps(ds_config(cfg)), timeout=240)
    assert out.split()[-1] == "0"


@pytest.mark.unit
@pytest.mark.parametrize(
    "environ, expected",
    [
        ({"LOCAL_RANK": "7", "HOROVOD_LOCAL_RANK": "1"}, "1"),  # inherited from a parent launcher
        ({"HOROVOD_LOCAL_RANK": "3"}, "3"),
        ({}, "0"),  # a worker started without horovodrun: the one local process
    ],
)
def test_horovod_worker_takes_its_gpu_from_horovodrun_not_an_inherited_local_rank(environ, expected):
    assert local_rank(environ) == expected


@pytest.mark.slow
def test_horovod_ranks_keep_their_own_local_rank_under_an_inherited_one(out, monkeypatch):
    """The record says which local rank (so which cuda:i) each rank took; the harness runs inside a job
    whose environment already has LOCAL_RANK (a torchrun or Kubernetes parent)."""
    monkeypatch.setenv("LOCAL_RANK", "7")
    rec = run_record(
        out,
        "--backend",
        "horovod",
        "--gpus",
        "2",
        "--workload",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--compute-method",
        "none",
        "--no-trace-comm",
        timeout=240,
    )
    assert [(r["rank"], r["local_rank"]) for r in rec["ranks"]] == [(0, 0), (1, 1)]


DS_ARCH_PROBE = """
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder
builder = FusedAdamBuilder()
builder.jit_mode = True  # as FusedAdam's first use builds it
builder.compute_capability_args()
"""


@pytest.mark.parametrize("archs", ["9.0a;10.0a", "8.0 9.0a+PTX"])
def test_deepspeed_workers_get_an_arch_list_its_jit_builder_reads(monkeypatch, archs):
    """torch takes arch-specific entries ("10.0a") in TORCH_CUDA_ARCH_LIST; DeepSpeed's JIT builder raises
    on them, which killed tuned DeepSpeed (FusedAdam) on a GPU node whose image set one. The adapter hands
    its GPU workers the list without the letter, and DeepSpeed's own builder reads that one."""
    from backends import get_backend

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
    cfg = RunConfig.build("deepspeed", workload="tiny", spec=PRESETS["tiny"], world_size=1, device="cuda")
    given = get_backend("deepspeed").worker_env(cfg)["TORCH_CUDA_ARCH_LIST"]
    assert not any(c.isalpha() for c in given.replace("+PTX", "")), given

    def builder_reads(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "TORCH_CUDA_ARCH_LIST": value, "DS_ACCELERATOR": "cpu"}
        return subprocess.run([sys.executable, "-c", DS_ARCH_PROBE], env=env, capture_output=True, text=True)

    assert builder_reads(archs).returncode != 0  # the user's list, as DeepSpeed's builder fails on it
    assert builder_reads(given).returncode == 0, builder_reads(given).stderr[-500:]
