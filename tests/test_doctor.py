"""`harness doctor`: every check says what it ran, what it expected and what it got; a failed check (an
unreachable host, a busy master port, a missing framework) makes it exit 1."""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest
from conftest import harness

from backends.deepspeed_zero import STALE_LOCK_S, extensions_lock_check
from core.process import free_port
from harness.cli import main
from harness.run.doctor import data_check, import_check


def test_doctor_runs_every_check_and_fails_on_an_unreachable_host_and_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = harness(
            "doctor",
            "--backends",
            "torch-ddp",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--device",
            "cpu",
            "--hosts",
            "127.0.0.1,no-such-host.invalid",
            "--master",
            f"127.0.0.1:{port}",
            "--out",
            tmp_path / "results",
            timeout=240,
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    checks = {
        line[7:].split("  ran:")[0].strip(): line[1:5].strip() for line in lines if line.startswith("[")
    }
    assert checks == {
        "framework torch": "ok",
        "devices": "ok",
        "collective (gloo)": "ok",
        "ports": "FAIL",
        "host 127.0.0.1": "ok",
        "host no-such-host.invalid": "FAIL",
        "data": "ok",
        "disk for results": "ok",
    }, proc.stdout
    assert all("ran:" in line for line in lines if line.startswith("["))
    assert sum("expected:" in line and "got:" in line for line in lines) == len(checks)
    assert "every rank gets the sum 3; got: all_reduce sum 3 on 2 rank(s)" in proc.stdout
    assert "cannot resolve" in proc.stdout and "in use" in proc.stdout
    assert lines[-1] == "doctor: 8 checks, 2 failed: ports, host no-such-host.invalid"


def test_doctor_passes_on_a_sound_plan(tmp_path):
    proc = harness(
        "doctor",
        "--backends",
        "torch-ddp",
        "--gpus",
        "2",
        "--device",
        "cpu",
        "--master",
        f"127.0.0.1:{free_port()}",
        "--out",
        tmp_path,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "doctor: 6 checks, 0 failed"


def test_a_missing_framework_fails_only_when_its_backend_was_asked_for():
    assert import_check("no_such_framework_xyz", required=True).status == "FAIL"
    assert import_check("no_such_framework_xyz", required=False).status == "warn"
    assert import_check("json", required=True).status == "ok"


@pytest.mark.unit
def test_data_check_reads_the_token_file_as_the_ranks_do(tmp_path):
    path = tmp_path / "train.bin"
    (np.arange(100_000) % 2048).astype(np.uint16).tofile(path)  # tiny: vocab 2048, 129 tokens per sample
    ok = data_check(path, "tiny", 2, 8, 1)
    assert ok.status == "ok" and ok.got == "100,000 tokens"
    assert data_check(path, "tiny", 64, 16, 1).status == "warn"  # 1,024 x 129 tokens: wraps in step 0
    bad = tmp_path / "bad.bin"
    np.full(10_000, 4000, np.uint16).tofile(bad)  # token ids past tiny's vocabulary
    assert (
        data_check(bad, "tiny", 2, 8, 1).status == "FAIL"
        and "vocab_size 2048" in data_check(bad, "tiny", 2, 8, 1).got
    )
    assert data_check(tmp_path / "missing.bin", "tiny", 2, 8, 1).status == "FAIL"
    assert data_check(None, "tiny", 2, 8, 1).got == "synthetic tokens: nothing to read here"


@pytest.mark.unit
def test_a_killed_op_builds_lock_is_found_before_deepspeed_runs_hang_on_it(tmp_path):
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    now = time.time()
    assert extensions_lock_check(tmp_path, True, now).status == "ok"
    lock.touch()
    assert extensions_lock_check(tmp_path, True, now).status == "ok"  # a build under way holds it
    os.utime(lock, (now - STALE_LOCK_S - 1, now - STALE_LOCK_S - 1))
    stale = extensions_lock_check(tmp_path, True, now)
    assert stale.status == "FAIL" and f"rm {lock}" in stale.got
    assert extensions_lock_check(tmp_path, False, now).status == "warn"  # deepspeed was not asked for


@pytest.mark.unit
def test_unknown_backend_is_a_usage_error(capsys):
    assert main(["doctor", "--backends", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err
