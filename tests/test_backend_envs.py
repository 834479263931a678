"""Each backend may run from its own environment (backends/interpreter.py): the run's --python, else
DISTBENCH_PYTHON_<BACKEND>, else .venvs/<stack>, else the harness's own. Launchers and workers start with
that interpreter, and whether the stack is installed (and its version) is asked of it, not of the harness.

The live tests make real second environments from the base interpreter: one that sees the main venv's
packages through a .pth file (so it imports torch without installing it), and a bare one that has none."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from argparse import Namespace
from pathlib import Path

import pytest
from conftest import REPO, run_record
from test_device_contract import node_configs

from backends import backend_names, get_backend, interpreter
from backends.horovod_torch import Horovod
from core.records import run_config
from harness.arguments import worker_python
from harness.cli import main
from harness.run.runner import isolated_plans, node_plan

BASE_PYTHON = getattr(sys, "_base_executable", None) or sys.executable


def make_venv(folder: Path, sees_main_packages: bool) -> str:
    """A real venv (no pip: seconds), made from the base interpreter; with `sees_main_packages` a .pth file
    adds the main venv's site-packages as a site dir (its own .pth files included)."""
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    if sees_main_packages:
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        main_site = sysconfig.get_paths()["purelib"]
        Path(site, "distbench-main-venv.pth").write_text(f"import site; site.addsitedir({main_site!r})\n")
    return str(python)


@pytest.fixture(scope="module")
def venvs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("venvs")
    return {"second": make_venv(root / "second", True), "bare": make_venv(root / "bare", False)}


# ------------------------------------------------------------------------------------------- live runs
def test_a_run_s_launcher_and_ranks_run_under_the_interpreter_it_names(venvs, out):
    """A 2-rank torch-ddp run with --python: torchrun and both ranks ran in the second environment (each
    rank records its sys.executable), and the record's config says which it was."""
    second = venvs["second"]
    assert os.path.abspath(second) != os.path.abspath(sys.executable)
    rec = run_record(
        out,
        *("--backend", "torch-ddp", "--gpus", "2", "--device", "cpu", "--python", second),
        *("--steps", "2", "--warmup", "1", "--compute-method", "none", "--no-trace-comm"),
        *("--threads-per-worker", "1", "--timeout", "120"),
        timeout=180,
    )
    assert rec["status"] == "ok" and run_config(rec).topology.python == second
    assert [r["interpreter"] for r in rec["ranks"]] == [second, second]


def test_availability_and_versions_are_asked_of_each_backend_s_interpreter(venvs):
    """`harness list` with DISTBENCH_PYTHON_*: torch-ddp in the bare venv is unavailable though the harness's
    own interpreter has torch; tf-mwms in the second one is available, with the version installed there; the
    table says where each choice came from and the paths follow it. A run refuses the unavailable one."""
    env = {
        **os.environ,
        "DISTBENCH_PYTHON_TORCH_DDP": venvs["bare"],
        "DISTBENCH_PYTHON_TF_MWMS": venvs["second"],
    }
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "list"], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("│ ")}
    assert (
        "DISTBENCH_PYTHON_TORCH_DDP" in rows["torch-ddp"] and "no: not installed: torch" in rows["torch-ddp"]
    )
    assert "DISTBENCH_PYTHON_TF_MWMS" in rows["tf-mwms"] and "yes (tensorflow 2." in rows["tf-mwms"]
    assert "harness" in rows["torch-fsdp"] and "yes (torch " in rows["torch-fsdp"]  # the harness's own
    shown = proc.stdout.splitlines()
    interpreters = next(line for line in shown if line.startswith("interpreters: "))
    assert f"DISTBENCH_PYTHON_TORCH_DDP = {venvs['bare']}" in interpreters
    assert f"DISTBENCH_PYTHON_TF_MWMS = {venvs['second']}" in interpreters
    run = subprocess.run(
        [sys.executable, "-m", "harness", "run", "--backend", "torch-ddp", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert run.returncode == 2 and run.stderr.strip() == (
        f"harness: error: backend torch-ddp is unavailable here: not installed: torch (in {venvs['bare']})"
    )


# ------------------------------------------------------------------------------------------------- units
def fake_venv(folder: Path) -> str:
    """A folder laid out as a venv, with an executable bin/python (never run: plans start nothing)."""
    (folder / "bin").mkdir(parents=True)
    (folder / "pyvenv.cfg").write_text("home = /usr/bin\n")
    python = folder / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return str(python)


@pytest.mark.unit
@pytest.mark.parametrize("backend", backend_names())
def test_every_launcher_and_worker_starts_with_the_run_s_interpreter(backend, tmp_path, monkeypatch):
    """The run's and the isolated workers' processes, on every node: the launcher (or, for horovodrun, the
    horovodrun beside it and the workers' command) is the chosen interpreter, and DeepSpeed's JIT ops live in
    that environment."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    other = fake_venv(tmp_path / "other")
    for cfg in node_configs(backend, 2, "cpu", "--compute-method", "isolated", "--python", other):
        assert cfg.topology.python == other
        adapter = get_backend(backend)
        plans = [
            node_plan(adapter, cfg, tmp_path / "run", 29500),
            *isolated_plans(adapter, cfg, tmp_path / "run"),
        ]
        for proc in (p for plan in plans for p in plan.processes):
            if backend == "horovod":
                assert proc.argv[0] == str(tmp_path / "other" / "bin" / "horovodrun")
                assert proc.argv[proc.argv.index("--gloo-timeout-seconds") + 2] == other
            else:
                assert proc.argv[0] == other, proc.argv
            if backend == "deepspeed":
                assert proc.env["TORCH_EXTENSIONS_DIR"] == str(
                    tmp_path / "other" / "distbench" / "torch_extensions"
                )


def args(*pythons: str) -> Namespace:
    return Namespace(python=list(pythons) or None)


@pytest.mark.unit
def test_the_interpreter_is_the_flag_s_then_the_variable_s_then_the_stack_s_then_the_harness_s(
    tmp_path, monkeypatch
):
    flag, var, tf_stack = (
        fake_venv(tmp_path / "flag"),
        fake_venv(tmp_path / "var"),
        fake_venv(tmp_path / "s" / "tf"),
    )
    monkeypatch.setattr(interpreter, "STACKS_DIR", tmp_path / "s")
    monkeypatch.setenv("DISTBENCH_PYTHON_TF_MWMS", var)
    monkeypatch.delenv("DISTBENCH_PYTHON_TORCH_DDP", raising=False)
    in_use = ["tf-mwms", "torch-ddp"]
    assert worker_python(args(flag), "tf-mwms", in_use) == flag
    assert worker_python(args(f"torch-ddp={flag}"), "tf-mwms", in_use) == var  # named for another backend
    assert worker_python(args(), "tf-mwms", in_use) == var
    assert interpreter.configured("tf-mwms", "tensorflow") == (var, "DISTBENCH_PYTHON_TF_MWMS")
    monkeypatch.delenv("DISTBENCH_PYTHON_TF_MWMS")
    assert interpreter.configured("tf-mwms", "tensorflow") == (tf_stack, str(tmp_path / "s" / "tf"))
    assert interpreter.configured("torch-ddp", "torch") == (sys.executable, "harness")  # no .venvs/torch
    assert worker_python(args(flag, f"torch-ddp={var}"), "torch-ddp", in_use) == var  # BACKEND= first


@pytest.mark.unit
@pytest.mark.parametrize(
    "given, message",
    [
        (["/no/such/python"], "--python=/no/such/python: not an executable file"),
        (
            ["tf-mwms=/usr/bin/env"],
            "--python tf-mwms=/usr/bin/env: backend 'tf-mwms' is not run here; valid: torch-ddp",
        ),
        (
            ["/usr/bin/env", "/usr/bin/env"],
            "--python /usr/bin/env: a second interpreter without a backend (name it: --python BACKEND=PATH)",
        ),
    ],
)
def test_a_bad_interpreter_is_one_line_and_exit_2(given, message, tmp_path, capsys):
    argv = ["run", "--backend", "torch-ddp", "--device", "cpu", "--out", str(tmp_path / "r")]
    assert main([*argv, *(a for p in given for a in ("--python", p))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"harness: error: {message}", err
    with pytest.raises(interpreter.InterpreterError, match="DISTBENCH_PYTHON_TORCH_DDP=/nope: not an"):
        interpreter.configured("torch-ddp", "torch", {"DISTBENCH_PYTHON_TORCH_DDP": "/nope"})


@pytest.mark.unit
def test_horovod_is_judged_in_its_interpreter_s_environment(tmp_path):
    """The failed-build marker, the PyTorch extension and horovodrun are looked for in the environment of
    the interpreter the workers use, not the harness's."""
    python = fake_venv(tmp_path / "hvd")
    package = tmp_path / "hvd" / "lib" / "horovod"
    (package / "torch").mkdir(parents=True)
    where = interpreter.Interpreter(
        executable=python,
        prefix=str(tmp_path / "hvd"),
        python_version="3.11.0",
        modules={"torch": "t/__init__.py", "horovod": str(package / "__init__.py")},
        versions={},
    )
    adapter = Horovod()
    assert adapter.available_in(where) == (
        False,
        f"horovod is installed without its PyTorch extension ({package / 'torch'})",
    )
    (package / "torch" / "mpi_lib_v2.cpython-311-x86_64-linux-gnu.so").touch()
    assert adapter.available_in(where) == (False, f"{tmp_path / 'hvd' / 'bin' / 'horovodrun'} not found")
    (tmp_path / "hvd" / "bin" / "horovodrun").touch()
    assert adapter.available_in(where) == (True, "")
    (tmp_path / "hvd" / "distbench").mkdir()
    (tmp_path / "hvd" / "distbench" / "horovod-unavailable").write_text("...\nnvcc not found\n")
    assert adapter.available_in(where) == (False, "build failed: nvcc not found")
    missing = interpreter.Interpreter(
        python, str(tmp_path / "hvd"), "3.11.0", {"torch": "t", "horovod": None}, {}
    )
    assert adapter.available_in(missing) == (False, f"not installed: horovod (in {python})")


@pytest.mark.unit
@pytest.mark.subprocess  # bash: setup.sh refuses before it creates or installs anything
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--stack", "jax"], "setup.sh: unknown stack 'jax'; valid: torch, tf, paddle"),
        (["--stack"], "setup.sh: --stack needs a stack; valid: torch, tf, paddle"),
        (
            ["--cuda"],
            "setup.sh: unknown option '--cuda'; valid: --stack STACK (repeatable; torch, tf, paddle), --gpu, "
            "--dry-run",
        ),
    ],
)
def test_setup_per_stack_refuses_bad_input_in_one_line(argv, message):
    before = (REPO / ".venvs").exists()
    proc = subprocess.run(["bash", str(REPO / "setup.sh"), *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == message and not proc.stdout
    assert (REPO / ".venvs").exists() == before


@pytest.mark.unit
def test_sweep_and_commbench_take_the_interpreter_too(tmp_path, monkeypatch):
    from harness.cli import make_parser
    from harness.run.commbench import build_commbench_config
    from harness.run.sweep import plan

    for name in ("torch-ddp", "tf-mwms"):  # the fake interpreters are never asked
        monkeypatch.setattr(type(get_backend(name)), "availability", lambda self, python=None: (True, ""))
    tf, torch = fake_venv(tmp_path / "tf"), fake_venv(tmp_path / "torch")
    argv = ["sweep", "--backends", "torch-ddp,tf-mwms", "--gpus", "1", "--device", "cpu", "--repeats", "1"]
    runs, _ = plan(make_parser().parse_args([*argv, "--python", f"tf-mwms={tf}", "--python", torch]))
    assert {r.cfg.backend: r.cfg.topology.python for r in runs} == {"torch-ddp": torch, "tf-mwms": tf}
    bench = make_parser().parse_args(["commbench", "--backend", "tf-mwms", "--gpus", "2", "--device", "cpu"])
    assert build_commbench_config(bench, get_backend("tf-mwms")).topology.python == sys.executable
    bench.python = [tf]
    assert build_commbench_config(bench, get_backend("tf-mwms")).topology.python == tf
