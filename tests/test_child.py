"""harness.run.child: `harness ARGS` as a child and the record it wrote, on a fake distbench tree whose
harness/__main__.py does what each test tells it (print, write a record into --out, exit, hang, ignore
SIGTERM), so nothing here launches a training run.

The fake copies a record made by record_factory (a real record's shape) into its --out, so what the helper
returns is compared with a known record: losing it, loading another, or misreading the exit code fails.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import record_factory as factory

from core.records import RecordError, write_json_atomic
from harness.run import child
from harness.run.child import harness_argv, last_line, run_child, start_child

pytestmark = [pytest.mark.unit, pytest.mark.subprocess]

# The fake harness: reads its orders from FAKE_ORDERS (a JSON file beside it): `say` printed (stdout) and
# `err` (stderr), `record` (a file) copied into --out as `name`, `other` written there too (not a record),
# `sleep` seconds (in a grandchild too, whose pid goes to `pidfile`), SIGTERM ignored or answered with
# `on_term` (a record file written, then exit 143), then exit `code`. Its argv goes to argv.json.
FAKE_MAIN = """
import json, os, pathlib, shutil, signal, subprocess, sys, time
here = pathlib.Path(__file__).resolve().parents[1]
orders = json.loads((here / "orders.json").read_text())
args = sys.argv[1:]
(here / "argv.json").write_text(json.dumps(args))
out = pathlib.Path(args[args.index("--out") + 1]) if "--out" in args else None
print(orders.get("say", ""), flush=True)
print(orders.get("err", ""), file=sys.stderr, flush=True)
if orders.get("other") and out:
    (out / "notes.json").write_text("{}")
if orders.get("record") and out:
    shutil.copy(orders["record"], out / orders.get("name", "run-1.json"))
if orders.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if orders.get("on_term"):
    def stop(signum, frame):
        shutil.copy(orders["on_term"], out / "stopped.json")
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
if orders.get("pidfile"):
    grandchild = subprocess.Popen(["sleep", "60"])
    pathlib.Path(orders["pidfile"]).write_text(str(grandchild.pid))
if orders.get("sleep"):
    end = time.monotonic() + orders["sleep"]
    while time.monotonic() < end:
        time.sleep(0.05)
sys.exit(orders.get("code", 0))
"""


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "tree"
    (root / "harness").mkdir(parents=True)
    (root / "harness" / "__init__.py").write_text("")
    (root / "harness" / "__main__.py").write_text(FAKE_MAIN)
    return root


def record_file(tmp_path: Path, status: str = "ok", run_id: str = "known-run") -> Path:
    """A real record's shape, with a run id to recognise it by."""
    path = tmp_path / f"{run_id}.template"
    write_json_atomic(path, factory.make_record(gpus=2, status=status, run_id=run_id))
    return path


def orders(tree: Path, **what) -> None:
    (tree / "orders.json").write_text(
        json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in what.items()})
    )


def test_argv_runs_the_importable_harness_or_a_trees_own():
    assert harness_argv("run", "--gpus", "2") == [sys.executable, "-m", "harness", "run", "--gpus", "2"]
    argv = harness_argv("plan", tree="/src/other", python="/usr/bin/python3")
    assert argv[:2] == ["/usr/bin/python3", "-c"] and argv[2] == child.BOOTSTRAP
    assert argv[3:] == ["/src/other", "plan"]


def test_an_ok_run_returns_its_record_its_exit_code_and_its_output(tree, tmp_path):
    orders(tree, say="step 5/5", err="a warning", record=record_file(tmp_path))
    out = tmp_path / "out"
    out.mkdir()
    (out / "older.json").write_text("{}")  # there before the run: not its record
    done = run_child(["run", "--backend", "torch-ddp"], out, tree=tree)
    assert (done.returncode, done.status, done.ok, done.why, done.timed_out) == (0, "ok", True, "", False)
    assert done.path == out / "run-1.json" and done.record["run_id"] == "known-run"
    assert done.record["config"]["topology"]["world_size"] == 2  # loaded whole, not trimmed
    assert "step 5/5" in done.output and "a warning" in done.output  # stdout and stderr, both captured
    assert json.loads((tree / "argv.json").read_text()) == [
        "run",
        "--backend",
        "torch-ddp",
        "--out",
        str(out),
    ]
    assert done.seconds > 0


def test_a_failed_run_keeps_its_record_and_says_why(tree, tmp_path):
    orders(tree, record=record_file(tmp_path, status="failed"), code=1)
    done = run_child(["run"], tmp_path / "out", tree=tree)
    assert (done.returncode, done.status, done.ok) == (1, "failed", False)
    assert done.record["run_id"] == "known-run" and done.why.startswith("RuntimeError")


def test_an_ok_record_with_a_failing_exit_code_is_not_ok(tree, tmp_path):
    orders(tree, record=record_file(tmp_path), code=1)
    done = run_child(["run"], tmp_path / "out", tree=tree)
    assert done.record is not None and done.status == "ok" and not done.ok


def test_a_refused_run_has_no_record_and_its_error_line(tree, tmp_path):
    orders(tree, err="harness: error: unknown workload 'huge'", code=2)
    done = run_child(["run"], tmp_path / "out", tree=tree)
    assert (done.returncode, done.record, done.path, done.ok) == (2, None, None, False)
    assert done.status == "no record (exit 2)" and done.why == "unknown workload 'huge'"


def test_two_new_files_are_no_record_and_a_stranger_alone_is_an_error(tree, tmp_path):
    orders(tree, record=record_file(tmp_path), other=True)
    done = run_child(["run"], tmp_path / "out", tree=tree)
    assert (done.record, done.path, done.status, done.ok) == (None, None, "no record (exit 0)", False)
    orders(tree, other=True)
    with pytest.raises(RecordError):  # the one new file is no record: never taken for the run's
        run_child(["run"], tmp_path / "o2", tree=tree)


def test_output_to_a_log_or_streamed(tree, tmp_path, capfd):
    orders(tree, say="to the log", record=record_file(tmp_path))
    log = tmp_path / "logs" / "run.log"
    done = run_child(["run"], tmp_path / "out", tree=tree, log=log)
    assert "to the log" in log.read_text() and "to the log" in done.output and done.ok
    orders(tree, say="to the terminal")
    done = run_child(["run"], None, tree=tree, stream=True)
    assert done.output == "" and "to the terminal" in capfd.readouterr().out
    assert "--out" not in json.loads((tree / "argv.json").read_text())  # no out: no --out, no record
    assert (done.record, done.status) == (None, "no record (exit 0)")


def test_a_timeout_ends_the_run_which_writes_its_record(tree, tmp_path):
    orders(tree, on_term=record_file(tmp_path, status="timeout"), sleep=60)
    start = time.monotonic()
    done = run_child(["run"], tmp_path / "out", tree=tree, timeout_s=1.5, grace_s=20)
    assert time.monotonic() - start < 15
    assert done.timed_out and done.returncode == 143 and done.status == "timeout"
    assert done.path == tmp_path / "out" / "stopped.json"


def test_a_run_deaf_to_sigterm_is_killed_with_its_process_group(tree, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    orders(tree, ignore_term=True, sleep=60, pidfile=pidfile)
    done = run_child(["run"], tmp_path / "out", tree=tree, timeout_s=1.5, grace_s=1, own_group=True)
    assert done.timed_out and done.returncode == -signal.SIGKILL
    assert done.status == "no record (exit -9, timed out)"
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the run's grandchild outlived the kill of its group"
        time.sleep(0.1)


def test_a_sigterm_to_the_caller_is_passed_on(tree, tmp_path, monkeypatch):
    """Once the caller was told to stop (harness.run.launch.stopped), the run is sent SIGTERM and its
    record of the stop is the one returned."""
    orders(tree, on_term=record_file(tmp_path, status="timeout"), sleep=60)
    monkeypatch.setattr(child, "stopped", lambda: "SIGTERM from outside")
    started = start_child(["run"], tmp_path / "out", tree=tree)
    done = started.finish(timeout_s=30)
    assert not done.timed_out and done.returncode == 143 and done.record["status"] == "timeout"


def test_last_line_prefers_the_error_line():
    assert last_line("a\nharness: error: bad flag\nTraceback\n") == "bad flag"
    assert last_line("one\ntwo\n\n") == "two" and last_line("") == "(no output)"
