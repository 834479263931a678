"""A failure is a recorded result: a rank killed, out of memory or hung; a run past its --timeout; two runs
at once; a sweep killed with SIGKILL and resumed; corrupt files among the records. Each fault test checks
the recorded status and culprit rank, that no process outlives the run, and that no earlier record in the
shared results dir was lost or changed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, harness, run_record
from processes import leftovers

from backends import faults, loop
from backends.faults import record_termination
from core.events import EventLog, events_path, rank_record, read_events
from core.hooks import TestHooks
from core.records import load_record, load_records, run_config

# `tiny` cut to one block, a quarter of its width and of its sequence: what a fault test reads is how the
# run ended, which the model's size does not change, and a step costs milliseconds, not `tiny`'s ~0.3 s of
# a CPU per rank.
SMALL = "--layers 1 --d-model 32 --seq-len 32".split()
RUN = (
    "--backend torch-ddp --gpus 2 --steps 4 --warmup 1 --compute-method "
    "none --threads-per-worker 1 --device cpu"
).split() + SMALL


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """One results dir for the whole module, so every test also proves the earlier records survived."""
    return tmp_path_factory.mktemp("faults") / "results"


@pytest.fixture
def kept(results):
    """Every record present before the test is still there, byte for byte, after it."""
    before = {p.name: p.read_bytes() for p in results.glob("*.json")} if results.exists() else {}
    yield
    for name, data in before.items():
        assert (results / name).read_bytes() == data, f"{name} was lost or changed"


def faulty_run(results, *args, timeout_s: float = 60) -> tuple[dict, float | None]:
    """A run expected to fail, and the seconds from its injected fault to the harness's exit."""
    record = run_record(
        results, *RUN, "--timeout", str(timeout_s), *args, expect_rc=1, timeout=timeout_s + 120
    )
    done = time.time()
    logs = " ".join(
        p.read_text(errors="replace") for p in Path(record["launch"]["log_dir"]).glob("rank*.log")
    )
    injected = [
        float(t) for t in re.findall(r"injecting fault '\w+' at step \d+ \(unix time ([0-9.]+)\)", logs)
    ]
    assert not leftovers(record["launch"]["log_dir"], wait_s=5), "a process outlived its run"
    return record, (done - injected[0]) if injected else None


@pytest.mark.unit
@pytest.mark.parametrize("when", ["while it writes", "before it turns SIGTERM off"])
def test_a_rank_that_failed_still_writes_its_record_when_its_launcher_then_sends_sigterm(tmp_path, when):
    """A rank whose peer died fails in its collective and is sent SIGTERM by its launcher as it records
    that; the record must still be written, with the rank's own error, or the harness takes that rank for
    the one killed. Afterwards SIGTERM ends the process again, as a launcher expects."""
    previous = signal.getsignal(signal.SIGTERM)
    error = RuntimeError("Connection closed by peer [127.0.0.1]:30346")

    def sigterm_to_self():  # what torchrun does to the surviving ranks
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # let the handler run, if one is installed

    try:
        record_termination()
        with pytest.MonkeyPatch.context() as mp:
            if when == "while it writes":
                real_record = faults.failure_record
                mp.setattr(faults, "failure_record", lambda exc: (sigterm_to_self(), real_record(exc))[1])
            else:
                real_signal, sent = signal.signal, []

                def signal_after_a_sigterm(signum, handler):
                    if not sent:
                        sent.append(signum)
                        sigterm_to_self()
                    return real_signal(signum, handler)

                mp.setattr(faults.signal, "signal", signal_after_a_sigterm)
            faults.record_failure(EventLog(events_path(tmp_path, 0), 0), error)
        record = rank_record(read_events(events_path(tmp_path, 0)))
        assert record is not None and record["status"] == "failed"
        assert record["error"].startswith("RuntimeError: Connection closed by peer")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.unit
def test_a_run_is_kept_only_if_every_rank_had_measured_before_it_failed():
    """Rank 1 died while tracing (no final record), rank 0 then failed in a collective: both measured
    records are kept, each trace saying how its rank ended. A rank whose final record is ok keeps it; one
    that died tearing down keeps the measured record it rewrote after its trace (a Horovod rank past 0
    has none to rewrite it with: its reason stays its own). A rank without a measured record failed
    before its measurements were complete, and a run timed out or stopped from outside is not trusted:
    nothing is kept then."""
    from harness.run.launch import LaunchResult
    from harness.run.record import measured_before_failure

    def measured(rank, **trace):
        trace = trace or {"method": None, "reason": loop.TRACE_LOST}
        return {"rank": rank, "status": "ok", "step_times": [0.1], "comm_trace": trace}

    both = {0: measured(0), 1: measured(1)}
    done = LaunchResult([1, -9], False, 10.0)
    failed = {
        0: {"rank": 0, "status": "failed", "error": "RuntimeError: Connection closed by peer\n  at ..."}
    }
    kept = measured_before_failure(done, failed, both, range(2))
    assert [k["step_times"] for k in kept.values()] == [[0.1], [0.1]]
    assert kept[0]["comm_trace"]["reason"] == f"{loop.TRACE_LOST}: RuntimeError: Connection closed by peer"
    assert kept[1]["comm_trace"]["reason"].startswith(f"{loop.TRACE_LOST}: it exited without a record")
    final = {"rank": 0, "status": "ok", "step_times": [0.2], "comm_trace": {"method": "torch profiler"}}
    assert measured_before_failure(done, {0: final}, both, range(2))[0] is final
    for trace in (
        {"method": "torch profiler", "collectives": []},
        {
            "method": "horovod timeline",
            "collectives": None,
            "reason": "Horovod writes its timeline on rank 0",
        },
    ):
        torn_down = measured(1, **trace)
        assert measured_before_failure(done, failed, {0: measured(0), 1: torn_down}, range(2))[1] is torn_down
    assert measured_before_failure(done, failed, {0: measured(0)}, range(2)) is None
    timed_out = LaunchResult([None, -9], True, 60.0)
    assert measured_before_failure(timed_out, failed, both, range(2)) is None
    stopped = LaunchResult([1, -9], False, 10.0, "SIGTERM from outside the harness")
    assert measured_before_failure(stopped, failed, both, range(2)) is None


@pytest.mark.unit
@pytest.mark.parametrize("traced", [False, True], ids=["died tracing", "died tearing down"])
def test_the_record_names_the_phase_the_culprit_died_in(tmp_path, traced, monkeypatch):
    """write_record from a run dir as the ranks leave it: rank 1 exited without a result (its stream ends
    in a torn line), rank 0 then failed on its lost peer, both had measured. The culprit is rank 1; the
    phase is the collective trace if its last measured event is the one from before the trace, teardown if
    it had written it again after. The run is ok, with no error, its test hooks named at the top; a
    commbench run is never kept so."""

    from record_factory import environment, rank_record

    from backends import get_backend
    from core.commbench_spec import CommbenchSpec
    from core.config import RunConfig
    from harness.run import record as run_record
    from harness.run.record import write_record
    from workloads.spec import PRESETS

    # the record's platform and git probes start processes
    monkeypatch.setattr(run_record, "environment", lambda *args: environment(world=2))

    cfg = RunConfig.build(
        "torch-ddp", workload="tiny", spec=PRESETS["tiny"], world_size=2, device="cpu", compute_method="none"
    )
    run_dir = tmp_path / "logs" / "r1"
    run_dir.mkdir(parents=True)
    marker = {"node_rank": 0, "finished": True, "returncodes": [1], "timed_out": False, "stopped": None}
    (run_dir / "node0.json").write_text(json.dumps({**marker, "elapsed_s": 9.0, "ranks_ok": True}))
    trace = {"method": "torch profiler (kineto)", "steps": 1, "collectives": []} if traced else None
    measured = {"step_time_s": "step_times", "loss": "losses"}
    for r in (0, 1):
        log = EventLog(events_path(run_dir, r), r)
        log.emit("phase_start", phase="warm-up", steps=0, keeps={"loss": "warmup_losses"})
        log.emit("phase_start", phase="measured", steps=1, keeps=measured)
        log.emit("step", phase="measured", step=0, loss=7.0, step_time_s=0.1, kept=True)
        log.emit(
            "phase_start", phase="compute-only", steps=0, keeps={"step_time_s": "compute_only_step_times"}
        )
        series = ("step_times", "losses", "warmup_losses", "compute_only_step_times")
        rank = {k: v for k, v in rank_record(r, [0.1]).items() if k not in series}
        log.emit("measured", record={**rank, "comm_trace": {"method": None, "reason": loop.TRACE_LOST}})
        if traced:
            log.emit("measured", record={**rank, "comm_trace": trace})
    failed = {"rank": 0, "status": "failed", "error": "RuntimeError: Connection closed by peer"}
    EventLog(events_path(run_dir, 0), 0).emit("result", record=failed)
    with open(events_path(run_dir, 1), "a") as torn:
        torn.write('{"event": "result", "record": {"rank": 1, "sta')
    TestHooks(fault={"rank": 1, "step": 1, "kind": "sigkill"}).write(run_dir)
    record = write_record(get_backend("torch-ddp"), cfg, tmp_path, "r1", wait=False)
    assert (record["status"], record["error"]) == ("ok", None)
    assert record["test_hooks"] == {"fault": {"rank": 1, "step": 1, "kind": "sigkill"}}
    phase = "teardown" if traced else "collective trace"
    assert (record["incident"]["rank"], record["incident"]["status"], record["incident"]["phase"]) == (
        1,
        "crashed",
        phase,
    )
    assert [r["step_times"] for r in record["ranks"]] == [[0.1], [0.1]]
    commbench = cfg.evolve(commbench=CommbenchSpec(("all_reduce",), (1024,)).to_dict())
    assert write_record(get_backend("torch-ddp"), commbench, tmp_path, "r1", wait=False)["status"] != "ok"


@pytest.mark.slow
def test_killed_rank_is_recorded_as_crashed_naming_it(results, kept):
    record, detect_s = faulty_run(results, "--inject-fault", "1:2:sigkill")
    assert record["status"] == "crashed" and record["error"]["rank"] == 1
    assert any("injecting fault 'sigkill'" in line for line in record["error"]["log_tail"])
    assert detect_s is not None and detect_s < 45


@pytest.mark.slow
def test_a_rank_killed_while_tracing_leaves_an_ok_run_that_records_the_incident(results, kept):
    """Every rank had measured when rank 1 died in its first traced step (5: 1 warm-up + 4 measured): the
    run is ok with both ranks' figures, the incident names rank 1 with its last lines, and both traces
    say they were lost and how (rank 0's peer vanished in a collective, or its launcher stopped it). A
    kill in a measured step still crashes the run (test_killed_rank_is_recorded_as_crashed_naming_it)."""
    record = run_record(
        results, *RUN, "--timeout", "60", "--inject-fault", "1:5:sigkill", expect_rc=0, timeout=180
    )
    assert record["status"] == "ok" and record["error"] is None
    incident = record["incident"]
    assert (incident["phase"], incident["status"], incident["rank"]) == ("collective trace", "crashed", 1)
    assert any("injecting fault 'sigkill' at step 5" in line for line in incident["log_tail"])
    assert [len(r["step_times"]) for r in record["ranks"]] == [4, 4]
    assert record["summary"]["throughput_tokens_per_s"] > 0
    traces = [r["comm_trace"] for r in record["ranks"]]
    assert all(t["method"] is None and t["reason"].startswith(loop.TRACE_LOST) for t in traces)
    assert "exited without a record" in traces[1]["reason"]
    assert traces[0]["reason"].startswith(loop.TRACE_LOST + ": ")  # and how: failed in the call, or stopped
    assert not leftovers(record["launch"]["log_dir"], wait_s=5)
    report = harness("report", results).stdout  # listed apart from the failed runs: its figures stand
    incidents = report[report.index("## Incidents after the measured steps") :]
    assert record["run_id"] in incidents.split("\n## ")[0]


@pytest.mark.slow
def test_rank_out_of_memory_is_recorded_as_oom_naming_it(results, kept):
    record, detect_s = faulty_run(results, "--inject-fault", "1:2:oom")
    assert record["status"] == "oom" and record["error"]["rank"] == 1
    assert "MemoryError" in record["error"]["message"]
    assert detect_s is not None and detect_s < 45


@pytest.mark.slow
def test_a_rank_stopped_with_sigstop_ends_the_run_at_the_collective_timeout_naming_it(results, kept):
    """SIGSTOP: the rank neither exits nor answers (a job suspended on one node, a frozen host); its peer
    gives up in the collective and the record blames the stopped rank. Its launcher's SIGTERM waits while
    it is stopped (torchrun would SIGKILL it only after 30 s), so the harness resumes a stopped rank that
    has a SIGTERM pending: it ends at once and records that it was stopped from outside."""
    record, detect_s = faulty_run(
        results, "--inject-fault", "1:2:sigstop", "--collective-timeout", "5", timeout_s=90
    )
    assert record["status"] == "timeout" and record["error"]["rank"] == 1, record["error"]
    assert "rank(s) [0] gave up waiting in a collective for rank(s) [1]" in record["error"]["message"]
    stopped = next(r for r in record["ranks"] if r["rank"] == 1)
    assert stopped["terminated"] and "SIGTERM" in stopped["error"]
    assert detect_s is not None and detect_s < 25, f"{detect_s:.0f} s from SIGSTOP to the harness's exit"


def test_hung_rank_ends_the_run_at_the_collective_timeout(results, kept):
    """The other rank gives up in its collective after --collective-timeout, long before --timeout."""
    record, detect_s = faulty_run(
        results, "--inject-fault", "1:2:hang", "--collective-timeout", "5", timeout_s=150
    )
    assert record["status"] == "timeout" and record["error"]["rank"] == 1
    assert "gave up waiting in a collective for rank(s) [1]" in record["error"]["message"]
    assert record["error"]["unfinished_ranks"] == [0, 1]
    assert detect_s is not None and detect_s < 60 and record["launch"]["elapsed_s"] < 120


@pytest.mark.slow
def test_deepspeed_ranks_give_up_at_the_collective_timeout(results, kept):
    """DeepSpeed's process group gets --collective-timeout too (it used to get the run's --timeout)."""
    record = run_record(
        results,
        "--backend",
        "deepspeed",
        "--zero-stage",
        "1",
        *RUN[2:],
        "--inject-fault",
        "1:2:hang",
        "--collective-timeout",
        "10",
        "--timeout",
        "400",
        expect_rc=1,
        timeout=520,
    )
    assert record["status"] == "timeout" and record["error"]["rank"] == 1
    assert "gave up waiting in a collective for rank(s) [1]" in record["error"]["message"]
    assert record["launch"]["elapsed_s"] < 200


@pytest.mark.slow
def test_run_timeout_kills_every_process_and_says_which_ranks_had_not_finished(results, kept):
    record, _ = faulty_run(results, "--inject-fault", "0:1:hang", timeout_s=12)
    assert record["status"] == "timeout" and record["error"]["unfinished_ranks"] == [0, 1]
    assert record["error"]["rank"] is None  # every rank waits on a hung one: no rank is blamed
    assert "exceeded its timeout" in record["error"]["message"] and record["error"]["log_tail"]
    assert 12 <= record["launch"]["elapsed_s"] < 27


@pytest.mark.slow
def test_two_runs_at_once_on_one_machine_both_succeed(results, kept):
    """Each run picks its own free rendezvous port, so two at once do not collide."""
    before = set(results.glob("*.json"))
    argv = [sys.executable, "-m", "harness", "run", *RUN, "--timeout", "150", "--out", str(results)]
    procs = [
        subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    new = sorted(set(results.glob("*.json")) - before)
    assert len(new) == 2 and all(load_record(p)["status"] == "ok" for p in new)
    assert not leftovers(results, wait_s=5)


@pytest.mark.slow
def test_sweep_killed_with_sigkill_loses_nothing_and_resume_completes_it(tmp_path):
    out = tmp_path / "results"
    argv = [
        "sweep",
        "--backends",
        "torch-ddp",
        "--gpus",
        "1,2",
        "--repeats",
        "1",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--compute-method",
        "none",
        "--device",
        "cpu",
        *SMALL,
        "--timeout",
        "150",
        "--out",
        str(out),
    ]
    sweep = subprocess.Popen(
        [sys.executable, "-m", "harness", *argv],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not list(out.glob("*.json")) and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    first = list(out.glob("*.json"))
    assert len(first) == 1 and sweep.poll() is None, "the sweep should be in its second run"
    time.sleep(2)  # well into the second run: its launcher and workers are up
    os.kill(sweep.pid, signal.SIGKILL)
    sweep.wait()
    assert not leftovers(out, wait_s=20), "the killed sweep's launcher or workers kept running"
    recorded = first[0].read_bytes()
    assert load_record(first[0])["status"] == "ok"  # what it had recorded is intact

    proc = harness(*argv, "--resume", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 run(s) already recorded ok" in proc.stdout
    records = load_records([out])
    assert sorted(run_config(r).topology.world_size for r in records) == [1, 2] and {
        r["status"] for r in records
    } == {"ok"}
    assert first[0].read_bytes() == recorded and run_config(load_record(first[0])).topology.world_size == 1


def test_a_launcher_that_ignores_sigterm_is_killed_when_the_harness_dies(tmp_path):
    """The harness is SIGKILLed; its launcher ignores the kernel's SIGTERM (as one caught mid-start can):
    the reaper must SIGKILL it after the grace period instead of leaving it running, and remove what the
    run leaves outside its directory (a framework's shared-memory segment, here a file standing for one)."""
    from harness.run.launch import KILL_GRACE_S

    ready, segment = tmp_path / "launcher-ready", tmp_path / "segment_0"
    launcher = (
        f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"pathlib.Path({str(segment)!r}).touch(); pathlib.Path({str(ready)!r}).touch(); time.sleep(600)"
    )
    harness_side = (
        f"import sys; from pathlib import Path; from core.process import Process; "
        f"from harness.run.launch import run_processes; "
        f"run_processes([Process([sys.executable, '-c', {launcher!r}, {str(tmp_path)!r}])], "
        f"Path({str(tmp_path / 'launch.log')!r}), 600, leftovers=[{str(tmp_path / 'segment_*')!r}])"
    )
    proc = subprocess.Popen([sys.executable, "-c", harness_side], cwd=REPO)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ready.exists() and leftovers(tmp_path), "the fake launcher did not start"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not leftovers(tmp_path, wait_s=KILL_GRACE_S + 10), "the launcher outlived the killed harness"
    deadline = time.monotonic() + 10  # the reaper removes them just after the kill
    while segment.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not segment.exists(), "the reaper left the run's leftovers"


@pytest.mark.subprocess
def test_a_run_that_ends_leaves_nothing_outside_its_directory(tmp_path):
    from core.process import Process
    from harness.run.launch import run_processes

    make = "import pathlib, sys; [pathlib.Path(sys.argv[1], f'segment_{r}').touch() for r in (0, 1)]"
    for exit_code in (0, 3):  # a clean exit and a failed one
        result = run_processes(
            [Process([sys.executable, "-c", f"{make}; sys.exit({exit_code})", str(tmp_path)])],
            tmp_path / "launch.log",
            60,
            leftovers=[str(tmp_path / "segment_*")],
        )
        assert result.returncodes == [exit_code] and not list(tmp_path.glob("segment_*"))


def test_corrupt_and_foreign_files_are_named_and_skipped(tmp_path, capsys):
    from record_factory import make_record

    from core.records import write_json_atomic

    for gpus in (1, 2):
        write_json_atomic(
            tmp_path / f"good-{gpus}.json", make_record("torch-ddp", gpus=gpus, run_id=f"good-{gpus}")
        )
    (tmp_path / "torn.json").write_text('{"schema_version": 1, "run_id": "torn", "sta')
    (tmp_path / "foreign.json").write_text(json.dumps({"name": "someone else's file"}))
    (tmp_path / "future.json").write_text(json.dumps({**make_record(), "schema_version": 99}))
    records = load_records([tmp_path])
    assert sorted(r["run_id"] for r in records) == ["good-1", "good-2"]
    err = capsys.readouterr().err
    for name in ("torn.json", "foreign.json", "future.json"):
        assert name in err
    for command in (["report", tmp_path], ["compare", tmp_path, tmp_path]):
        proc = harness(*command)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert all(name in proc.stderr for name in ("torn.json", "foreign.json", "future.json")), proc.stderr


def test_a_harness_stopped_by_sigterm_writes_a_timeout_record_naming_who_stopped_it(results, kept):
    """What a Slurm time limit does (SIGTERM to the job's processes, SIGKILL after KillWait): the harness
    stops its ranks, writes a `timeout` record that names the sender (here a Slurm job, from the job's
    environment) and the ranks that had not finished, exits 1, and leaves no process behind."""
    argv = [*RUN, "--steps", "200", "--step-delay", "0.05", "--timeout", "120", "--out", str(results)]
    before = set(results.glob("*.json")) if results.exists() else set()
    older_runs = set(results.glob("logs/*"))  # this module's earlier runs: their streams have steps too
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", *argv],
        cwd=REPO,
        env={**os.environ, "SLURM_JOB_ID": "4242"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        streams = [events_path(d, 0) for d in set(results.glob("logs/*")) - older_runs]
        if any(e["event"] == "step" for p in streams for e in read_events(p)):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be stopped"
    time.sleep(1)  # well into the measured steps
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    (path,) = set(results.glob("*.json")) - before
    record = load_record(path)
    assert record["status"] == "timeout", record["error"]
    assert "stopped after" in record["error"]["message"]
    assert "SIGTERM from Slurm (job 4242" in record["error"]["message"]
    assert record["error"]["unfinished_ranks"] == [0, 1]
    assert not leftovers(record["launch"]["log_dir"], wait_s=5), "a process outlived the stopped run"


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MiB tmpfs as the results folder (needs root to mount: skipped, saying so, otherwise)."""
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode().strip() or 'mount failed'}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_results_filesystem_that_fills_up_is_reported_and_leaves_nothing_half_written(small_filesystem):
    """The results filesystem fills while a run is under way (the ranks' files and the node markers live
    there too): the harness stops with one line naming the folder and the error, exit 1; nothing
    half-written is left in the folder, the record already there is untouched, no process is left. Full
    from the start: the same line, before anything launches."""
    out = small_filesystem
    earlier = out / "earlier.json"
    earlier.write_text(json.dumps({"a": "record written before"}))
    # steps enough to outlast a starved test process between the first step and the fill (the fill ends it)
    argv = [*RUN, "--steps", "400", "--step-delay", "0.05", "--timeout", "120", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", *argv],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not any(
        e["event"] == "step" for p in out.glob("logs/*/rank0.events.jsonl") for e in read_events(p)
    ):
        time.sleep(0.2)
    subprocess.run(["dd", "if=/dev/zero", f"of={out / 'filler'}", "bs=64k"], capture_output=True)  # to full
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 1
    assert (
        err.strip().splitlines()[-1] == f"harness: error: cannot write under {out}: No space left on device"
    )
    assert earlier.read_text() == json.dumps({"a": "record written before"})
    assert not [p for p in out.rglob("*") if p.name.startswith(".") and p.suffix == ".tmp"]  # no half file
    assert not leftovers(out, wait_s=5)

    again = harness("run", *RUN, "--steps", "2", "--out", out)
    assert again.returncode == 1 and again.stderr.strip().splitlines() == [
        f"harness: error: cannot write under {out}: No space left on device"
    ], again.stderr


@pytest.mark.unit
@pytest.mark.subprocess  # mount
def test_a_record_that_cannot_be_written_is_kept_in_the_temp_dir_and_says_so(small_filesystem):
    """Space for the ranks but not for the record: nothing half-written where it was asked, the record
    kept in the temp dir, and the line the commands print says both."""
    from record_factory import make_record

    from harness.run.record import record_line, save_record

    subprocess.run(["dd", "if=/dev/zero", f"of={small_filesystem / 'filler'}", "bs=64k"], capture_output=True)
    record = make_record(gpus=2)
    record["run_id"] = "full-1"
    record["environment"]["padding"] = "x" * 10_000  # more than the filled filesystem has left
    target = small_filesystem / "full-1.json"
    saved = save_record(record, target)
    kept = Path(saved["unwritten"]["kept_at"])
    assert not target.exists() and sorted(p.name for p in small_filesystem.iterdir()) == ["filler"]
    assert json.loads(kept.read_text())["environment"]["padding"] == "x" * 10_000
    assert record_line(saved, target) == (
        f"record: NOT written to {target} (No space left on device); kept at {kept}"
    )
    kept.unlink()


@pytest.mark.unit
def test_a_run_with_test_hooks_says_so_in_its_record_summary_and_comparison(tmp_path):
    """Test hooks are no part of the configuration: the record names them at its top level, its summary
    opens with them, and a comparison names a slowed side (older records kept them in their config)."""
    import io

    from record_factory import config, environment, make_record, rank_record

    from backends import get_backend
    from core.config import SECTION_OF, SECTIONS
    from core.records import migrate
    from harness.analyze.compare import env_differences
    from harness.analyze.summary import print_summary
    from harness.arguments import hooks_from_args
    from harness.run.record import assemble_record

    hooks = TestHooks(fault={"rank": 1, "step": 2, "kind": "hang"}, step_delay_s=0.05)
    hooks.write(tmp_path)
    assert TestHooks.read(tmp_path) == hooks and TestHooks.read(tmp_path / "none") == TestHooks()
    assert not TestHooks(step_delay_s=0.0).active and TestHooks().to_dict() is None
    args = type("Args", (), {"inject_fault": hooks.fault, "step_delay": 0.05})()
    assert hooks_from_args(args) == hooks
    cfg = config("torch-ddp", 1)
    slowed = assemble_record(
        get_backend("torch-ddp"),
        cfg,
        "slowed",
        [rank_record(0, [0.1] * 4)],
        environment=environment(),
        test_hooks=hooks.to_dict(),
    )
    assert slowed["test_hooks"] == {"fault": hooks.fault, "step_delay_s": 0.05}
    assert not {"fault", "step_delay_s"} & set(SECTION_OF)  # no section of a user's config holds them
    printed = io.StringIO()
    print_summary(slowed, printed)
    assert "TEST HOOKS (not a real run)" in printed.getvalue()
    # A schema-3 record (flat config) from before the hooks left the config: migration moves them out.
    real = make_record()
    flat = {k: v for name in SECTIONS for k, v in real["config"][name].items()}
    flat.update(backend=real["config"]["backend"], backend_options=real["config"]["backend_options"])
    flat["step_delay_s"] = 0.02
    old = migrate({**real, "schema_version": 3, "config": flat})
    assert old["test_hooks"] == {"step_delay_s": 0.02} and old["config"] == real["config"]
    assert env_differences([real], [slowed]) == [
        "step_delay_s: 0.0 -> 0.05",
        "fault: None -> {'rank': 1, 'step': 2, 'kind': 'hang'}",
    ]
    assert env_differences([real], [old]) == ["step_delay_s: 0.0 -> 0.02"]
