"""Records handed to TensorBoard and to github-action-benchmark, and the progress display's plain lines
(the display against a real run: tests/test_ddp.py)."""

from __future__ import annotations

import contextlib
import io
import json

import jsonschema
import numpy as np
import pytest
from record_factory import assemble, config, environment, make_record, rank_record

from core.events import PHASE_START, STEP, EventLog, events_path
from core.records import write_json_atomic
from harness.analyze.analysis import aggregate, runs_table
from harness.analyze.export import github_benchmark, run_name, write_tensorboard
from harness.cli import main
from harness.run.progress import RunDisplay

pytestmark = pytest.mark.unit

# rank 0 and rank 1 of a 2-rank tiny run (micro-batch 8, seq 128: 2,048 tokens a step), by hand
RANK_TIMES = ([0.10, 0.20, 0.30, 0.40], [0.15, 0.10, 0.35, 0.20])
RANK_LOSSES = ([4.0, 3.0, 2.0, 1.0], [6.0, 5.0, 4.0, 3.0])
SLOWEST = [0.15, 0.20, 0.35, 0.40]
MEAN_LOSS = [5.0, 4.0, 3.0, 2.0]


def two_rank_record() -> dict:
    cfg = config("torch-ddp", 2, steps=4, warmup=1, micro_batch=8, compute_method="none")
    ranks = [rank_record(r, RANK_TIMES[r], losses=RANK_LOSSES[r]) for r in (0, 1)]
    return assemble(cfg, "run-a", ranks, environment=environment(world=2))


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The event file read back with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_export_round_trips_every_steps_figures(tmp_path):
    record = two_rank_record()
    [folder] = write_tensorboard([record, make_record(status="failed", gpus=2)], tmp_path)
    assert folder.name == run_name(record)  # the failed run has no curves, so no folder
    scalars = read_scalars(folder)
    assert [s for s, _ in scalars["loss"]] == [0, 1, 2, 3]
    np.testing.assert_allclose([v for _, v in scalars["loss"]], MEAN_LOSS, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars["time/step_s"]], SLOWEST, rtol=1e-6)
    np.testing.assert_allclose(
        [v for _, v in scalars["throughput/tokens_per_s"]], [2048 / t for t in SLOWEST], rtol=1e-6
    )
    assert sorted(scalars) == ["loss", "throughput/tokens_per_s", "time/step_s"]


@pytest.mark.subprocess
def test_export_imports_no_ml_framework():
    """The harness imports none (two in one process can crash); TensorBoard's writer would import
    TensorFlow if let."""
    import subprocess
    import sys

    from conftest import REPO

    code = (
        "import sys, tempfile; from record_factory import make_record; "
        "from harness.analyze.export import write_tensorboard; "
        "write_tensorboard([make_record(gpus=2)], tempfile.mkdtemp()); "
        "print(sorted({'torch', 'tensorflow', 'paddle'} & set(sys.modules)))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


# What github-action-benchmark reads for customBiggerIsBetter / customSmallerIsBetter (its BenchmarkResult:
# name, value, unit required; range and extra optional strings; nothing else is kept).
BENCHMARK_RESULTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "value", "unit"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "value": {"type": "number"},
            "unit": {"type": "string"},
            "range": {"type": "string"},
            "extra": {"type": "string"},
        },
    },
}


def sweep_records() -> list[dict]:
    """A sweep: two backends x N in {1, 2} x 3 repeats, step times known; one failed repeat."""
    records = []
    for label, base in (("torch-ddp", 0.10), ("deepspeed-zero3", 0.20)):
        for gpus in (1, 2):
            for repeat, jitter in enumerate((1.0, 1.1, 0.9)):
                records.append(
                    make_record(
                        label,
                        gpus,
                        step_time=base * gpus**0.5 * jitter,
                        repeat=repeat,
                        run_id=f"{label}-{gpus}-{repeat}",
                    )
                )
    records.append(make_record("torch-ddp", 2, status="failed", repeat=3, run_id="torch-ddp-2-failed"))
    return records


def test_github_benchmark_json_is_what_the_action_reads_for_a_sweep(tmp_path):
    records = sweep_records()
    for record in records:
        write_json_atomic(tmp_path / f"{record['run_id']}.json", record)
    assert (
        main(["results", str(tmp_path), "--format", "github-benchmark", "--output", str(tmp_path / "gb")])
        == 0
    )
    files = {path.stem: json.loads(path.read_text()) for path in (tmp_path / "gb").glob("*.json")}
    assert set(files) == {"customBiggerIsBetter", "customSmallerIsBetter"}
    for entries in files.values():
        jsonschema.validate(entries, BENCHMARK_RESULTS)
        names = [e["name"] for e in entries]
        assert len(names) == len(set(names))  # the action keys its history on the name

    bigger = {e["name"]: e for e in files["customBiggerIsBetter"]}
    smaller = {e["name"]: e for e in files["customSmallerIsBetter"]}
    # 4 configurations: throughput, per-device throughput, efficiency each (no MFU: a CPU has no peak)
    assert len(bigger) == 12 and not any(name.endswith(" MFU") for name in bigger)
    context = "tiny/cpu: Test CPU/fp32/weak/8 seq per rank x 1 accum/1 thread(s) per worker, 1+4 steps"
    ddp2 = f"{context}/torch-ddp/N=2"
    # median of the ok repeats' step times (0.1 x sqrt 2 x {1, 1.1, 0.9}); the failed one counted, not used
    t_step = 0.1 * 2**0.5
    assert smaller[f"{ddp2} step time"]["value"] == pytest.approx(t_step * 1e3)
    assert bigger[f"{ddp2} throughput"]["value"] == pytest.approx(2 * 8 * 128 / t_step)
    assert bigger[f"{ddp2} scaling efficiency"]["value"] == pytest.approx(1 / 2**0.5)
    assert bigger[f"{ddp2} throughput"]["range"].endswith("over 3 runs")
    assert "3 ok, 1 failed" in bigger[f"{ddp2} throughput"]["extra"]


def test_github_benchmark_leaves_out_what_was_not_measured():
    runs = runs_table([make_record(gpus=1)])
    entries = github_benchmark(aggregate(runs), runs)
    names = [e["name"] for tool in entries.values() for e in tool]
    assert names and not any(" MFU" in n for n in names)  # a CPU has no peak FLOPs: no MFU, not 0
    assert all("range" not in e for tool in entries.values() for e in tool)  # one run: no spread


@contextlib.contextmanager
def following_a_stream(tmp_path):
    """A plain-line display that follows rank 0's event stream from launch to the writing of the record:
    yields the stream's writer, the display and what it printed."""
    stream = io.StringIO()
    with RunDisplay(live=False, stream=stream) as display:
        display.phase("launching", events=events_path(tmp_path, 0))
        log = EventLog(events_path(tmp_path, 0), 0)
        yield log, display, stream
        display.phase("writing the record")


def phase(log: EventLog, name: str, steps: int) -> None:
    log.emit(PHASE_START, phase=name, steps=steps)


def step(log: EventLog, name: str, index: int, loss: float, ms: float, tokens: int = 2048) -> None:
    log.emit(STEP, phase=name, step=index, loss=loss, step_time_s=ms / 1e3, tokens_per_s=tokens / (ms / 1e3))


def shown(stream) -> tuple[list[str], list[str]]:
    """The printed lines without their clock, and the phases they name (each phase's first line)."""
    lines = [line.split("] ", 1)[1] for line in stream.getvalue().splitlines()]
    return lines, [line.split(":")[0] for line in lines if not line.startswith(" ")]


def test_plain_progress_names_each_phase_and_reads_only_whole_lines(tmp_path):
    """Phases as rank 0's stream announces them (one that runs no step here is not shown), steps counted
    in theirs; a line still being written is read once it is whole."""
    with following_a_stream(tmp_path) as (log, display, stream):
        phase(log, "warm-up", 1)
        step(log, "warm-up", 0, 7.0, 100.0)
        phase(log, "measured", 4)
        for i in range(1, 5):
            step(log, "measured", i, 7 - i, 200.0)
        phase(log, "compute-only", 3)
        phase(log, "anatomy", 0)
        step(log, "compute-only", 5, 3.0, 150.0)
        with open(log.path, "ab") as f:
            f.write(b'{"event": "step", "phase": "compute-only", "step": 6, "loss": 3.0, "step_t')
        display.poll()
        assert "compute-only 1/3" in stream.getvalue() and "2/3" not in stream.getvalue()
        with open(log.path, "ab") as f:
            f.write(b'ime_s": 0.15, "tokens_per_s": 13653.3}\n')
    lines, phases = shown(stream)
    assert phases == ["launching", "warm-up", "measured", "compute-only", "writing the record"]
    # 2,048 tokens a step in 200 ms
    assert "  measured 4/4: step 4 loss 3.0000 | 200.0 ms | 10,240 tokens/s | ETA 0:00" in lines
    assert any(line.startswith("  compute-only 2/3: step 6") for line in lines)


def test_plain_progress_shows_a_one_rank_runs_anatomy_steps_as_their_own_phase(tmp_path):
    """A process with no peer times the parts of its step in steps after the measured ones: they are shown
    as their own phase, not counted as measured steps past the total."""
    with following_a_stream(tmp_path) as (log, _, stream):
        phase(log, "warm-up", 1)
        step(log, "warm-up", 0, 7.0, 100.0)
        phase(log, "measured", 3)
        for i in range(1, 4):
            step(log, "measured", i, 7 - i, 200.0)
        phase(log, "anatomy", 3)
        for i in range(4, 7):
            step(log, "anatomy", i, 7 - i, 210.0)
    lines, phases = shown(stream)
    assert phases == ["launching", "warm-up", "measured", "timing the step's parts", "writing the record"]
    assert any(line.startswith("  measured 3/3: step 3") for line in lines)
    assert any(line.startswith("  timing the step's parts 3/3: step 6") for line in lines)
