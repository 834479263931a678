"""Defects found on clusters (issue 15): an unwritable --out, a reader that hangs up, records a team cannot
read, thread counts sized from the host instead of the CPUs a job was given, oversubscription unlabelled."""

from __future__ import annotations

import os
import sys

import pytest
from record_factory import assemble, config, environment, rank_record

from core.process import available_cpus
from core.records import write_json_atomic
from harness.analyze.metrics import summarize
from harness.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_an_unwritable_out_is_one_line_before_anything_launches(command, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["--backends" if command == "sweep" else "--backend", "torch-ddp", "--gpus", "1"]
    code = main([command, *args, "--out", str(blocker / "results")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot write records there (Not a directory)" in err[0], err


def test_a_reader_that_hangs_up_ends_the_output_quietly(monkeypatch, capsys):
    """`harness plan ... | head`: the pipe's reader is gone before the plan is printed."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    gone = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", gone)
    try:
        assert main(["plan", "--backend", "torch-ddp", "--gpus", "2", "--device", "cpu"]) == 0
    finally:
        gone.close()
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_records_get_the_mode_the_umask_gives(umask, mode, tmp_path):
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "record.json", {"a": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "record.json").stat().st_mode & 0o777 == mode


@pytest.mark.parametrize(
    "cpu_max,expected", [(None, 4), ("max 100000", 4), ("150000 100000", 2), ("50000 100000", 1)]
)
def test_available_cpus_are_the_affinity_capped_by_the_cgroup_quota(cpu_max, expected, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    path = tmp_path / "cpu.max"
    if cpu_max:
        path.write_text(cpu_max + "\n")
    assert available_cpus(path) == expected


def test_default_threads_per_worker_come_from_the_cpus_given_not_the_host(monkeypatch, tmp_path, capsys):
    import harness.arguments.request as request

    monkeypatch.setattr(request, "available_cpus", lambda: 8)  # this host has 2
    assert (
        main(["plan", "--backend", "torch-ddp", "--gpus", "2", "--device", "cpu", "--out", str(tmp_path)])
        == 0
    )
    shown = capsys.readouterr().out
    assert "OMP_NUM_THREADS=4" in shown  # 8 CPUs given // 2 workers


def oversubscription(world: int, threads: int, cpus: int | None, device: str = "cpu") -> dict | None:
    cfg = config("torch-ddp", world, steps=4, threads_per_worker=threads, device=device)
    ranks = [rank_record(r, [0.1] * 4) for r in range(world)]
    env = environment(world=world, cpus_available=cpus)
    return summarize(assemble(cfg, "run", ranks, environment=env))["cpu_oversubscribed"]


def test_cpu_oversubscription_is_said_in_the_record():
    assert oversubscription(4, 1, 2) == {"workers_per_node": 4, "threads_per_worker": 1, "cpus": 2}
    assert oversubscription(2, 2, 2) == {"workers_per_node": 2, "threads_per_worker": 2, "cpus": 2}
    assert oversubscription(2, 1, 2) is None  # 2 workers x 1 thread on 2 CPUs: fits
    assert oversubscription(4, 1, 2, device="cuda") is None
