"""The shared timing loop (backends.loop.run_training), run in-process with a trainer that stands in for a
framework: what enters the measured steps, what runs after them, and the event stream the harness reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from backends import backend_names, get_backend
from backends.loop import TRACE_LOST, Trainer, anatomy_steps, run_to_record, run_training
from core.config import RunConfig
from core.events import MEASURED, RESULT, EventLog, rank_record, read_events
from core.hooks import TestHooks
from core.process import TRACE_SETTINGS
from harness.run.runner import measuring_config
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit


class CountingTrainer(Trainer):
    """A trainer whose step only sleeps, and which counts the device synchronisations inside each step."""

    framework = "counting"

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.inside_step = False
        self.syncs_per_step: list[int] = []
        self.watched: Path | None = None  # an events file whose size each step boundary notes
        self.sizes_at_boundaries: list[int] = []

    def step(self, batches, sync_grads: bool = True) -> float:
        self.inside_step, self.syncs_per_step = True, [*self.syncs_per_step, 0]
        for _ in batches:
            self.timed_part("forward", lambda: time.sleep(0.001))
            self.timed_part("backward", lambda: time.sleep(0.002))
        self.timed_optimizer_step(lambda: time.sleep(0.003))
        self.inside_step = False
        return 1.0

    def synchronize(self) -> None:
        if self.inside_step:
            self.syncs_per_step[-1] += 1
        elif self.watched is not None:
            self.sizes_at_boundaries.append(self.watched.stat().st_size)

    def memory(self) -> dict:
        return {}

    def model_state_bytes(self) -> dict:
        return {"params": 0, "grads": 0, "optimizer": 0}

    def versions(self) -> dict:
        return {}


class TracingTrainer(CountingTrainer):
    """Stands in for a stack with a collective trace: runs the traced steps it is handed."""

    can_skip_grad_sync = True

    def trace_collectives(self, run_steps) -> dict:
        return {"method": "counting", "step_times": run_steps(), "collectives": []}


def train(trainer: Trainer, cfg: RunConfig, tmp_path, hooks: TestHooks | None = None) -> tuple[dict, list]:
    """run_training as a worker runs it, into an event stream ended with its result: the rank record the
    harness folds from that stream, and the events."""
    path = tmp_path / "rank0.events.jsonl"
    record = run_to_record(trainer, cfg, path, hooks or TestHooks())
    return record, read_events(path)


def config(world_size: int, steps: int = 7, **fields) -> RunConfig:
    return RunConfig.build(
        backend=fields.pop("backend", "torch-ddp"),
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=world_size,
        device="cpu",
        steps=steps,
        **{"warmup": 2, "trace_comm": False, "compute_method": "none", **fields},
    )


@pytest.mark.parametrize("steps,parts", [(3, 3), (7, 0)])
def test_a_process_without_peers_times_its_parts_after_the_measured_steps_never_inside_them(
    steps, parts, tmp_path
):
    """A 1-rank run is the baseline of speedup and scaling efficiency: a synchronisation inside its steps
    (to time a part) would slow it on a GPU alone. Its parts are timed in steps of their own, each part
    between two synchronisations, a part run per micro-batch summed over the step."""
    cfg = config(world_size=1, steps=steps, anatomy_steps=parts, grad_accum=2)
    trainer = CountingTrainer(cfg)
    record, _ = train(trainer, cfg, tmp_path)
    measured = cfg.measurement.warmup + cfg.measurement.steps
    assert anatomy_steps(cfg, can_skip_grad_sync=False) == parts
    assert trainer.syncs_per_step == [0] * measured + [2 * (2 + 2 + 1)] * parts
    assert len(record["step_times"]) == cfg.measurement.steps
    for key, low in (("forward_times", 0.002), ("backward_times", 0.004), ("optimizer_step_times", 0.003)):
        assert len(record[key]) == parts and all(low <= t < low + 0.5 for t in record[key]), key
    assert len(record["anatomy_step_times"]) == parts
    assert record["anatomy_methods"]["sync"].startswith("alone")


def test_a_rank_with_peers_and_no_sync_switch_times_no_parts_its_isolated_workers_do(tmp_path):
    """Its parts with the gradient sync on would hold the communication the anatomy puts apart."""
    cfg = config(world_size=2, compute_method="isolated")
    trainer = CountingTrainer(cfg)
    record, _ = train(trainer, cfg, tmp_path)
    assert trainer.syncs_per_step == [0] * (cfg.measurement.warmup + cfg.measurement.steps)
    assert record["optimizer_step_times"] == record["forward_times"] == []


def test_ranks_with_a_sync_switch_time_their_parts_with_the_sync_off(tmp_path):
    cfg = config(world_size=2, compute_method="no_sync", compute_steps=2)
    record, events = train(TracingTrainer(cfg), cfg, tmp_path)
    anatomy = [e for e in events if e["event"] == "phase_start" and e["phase"] == "anatomy"]
    assert anatomy[0]["steps"] == 3 and not anatomy[0]["sync_grads"] and anatomy[0]["time_parts"]
    assert len(record["forward_times"]) == 3
    assert record["anatomy_methods"]["sync"].startswith("gradient sync off")


@pytest.mark.parametrize(
    "backend,options,timed",
    [("torch-ddp", {}, 3), ("deepspeed", {"zero_stage": 0}, 3), ("deepspeed", {"zero_stage": 2}, 5)],
)
def test_an_isolated_worker_times_its_parts_and_where_the_stack_shards_its_optimizer_at_least_five(
    backend, options, timed, tmp_path
):
    """The isolated counterfactual discounts the optimizer work a rank of a sharded stack does not do,
    from at least min(steps, 5) timed steps; every isolated worker times the parts of the anatomy."""
    cfg = config(world_size=2, backend=backend, backend_options=options, isolated_index=1)
    trainer = CountingTrainer(cfg)
    record, _ = train(trainer, cfg, tmp_path)
    assert trainer.syncs_per_step == [0] * (cfg.measurement.warmup + cfg.measurement.steps) + [6] * timed
    assert len(record["optimizer_step_times"]) == timed


def test_the_loop_runs_its_phases_in_order_and_the_stream_gives_the_rank_record(tmp_path):
    """A 2-rank sync-off run with a trace: every phase announced in order (those that do not apply with 0
    steps), step indices running on over the whole run, each phase's settle steps run but not kept (the
    sync switch's first step; the re-aligning step before the trace), the record of everything measured
    on file before the first traced step with its trace lost, and again after it with its trace."""
    cfg = config(
        world_size=2, steps=4, compute_method="no_sync", compute_steps=3, trace_comm=True, anatomy_steps=0
    )
    record, events = train(TracingTrainer(cfg), cfg, tmp_path)
    starts = [(e["phase"], e["steps"], e["settle"]) for e in events if e["event"] == "phase_start"]
    assert starts == [
        ("warm-up", 2, 0),
        ("measured", 4, 0),
        ("compute-only", 4, 1),
        ("anatomy", 0, 0),
        ("traced", 3, 1),
    ]
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(2 + 4 + 4 + 3))
    assert [(e["phase"], e["kept"]) for e in steps if not e["kept"]] == [
        ("compute-only", False),
        ("traced", False),
    ]
    assert len(record["step_times"]) == len(record["losses"]) == len(record["data_prep"]) == 4
    assert len(record["step_cpu_times"]) == 4 and all(c >= 0 for c in record["step_cpu_times"])
    assert len(record["warmup_losses"]) == 2 and len(record["compute_only_step_times"]) == 3
    assert record["anatomy_step_times"] == record["optimizer_step_times"] == []
    assert record["step_times"] == [e["step_time_s"] for e in steps if e["phase"] == "measured"]
    assert len(record["comm_trace"]["step_times"]) == 2 and record["status"] == "ok"
    names = [e["event"] for e in events]
    first_traced = next(i for i, e in enumerate(events) if e["event"] == "step" and e["phase"] == "traced")
    before = names.index(MEASURED)
    assert before < first_traced and events[before]["record"]["comm_trace"]["reason"] == TRACE_LOST
    assert names[-3:] == [MEASURED, "phase_end", RESULT] and events[-3]["record"]["comm_trace"]["method"]
    assert "data_wait" not in record
    assert rank_record(events, MEASURED)["comm_trace"]["method"] == "counting"


def test_a_stack_that_traces_in_a_launch_of_its_own_measures_untraced_and_traces_unmeasured(tmp_path):
    """Backend.traces_in_own_launch: the launch that measures has no traced phase, and the launch that
    traces runs the warm-up and the traced steps only, its trace saying where it was taken; from each
    stack's registry entry, every worker's environment keeps the trace settings (core.process) out of
    every launch but the one that traces."""
    base = dict(world_size=2, steps=4, compute_method="no_sync", compute_steps=3, trace_comm=True)
    inline, _ = train(TracingTrainer(config(**base)), config(**base), tmp_path)
    assert inline["comm_trace"]["launch"] == "inline"
    cfg = config(**base, trace_launch="untraced")
    (tmp_path / "m").mkdir(), (tmp_path / "t").mkdir()
    record, events = train(TracingTrainer(cfg), cfg, tmp_path / "m")
    assert [e["phase"] for e in events if e["event"] == "phase_start" and e["steps"]] == [
        "warm-up", "measured", "compute-only", "anatomy",
    ]  # fmt: skip
    assert record["comm_trace"] is None and len(record["step_times"]) == 4
    cfg = config(**base, trace_launch="only")
    record, events = train(TracingTrainer(cfg), cfg, tmp_path / "t")
    assert [e["phase"] for e in events if e["event"] == "phase_start"] == ["warm-up", "traced"]
    assert not record.get("step_times") and record["comm_trace"]["launch"] == "own"
    for name in backend_names():
        backend = get_backend(name)
        traced = config(**base, backend=name)
        measured = measuring_config(backend, traced)
        assert (measured.role.trace_launch == "untraced") == backend.traces_in_own_launch, name
        assert not set(TRACE_SETTINGS) & set(backend.worker_env(measured)), name
        if backend.traces_in_own_launch:
            assert set(TRACE_SETTINGS) & set(backend.worker_env(traced.evolve(trace_launch="only"))), name


def test_nothing_is_written_to_the_stream_inside_a_timed_step(tmp_path):
    """The stream's size at the device synchronisation that starts a step's clock is its size at the one
    that stops it; each step's event lands between steps."""
    cfg = config(world_size=1, steps=3)
    trainer = CountingTrainer(cfg)
    trainer.watched = tmp_path / "rank0.events.jsonl"
    trainer.watched.touch()
    train(trainer, cfg, tmp_path)
    sizes = trainer.sizes_at_boundaries
    pairs = list(zip(sizes[::2], sizes[1::2]))
    assert len(pairs) == cfg.measurement.warmup + cfg.measurement.steps + anatomy_steps(cfg, False)
    assert all(start == stop for start, stop in pairs), pairs
    assert all(stop < start for (_, stop), (start, _) in zip(pairs, pairs[1:]))  # one event between steps


def test_test_hooks_slow_every_step_and_fail_the_chosen_one(tmp_path):
    """--step-delay's sleep is inside the timed step (a slowdown the gate must see); --inject-fault raises
    at its step, after the steps before it have their events."""
    cfg = config(world_size=2, steps=3)
    record, _ = train(CountingTrainer(cfg), cfg, tmp_path, TestHooks(step_delay_s=0.02))
    assert min(record["step_times"]) >= 0.02
    log = EventLog(tmp_path / "faulted.events.jsonl", 1)
    hooks = TestHooks(fault={"rank": 0, "step": 3, "kind": "raise"})
    with pytest.raises(RuntimeError, match="injected fault at step 3"):
        run_training(CountingTrainer(cfg), cfg, log, hooks)
    steps = [e["step"] for e in read_events(log.path) if e["event"] == "step"]
    assert steps == [0, 1, 2]


def test_the_display_shows_the_phases_the_loop_writes(tmp_path):
    """The live display reads nothing but the stream the loop writes: a 1-rank run's phases as it names
    them, each with its steps, and no line for the phases that ran no step here."""
    import io

    from harness.run.progress import RunDisplay

    cfg = config(world_size=1, steps=3)
    printed = io.StringIO()
    with RunDisplay(live=False, stream=printed) as display:
        display.phase("launching", events=tmp_path / "rank0.events.jsonl")
        train(CountingTrainer(cfg), cfg, tmp_path)
    lines = [line.split("] ", 1)[1] for line in printed.getvalue().splitlines()]
    assert [line for line in lines if not line.startswith(" ")] == [
        "launching",
        "warm-up: 2 step(s)",
        "measured: 3 step(s)",
        "timing the step's parts: 3 step(s)",
    ]
    assert any(line.startswith("  timing the step's parts 3/3: step 7 loss 1.0000 |") for line in lines)
