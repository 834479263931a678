"""`harness plan` (a dry run that writes nothing, for every backend, also for GPUs this machine lacks), and a
backend's option given to a run of another backend (a usage error; a sweep may take every swept backend's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import REPO

import harness.run.commands as commands
from backends import backend_names, get_backend
from harness.cli import main, make_parser
from harness.run.sweep import plan as sweep_plan
from harness.usage import UsageError

pytestmark = pytest.mark.unit

LAYOUTS = {
    "1node-cpu": ["--gpus", "2", "--device", "cpu"],
    "2nodes-cpu": (
        "--nodes 2 --gpus-per-node 1 --hosts a,b --master a:29500 --run-id plan-x --device cpu"
    ).split(),
    "2nodes-cuda8": (
        "--nodes 2 --gpus-per-node 8 --hosts a,b --master a:29500 --run-id plan-x --device cuda"
    ).split(),
}


def snapshot(*dirs: Path) -> set[Path]:
    return {p for d in dirs if d.exists() for p in d.rglob("*")}


def plan(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`harness plan ARGV` in this process; each node's `harness run` line repeats ARGV."""
    monkeypatch.setattr(sys, "argv", ["pytest", "not", "these"])  # the plan must not read the process's argv
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("backend", backend_names())
def test_plan_exits_0_and_writes_nothing(backend, layout, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the cuda plan is made for another machine
    results = tmp_path / "results"
    before = snapshot(tmp_path, REPO / "results")
    argv = ["--backend", backend, *LAYOUTS[layout], "--out", str(results)]
    code, out, err = plan(argv, monkeypatch, capsys)
    assert code == 0, err
    assert snapshot(tmp_path, REPO / "results") == before, "harness plan wrote files"
    nodes = 2 if layout.startswith("2nodes") else 1
    for r in range(nodes):
        assert f"\nnode {r} (" in out
    if nodes > 1:
        assert "--node-rank 1 --run-id plan-x" in out
        assert f"harness run --backend {backend}" in out
        if get_backend(backend).starts_remote_ranks:
            assert "which starts no process(es)" in out and "after node 0's launcher has exited" in out
    # a stack whose trace instrument costs time once enabled traces in a launch of its own, shown as such
    own = "then the collective trace, in a launch of its own"
    assert (own in out) == get_backend(backend).traces_in_own_launch, out


@pytest.mark.parametrize(
    "layout, slots, include",
    [("2nodes-cpu", 1, None), ("2nodes-cuda8", 8, "--include=a:0,1,2,3,4,5,6,7@b:0,1,2,3,4,5,6,7")],
)
def test_deepspeed_plan_shows_its_hostfile_instead_of_writing_it(
    layout, slots, include, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    results = tmp_path / "results"
    argv = ["--backend", "deepspeed", *LAYOUTS[layout], "--out", str(results)]
    code, out, err = plan(argv, monkeypatch, capsys)
    assert code == 0, err
    hostfile = (results / "logs" / "plan-x" / "hostfile").resolve()
    assert f"file {hostfile}:\n      | a slots={slots}\n      | b slots={slots}\n" in out
    assert out.count(f"--hostfile={hostfile}") == 2  # both nodes' launchers read it
    if include:
        assert out.count(include) == 2
    assert not hostfile.exists() and not results.exists()


@pytest.mark.parametrize(
    "argv, owner",
    [
        (["run", "--backend", "torch-fsdp", "--zero-stage", "1"], "deepspeed"),
        (["run", "--backend", "torch-ddp", "--hvd-compression", "fp16"], "horovod"),
        (["plan", "--backend", "paddle-fleet", "--xla"], "tf-mwms"),
    ],
)
def test_an_option_of_another_backend_is_a_usage_error(argv, owner, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(commands, "execute", refuse)  # should the check ever let it through
    monkeypatch.setattr(commands, "run_node", refuse)
    assert main([*argv, "--out", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error:") and f"of backend {owner}" in err[0], err
    assert not (tmp_path / "results").exists()


def test_a_sweep_takes_the_options_of_every_backend_it_sweeps(monkeypatch):
    for name in ("torch-ddp", "deepspeed"):  # plannable whatever is installed here
        monkeypatch.setattr(type(get_backend(name)), "availability", lambda self, python=None: (True, ""))
    args = make_parser().parse_args(
        "sweep --backends torch-ddp,deepspeed --zero-stage 1 --gpus 1 --repeats 1 --device cpu".split()
    )
    runs, skipped = sweep_plan(args)
    assert skipped == {}
    options = {r.backend.name: r.cfg.backend_options for r in runs}
    assert options["deepspeed"]["zero_stage"] == 1
    assert "zero_stage" not in options["torch-ddp"]
    assert [r.backend.label(r.cfg) for r in runs] == ["torch-ddp", "deepspeed-zero1"]


def test_a_sweep_refuses_an_option_of_a_backend_it_does_not_sweep():
    args = make_parser().parse_args(
        ["sweep", "--backends", "torch-ddp", "--zero-stage", "1", "--gpus", "1", "--device", "cpu"]
    )
    with pytest.raises(UsageError, match="--zero-stage is an option of backend deepspeed, not of torch-ddp"):
        sweep_plan(args)


@pytest.mark.unit
def test_a_plan_made_without_gpus_says_auto_was_resolved_here_and_how_to_plan_for_gpus(capsys, monkeypatch):
    """On a login node (no GPU), --device auto resolves to cpu here; the plan says so instead of
    presenting a CPU run as the target's."""
    monkeypatch.setattr("harness.run.options.resolve_device", lambda requested, per_node: "cpu")
    assert (
        main(["plan", "--backend", "torch-ddp", "--nodes", "2", "--gpus-per-node", "8", "--hosts", "a,b"])
        == 0
    )
    out = capsys.readouterr().out
    assert "--device auto was resolved on this machine (cpu)" in out and "--device cuda" in out
