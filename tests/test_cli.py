"""Bad input: one line naming the valid choices, exit 2, nothing written; the harness process imports no
framework."""

import subprocess
import sys

import pytest
from conftest import REPO

from harness.cli import COMMANDS, main, make_parser

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "args,expected",
    [
        (["run", "--backend", "nope"], "unknown backend 'nope'; valid: torch-ddp"),
        (
            ["run", "--backend", "torch-ddp", "--workload", "huge"],
            "unknown workload 'huge'; valid: tiny, small, 350m, 1b",
        ),
        (
            ["run", "--backend", "torch-ddp", "--precision", "fp8"],
            "unknown precision 'fp8'; valid: fp32, bf16, fp16",
        ),
        (
            ["run", "--backend", "torch-ddp", "--device", "tpu"],
            "unknown device 'tpu'; valid: auto, cuda, cpu",
        ),
        (["run", "--backend", "torch-ddp", "--gpus", "0"], "expected a positive integer"),
        (["run", "--backend", "torch-ddp", "--heads", "3"], "divisible"),
        (["run", "--backend", "torch-ddp", "--gpus", "2", "--global-batch", "3"], "not divisible"),
        (["run", "--backend", "torch-ddp", "--data", "/no/such/file"], "no such file"),
        (["run", "--backend", "torch-ddp", "--inject-fault", "1:2:boom"], "unknown fault kind"),
        (
            ["run", "--backend", "torch-fsdp", "--zero-stage", "1"],
            "--zero-stage is an option of backend deepspeed",
        ),
        (
            ["run", "--backend", "torch-ddp", "--hvd-compression", "fp16"],
            "--hvd-compression is an option of backend horovod",
        ),
        (
            "run --backend tf-mwms --nodes 2 --gpus-per-node 1 --master a:1 --node-rank 0 --run-id x".split(),
            "tf-mwms on 2 nodes needs the host of every node",
        ),
        (["run", "--backend", "torch-ddp", "--device", "cuda", "--gpus", "64"], "GPU(s) visible"),
        (["run", "--backend", "torch-ddp", "--warmup", "-1"], "expected an integer >= 0, got -1"),
        (["run", "--backend", "torch-ddp", "--compute-steps", "-1"], "expected an integer >= 0, got -1"),
        (["run", "--backend", "torch-ddp", "--timeout", "-5"], "seconds > 0, got -5"),
        (["run", "--backend", "torch-ddp", "--collective-timeout", "0"], "seconds > 0, got 0"),
        (["sweep", "--backends", "torch-ddp", "--gpus", "1", "--timeout", "-5"], "seconds > 0, got -5"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args, expected, out, capsys):
    code = main([*args, "--out", str(out)] if args[0] == "run" else args)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harness: error:") and expected in lines[0], err
    assert not out.exists(), "a usage error must not write anything"


def test_list_shows_backends_and_workload_parameter_counts(capsys):
    assert main(["list"]) == 0
    shown = capsys.readouterr().out
    assert "torch-ddp" in shown and "1,071,872" in shown and "1,315,819,520" in shown


def packages_imported(setup: str, packages: set[str]) -> list[str]:
    """Which of `packages` a fresh interpreter has imported after running `setup` (its last output line)."""
    imported = "{m.split('.')[0] for m in sys.modules}"
    code = f"import sys; {setup}; print(' '.join(sorted({packages!r} & {imported})))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()[-1].split()


@pytest.mark.subprocess
def test_harness_imports_no_framework():
    setup = (
        "from harness.cli import make_parser; import harness.run.runner, harness.analyze.metrics; "
        "make_parser(); import backends; [b.availability() for b in backends.all_backends()]"
    )
    assert packages_imported(setup, {"torch", "tensorflow", "paddle", "deepspeed", "horovod"}) == []


def commands_of(parser) -> set[str]:
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return set(action.choices)


def test_every_command_is_dispatched_to_the_module_that_registers_it():
    """The dispatch table is the command list: a command registered by a module but missing from it (or
    listed under another module) would be unreachable or fail to parse."""
    assert commands_of(make_parser()) == set(COMMANDS)
    for command, module in COMMANDS.items():
        assert command in commands_of(make_parser(command)), (command, module)


@pytest.mark.subprocess
def test_harness_run_starts_without_the_analysis_libraries():
    """pandas, scipy, tensorboard and matplotlib cost a run's start about 1 s (measured 5.0 s -> 3.8 s for a
    tiny 1-rank run); only the commands that analyse import them."""
    setup = "from harness.cli import main; main(['list'])"  # `list` is in `run`'s module
    assert packages_imported(setup, {"pandas", "scipy", "tensorboard", "matplotlib"}) == []
