"""`harness sweep`: the plan (batch per scaling mode, threads, skipped backends), resume, and one real
sweep."""

import json
import os

import pytest
from conftest import harness
from record_factory import make_record

import backends
from backends.torch_ddp import TorchDDP
from core.records import load_records, run_config, write_json_atomic
from harness.cli import main, make_parser
from harness.run.sweep import drop_done, plan
from harness.usage import UsageError


class Unavailable(TorchDDP):
    """A registered backend that cannot run here."""

    name = "unavailable-x"

    def availability(self, python=None):
        return False, "not installed: nothing"


def sweep_args(*argv):
    return make_parser().parse_args(["sweep", "--device", "cpu", *argv])


@pytest.mark.unit
def test_weak_scaling_fixes_the_per_device_batch_and_threads():
    runs, skipped = plan(sweep_args("--backends", "torch-ddp", "--gpus", "1,2,4", "--repeats", "2"))
    assert [(r.cfg.topology.world_size, r.repeat) for r in runs] == [
        (1, 0),
        (2, 0),
        (4, 0),
        (1, 1),
        (2, 1),
        (4, 1),
    ]
    assert {r.cfg.batch.micro_batch for r in runs} == {8} and {r.cfg.batch.scaling for r in runs} == {"weak"}
    assert {r.cfg.topology.threads_per_worker for r in runs} == {max(1, (os.cpu_count() or 1) // 4)}
    assert skipped == {}


@pytest.mark.unit
def test_strong_scaling_splits_one_global_batch_over_every_n():
    runs, _ = plan(
        sweep_args("--backends", "torch-ddp", "--gpus", "1,2,3", "--repeats", "1", "--scaling", "strong")
    )
    assert {r.cfg.global_batch for r in runs} == {8 * 6}  # default micro-batch x lcm(1, 2, 3)
    assert [r.cfg.batch.micro_batch for r in runs] == [48, 24, 16]
    assert {r.cfg.batch.scaling for r in runs} == {"strong"}
    runs, _ = plan(sweep_args("--backends", "torch-ddp", "--gpus", "1,2", "--global-batch", "12"))
    assert [r.cfg.batch.micro_batch for r in runs][:2] == [12, 6] and runs[0].cfg.batch.scaling == "strong"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "1,2", "--global-batch", "16", "--scaling", "weak"], "--scaling strong"),
        (["--gpus", "1,3", "--global-batch", "16", "--scaling", "strong"], "not divisible"),
        (["--gpus", "1,2", "--backends", "torch-ddp,nope"], "valid: torch-ddp"),
    ],
)
@pytest.mark.unit
def test_bad_input_fails_before_anything_runs(argv, message):
    with pytest.raises(UsageError, match=message):
        plan(sweep_args(*argv))


@pytest.mark.parametrize(
    "layout", [["--nodes", "2", "--master", "a:1", "--node-rank", "0"], ["--hosts", "a,b"]]
)
@pytest.mark.unit
def test_multi_node_sweep_is_refused_pointing_at_slurm(capsys, layout):
    assert main(["sweep", "--backends", "torch-ddp", "--gpus", "2", "--device", "cpu", *layout]) == 2
    err = capsys.readouterr().err
    assert (
        "sweep runs on one node, not 2" in err
        and "harness slurm --nodes M" in err
        and len(err.splitlines()) == 1
    )
    assert plan(sweep_args("--backends", "torch-ddp", "--gpus", "2", "--hosts", "a"))[
        0
    ]  # one host is one node


@pytest.mark.unit
def test_usage_errors_exit_2(capsys):
    assert main(["sweep", "--gpus", "0,2"]) == 2
    assert main(["sweep", "--gpus", "1", "--scaling", "diagonal"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.unit
def test_unavailable_backend_is_skipped_with_its_reason(monkeypatch):
    monkeypatch.setitem(backends.ADAPTERS, "unavailable-x", "test_sweep:Unavailable")
    runs, skipped = plan(sweep_args("--backends", "all", "--gpus", "1,2", "--repeats", "1"))
    assert "torch-ddp" in {r.backend.name for r in runs} and "unavailable-x" not in {
        r.backend.name for r in runs
    }
    assert skipped["unavailable-x"] == "not installed: nothing"
    with pytest.raises(UsageError, match="no available backend.*not installed: nothing"):
        plan(sweep_args("--backends", "unavailable-x", "--gpus", "1"))


@pytest.mark.unit
def test_a_full_results_filesystem_stops_the_sweep_with_one_line(tmp_path, monkeypatch, capsys):
    """No run after it could write a record either: one line naming the folder, the count left for
    --resume, exit 1; no traceback."""
    import errno

    import harness.run.sweep as sweep

    out = tmp_path / "results"

    def full(backend, cfg, out_dir, argv, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(out_dir / "logs" / "x" / "rank0.log"))

    monkeypatch.setattr(sweep, "execute", full)
    argv = ["sweep", "--device", "cpu", "--backends", "torch-ddp", "--gpus", "1,2", "--repeats", "1"]
    assert main([*argv, "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip() == f"harness: error: cannot write under {out}: No space left on device"
    assert "stopped at run 1; 2 run(s) without a record (--resume runs them)" in captured.out


@pytest.mark.unit
def test_an_os_error_outside_the_results_folder_is_not_blamed_on_it(tmp_path):
    """A launcher that cannot start is not a full disk."""
    import errno

    from harness.run.options import os_error_line

    missing = OSError(errno.ENOENT, "No such file or directory", "horovodrun")
    assert os_error_line(missing, tmp_path) == "harness: error: No such file or directory: horovodrun"
    assert "cannot write under" in os_error_line(OSError(errno.EROFS, "Read-only file system"), tmp_path)
    pipe = BrokenPipeError(errno.EPIPE, "Broken pipe")
    assert os_error_line(pipe, tmp_path) == "harness: error: Broken pipe"


@pytest.mark.unit
def test_resume_counts_ok_records_of_the_same_config(tmp_path):
    runs, _ = plan(sweep_args("--backends", "torch-ddp", "--gpus", "1,2", "--repeats", "3"))
    done = [runs[0], runs[2], runs[1]]  # N=1 twice, N=2 once
    for i, run in enumerate(done):
        rec = make_record("torch-ddp", run.cfg.topology.world_size, run_id=f"done{i}")
        rec["config"] = run.cfg.evolve(timeout_s=5.0).to_dict()  # a different timeout is the same measurement
        write_json_atomic(tmp_path / f"done{i}.json", rec)
    failed = make_record("torch-ddp", 2, status="failed", run_id="failed")
    failed["config"] = runs[1].cfg.to_dict()
    write_json_atomic(tmp_path / "failed.json", failed)
    other = make_record("torch-ddp", 2, run_id="other")
    other["config"] = runs[1].cfg.evolve(steps=7).to_dict()  # other measured steps: another measurement
    write_json_atomic(tmp_path / "other.json", other)
    todo, skipped = drop_done(runs, tmp_path)
    assert skipped == 3
    assert [(r.cfg.topology.world_size, r.repeat) for r in todo] == [
        (2, 1),
        (1, 2),
        (2, 2),
    ]  # launch order kept


@pytest.mark.slow
def test_real_sweep_records_a_failure_goes_on_and_resumes(tmp_path):
    """torch-ddp at N=2 (rank 1 raises at step 1) then N=1: the failure is a record and N=1 still runs;
    --resume then skips the ok N=1 run and launches N=2 again."""
    argv = [
        "sweep",
        "--backends",
        "torch-ddp",
        "--gpus",
        "2,1",
        "--repeats",
        "1",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--compute-steps",
        "1",
        "--device",
        "cpu",
        "--timeout",
        "60",
        "--inject-fault",
        "1:1:raise",
        "--out",
        str(tmp_path),
    ]

    def sweep(*extra):
        return harness(*argv, *extra, timeout=150)

    curves = tmp_path.with_name(tmp_path.name + "-tensorboard")
    first = sweep("--tensorboard", str(curves))
    assert first.returncode == 1, first.stdout + first.stderr
    assert len(list(curves.iterdir())) == 1  # the ok run's curves; the failed run has none
    assert "[1/2] torch-ddp N=2 repeat 1/1: failed" in first.stdout and "[2/2] torch-ddp N=1" in first.stdout
    records = sorted(load_records([tmp_path]), key=lambda r: r["environment"]["start_time"])
    assert [(run_config(r).topology.world_size, r["status"]) for r in records] == [(2, "failed"), (1, "ok")]
    assert "injected fault at step 1" in records[0]["error"]["message"]
    assert records[0]["sweep"]["id"] == records[1]["sweep"]["id"] and records[0]["sweep"]["repeat"] == 0
    assert (
        run_config(records[0]).topology.threads_per_worker
        == run_config(records[1]).topology.threads_per_worker
    )

    second = sweep("--resume")
    assert second.returncode == 1, second.stdout + second.stderr
    assert "resume: 1 run(s) already recorded ok" in second.stdout and "[1/1] torch-ddp N=2" in second.stdout
    records = load_records([tmp_path])
    assert sorted((run_config(r).topology.world_size, r["status"]) for r in records) == [
        (1, "ok"),
        (2, "failed"),
        (2, "failed"),
    ]
    assert len({r["sweep"]["id"] for r in records}) == 2
    assert json.loads((tmp_path / f"{records[0]['run_id']}.json").read_text())["schema_version"] == 4
