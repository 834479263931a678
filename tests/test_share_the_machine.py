"""The suite's own rule for running two test processes at once (tests/conftest.py): tests share the machine,
a `timing` test has it alone, and a reference launched for several modules is launched once."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import pytest
from conftest import REPO, launched_once, share_the_machine

HOLD_S = 1.5
# A second test process: it takes the machine (shared, or alone with `alone`), says so, holds it a while,
# and prints when it let go.
HOLDER = f"""
import sys, time
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
from conftest import share_the_machine
with share_the_machine(alone=sys.argv[1] == "alone"):
    print("in", flush=True)
    time.sleep({HOLD_S})
    print(time.monotonic(), flush=True)
"""


@pytest.fixture
def own_run(tmp_path, monkeypatch):
    """A test run of its own: its id, and its lock files in tmp_path (for this process and its children)."""
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "share-test")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def hold(alone: bool) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, "alone" if alone else "shared"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "in"
    return proc


def released_at(proc: subprocess.Popen) -> float:
    out, _ = proc.communicate(timeout=30)
    return float(out.split()[-1])


@pytest.mark.unit
@pytest.mark.subprocess
def test_a_timing_test_waits_for_the_running_test_and_others_wait_for_it(own_run):
    other = hold(alone=False)  # a test running in the other process
    with share_the_machine(alone=True):  # a timing test starts: it gets in once the other has let go
        entered = time.monotonic()
    assert entered >= released_at(other)
    timing = hold(alone=True)
    with share_the_machine(alone=False):  # and no test starts beside a timing test
        entered = time.monotonic()
    assert entered >= released_at(timing)


@pytest.mark.unit
@pytest.mark.subprocess
def test_tests_that_share_run_side_by_side(own_run):
    other = hold(alone=False)
    with share_the_machine(alone=False):
        entered = time.monotonic()
    assert entered < released_at(other)  # in while the other still held it


@pytest.mark.unit
def test_a_reference_is_launched_once_and_a_failed_launch_is_tried_again(own_run, monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "_launched", {})
    launches = []

    def fails():
        launches.append("failed")
        raise RuntimeError("the launch failed")

    with pytest.raises(RuntimeError):
        launched_once("ref", fails)
    assert launched_once("ref", lambda: launches.append("ok") or {"run_id": "r1"}) == {"run_id": "r1"}
    monkeypatch.setattr(conftest, "_launched", {})  # as the other test process, which reads the saved one
    assert launched_once("ref", lambda: launches.append("again") or {"run_id": "r2"}) == {"run_id": "r1"}
    assert launches == ["failed", "ok"]
