"""The shared timing loop (backends.loop.run_training), run in-process with a trainer that stands in for a
framework: what enters the measured steps, and what runs after them."""

from __future__ import annotations

import time

import pytest

from backends.loop import Trainer, optimizer_timed_steps, run_training
from core.config import RunConfig
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit


class CountingTrainer(Trainer):
    """A trainer whose step only sleeps, and which counts the device synchronisations inside each step."""

    framework = "counting"

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.inside_step = False
        self.syncs_per_step: list[int] = []

    def step(self, batches, sync_grads: bool = True) -> float:
        self.inside_step, self.syncs_per_step = True, [*self.syncs_per_step, 0]
        time.sleep(0.001)  # forward and backward
        self.timed_optimizer_step(lambda: time.sleep(0.002))
        self.inside_step = False
        return 1.0

    def synchronize(self) -> None:
        if self.inside_step:
            self.syncs_per_step[-1] += 1

    def memory(self) -> dict:
        return {}

    def model_state_bytes(self) -> dict:
        return {"params": 0, "grads": 0, "optimizer": 0}

    def versions(self) -> dict:
        return {}


def config(world_size: int, steps: int = 7, **fields) -> RunConfig:
    return RunConfig(
        backend=fields.pop("backend", "torch-ddp"),
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=world_size,
        device="cpu",
        steps=steps,
        warmup=2,
        trace_comm=False,
        compute_method="none",
        **fields,
    )


@pytest.mark.parametrize("steps", [3, 7])
def test_a_process_without_peers_times_its_optimizer_after_the_measured_steps_never_inside_them(steps):
    """A 1-rank run is the baseline of speedup and scaling efficiency: a synchronisation inside its steps
    (to time the optimizer) would slow it on a GPU alone. The optimizer is timed in steps of its own."""
    cfg = config(world_size=1, steps=steps)
    trainer = CountingTrainer(cfg)
    record = run_training(trainer, cfg)
    measured = cfg.warmup + cfg.steps
    extra = optimizer_timed_steps(cfg)
    assert extra == min(steps, 5)
    assert trainer.syncs_per_step == [0] * measured + [2] * extra
    assert len(record["step_times"]) == cfg.steps
    assert len(record["optimizer_step_times"]) == len(record["optimizer_timed_step_times"]) == extra
    assert all(0.002 <= t < 0.5 for t in record["optimizer_step_times"])


def test_a_rank_with_peers_neither_times_its_optimizer_nor_runs_extra_steps():
    cfg = config(world_size=2)
    trainer = CountingTrainer(cfg)
    record = run_training(trainer, cfg)
    assert trainer.syncs_per_step == [0] * (cfg.warmup + cfg.steps)
    assert record["optimizer_step_times"] == []


@pytest.mark.parametrize(
    "backend,options,timed",
    [("torch-ddp", {}, 0), ("deepspeed", {"zero_stage": 0}, 0), ("deepspeed", {"zero_stage": 2}, 5)],
)
def test_an_isolated_worker_times_its_optimizer_only_where_the_stack_shards_it(backend, options, timed):
    """The isolated counterfactual discounts the optimizer work a rank of a sharded stack does not do;
    a worker of an unsharded stack has nothing to discount and runs no extra steps."""
    cfg = config(world_size=2, backend=backend, backend_options=options, isolated_index=1)
    trainer = CountingTrainer(cfg)
    record = run_training(trainer, cfg)
    assert trainer.syncs_per_step == [0] * (cfg.warmup + cfg.steps) + [2] * timed
    assert len(record["optimizer_step_times"]) == timed


def test_a_stack_whose_worker_cannot_time_its_optimizer_runs_no_optimizer_timed_steps():
    """tf-mwms's update is one traced function with its all-reduce: extra steps would time nothing."""
    cfg = config(world_size=1, backend="tf-mwms")
    trainer = CountingTrainer(cfg)
    record = run_training(trainer, cfg)
    assert optimizer_timed_steps(cfg) == 0 and len(trainer.syncs_per_step) == cfg.warmup + cfg.steps
    assert record["optimizer_timed_step_times"] == []
