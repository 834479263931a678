"""`--micro-batch max` (harness/run/fill.py): the memory model's largest fitting micro-batch, confirmed by
probe runs that back off on out-of-memory, refused where no GPU bounds the micro-batch; tested with probes
that stand for a device, since no GPU runs here."""

from __future__ import annotations

import json

import pytest
import record_factory as factory

from core.records import validate_record
from harness.cli import main
from harness.predict.memory import MICRO_BATCHES, largest_fitting
from harness.run.fill import Probe, candidates, choose
from harness.run.sweep import as_planned
from harness.usage import UsageError
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit

H100_BYTES = 80e9


def gpu_config():
    return factory.config("torch-ddp", 1, workload="1b", spec=PRESETS["1b"], device="cuda", precision="bf16")


def fake_device(fits_up_to: int, seen: list[int]):
    """A probe of a device on which micro-batches above `fits_up_to` run out of memory."""

    def probe(cfg):
        seen.append(cfg.batch.micro_batch)
        return Probe(cfg.batch.micro_batch, "ok" if cfg.batch.micro_batch <= fits_up_to else "oom")

    return probe


def test_the_model_s_largest_fit_is_probed_first_and_kept_where_it_runs():
    cfg, seen = gpu_config(), []
    predicted = largest_fitting(cfg, max(MICRO_BATCHES), H100_BYTES)[0].batch.micro_batch
    chosen, choice = choose(cfg, fake_device(64, seen), capacity=H100_BYTES)
    assert seen == [predicted] and chosen.batch.micro_batch == predicted == choice["chosen"]
    assert choice["predicted"] == predicted and choice["probes"] == [
        {"micro_batch": predicted, "status": "ok", "detail": ""}
    ]
    assert 1 < predicted < 64  # a 1.3B model in bf16 on 80 GB fits some, not every, micro-batch
    assert chosen.batch.grad_accum == cfg.batch.grad_accum  # the accumulation given stays


def test_out_of_memory_backs_off_to_the_next_smaller_micro_batch_until_a_probe_runs():
    cfg, seen = gpu_config(), []
    predicted = largest_fitting(cfg, max(MICRO_BATCHES), H100_BYTES)[0].batch.micro_batch
    chosen, choice = choose(cfg, fake_device(predicted // 4, seen), capacity=H100_BYTES)
    assert seen == [predicted, predicted // 2, predicted // 4]
    assert chosen.batch.micro_batch == predicted // 4
    assert [p["status"] for p in choice["probes"]] == ["oom", "oom", "ok"]


def test_a_probe_that_fails_otherwise_or_a_device_too_small_for_any_is_a_usage_error():
    cfg = gpu_config()
    with pytest.raises(UsageError, match="ended failed: a crash"):
        choose(cfg, lambda c: Probe(c.batch.micro_batch, "failed", "a crash"), capacity=H100_BYTES)
    with pytest.raises(UsageError, match="out of memory at every micro-batch tried"):
        choose(cfg, fake_device(0, []), capacity=H100_BYTES)
    with pytest.raises(UsageError, match="reported none"):
        choose(cfg, fake_device(64, []), capacity=0)
    assert candidates(16) == [16, 8, 4, 2, 1]


def test_on_a_cpu_max_is_refused_in_one_line_before_anything_launches(capsys):
    cpu = factory.config("torch-ddp", 2)
    with pytest.raises(UsageError, match="on a CPU memory does not bound the micro-batch"):
        choose(cpu, fake_device(64, []), capacity=H100_BYTES)
    argvs = [
        ["run", "--backend", "torch-ddp", "--micro-batch", "max", "--gpus", "2", "--device", "cpu"],
        ["sweep", "--backends", "torch-ddp", "--micro-batch", "max", "--gpus", "1,2", "--device", "cpu"],
        [
            "predict",
            "--backend",
            "torch-ddp",
            "--micro-batch",
            "max",
            "--gpus",
            "2",
            "--hardware",
            "h100-sxm",
        ],
        ["run", "--backend", "torch-ddp", "--micro-batch", "maxx"],
    ]
    for argv in argvs:
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "--micro-batch" in err[0], (argv, err)
    assert "expected a positive integer or 'max'" in err[0]


def test_the_record_says_how_the_micro_batch_was_chosen_and_a_resumed_sweep_finds_the_run_done():
    _, choice = choose(gpu_config(), fake_device(8, []), capacity=H100_BYTES)
    rec = json.loads(json.dumps({**factory.make_record(micro_batch=8), "micro_batch_choice": choice}))
    validate_record(rec)
    planned = as_planned(rec)
    assert planned["config"]["batch"]["micro_batch"] == 1 and rec["config"]["batch"]["micro_batch"] == 8
    assert as_planned(factory.make_record()) == factory.make_record()  # a number given: as it ran
    with pytest.raises(Exception, match="micro_batch_choice"):
        validate_record({**rec, "micro_batch_choice": {**choice, "requested": 8}})
