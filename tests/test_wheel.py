"""The product as a user installs it: a wheel (`pip install .`, not editable) in an environment of its own,
run from a folder outside the source tree. An editable checkout hides what the wheel leaves out (a data
file missing from pyproject.toml's package-data, a path read relative to the source tree, a relative
`--out` that the workers would resolve from the package's folder): this test runs the installed `harness`
script. The frameworks come from the suite's own environment, through a path in a .pth file (the .pth
files of that folder, the editable install's finder among them, are not processed), so nothing is
downloaded and the checkout stays out of sight."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from backends import interpreter

PACKAGES = ("harness", "backends", "core", "workloads")
TRACE = REPO / "tests" / "data" / "gpu-traces" / "a100_ddp_2rank_nccl2.17_rank0.json.gz"
TINY_RUN = ["--backend", "torch-ddp", "--gpus", "2", "--workload", "tiny", "--steps", "3", "--warmup", "1"]
TINY_RUN += ["--compute-method", "none", "--no-trace-comm", "--quiet"]
PREDICT = ["--backend", "torch-ddp", "--workload", "tiny", "--gpus", "8,64", "--hardware", "h100-sxm"]
# Run by the installed interpreter: where each package was imported from, and the published rows with the
# profiles of their clusters, which only regenerating published_check.json reads.
PROBE = """import json, harness, backends, core, workloads
from harness.predict import published, hardware
rows = published.load_rows()
profiles = {hardware.load_profile(published.hardware(r)).name for r in rows}
print(json.dumps({"files": [m.__file__ for m in (harness, backends, core, workloads)],
                  "rows": len(rows), "profiles": len(profiles)}))"""


def ok(proc: subprocess.CompletedProcess, what: str) -> str:
    assert proc.returncode == 0, (
        f"{what}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def call(argv: list, what: str, **kwargs) -> str:
    return ok(subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs), what)


def data_files(tree: Path) -> set[str]:
    """The packages' files that are not Python source: what the product reads at run time."""
    return {
        p.relative_to(tree).as_posix()
        for package in PACKAGES
        for p in (tree / package).rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }


def build_wheel(tmp: Path) -> Path:
    """`pip wheel` of a copy of the packages and pyproject.toml: the checkout's build/ and *.egg-info/ would
    put files in the wheel that package-data does not name. Every data file of the packages must be in it."""
    src = tmp / "src"
    for package in PACKAGES:
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(REPO / "pyproject.toml", src)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    call([*pip, "wheel", src, "--no-deps", "--no-build-isolation", "-w", tmp / "dist"], "pip wheel", cwd=tmp)
    (wheel,) = (tmp / "dist").glob("distbench-*.whl")
    missing = data_files(src) - set(zipfile.ZipFile(wheel).namelist())
    assert not missing, f"the wheel lacks these files (pyproject.toml's package-data): {sorted(missing)}"
    return wheel


def install(wheel: Path, venv: Path) -> Path:
    """A venv with the wheel alone installed, and the suite's frameworks on its path after it; its
    site-packages."""
    call([sys.executable, "-m", "venv", "--without-pip", venv], "venv")
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", python]
    call([*pip, "install", "--no-deps", "--no-index", wheel], "pip install")
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(call([python, "-c", where], "venv").strip())
    ours = sorted({sysconfig.get_paths()["purelib"], *site.getsitepackages()})
    (purelib / "suite_frameworks.pth").write_text("".join(f"{p}\n" for p in ours if Path(p).is_dir()))
    return purelib


@pytest.mark.integration
def test_the_installed_wheel_runs_every_command_from_outside_the_source_tree(tmp_path):
    wheel = build_wheel(tmp_path)
    # The user's folder, a git repository of its own that holds the venv: records must not take its commit.
    work = tmp_path / "work"
    work.mkdir()
    git = ["git", "-c", "user.name=u", "-c", "user.email=u@example.com", "-c", "commit.gpgsign=false"]
    call([*git, "init", "-q"], "git init", cwd=work)
    call([*git, "commit", "-q", "--allow-empty", "-m", "the user's project"], "git commit", cwd=work)
    venv = work / "venv"
    purelib = install(wheel, venv)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env = {k: v for k, v in env.items() if not k.startswith(interpreter.ENV_PREFIX)}
    python, chosen_by = interpreter.configured("torch-ddp", "torch")
    if chosen_by != interpreter.OWN:  # a GPU node's stack venv (.venvs/torch): the workers run there
        env[interpreter.env_var("torch-ddp")] = python
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"

    probe = json.loads(call([venv / "bin" / "python", "-c", PROBE], "probe", cwd=work, env=env))
    for file in probe["files"]:  # the wheel is what runs, not the checkout's editable install
        assert Path(file).is_relative_to(purelib), f"{file} is not the installed wheel's ({purelib})"
    assert probe["rows"] > 0 and probe["profiles"] > 1

    running: list[subprocess.Popen] = []

    def harness(*args: str) -> subprocess.Popen:
        argv = [str(venv / "bin" / "harness"), *args]
        running.append(subprocess.Popen(argv, cwd=work, env=env, text=True, stdout=-1, stderr=-1))
        return running[-1]

    def done(proc: subprocess.Popen) -> str:
        out, err = proc.communicate(timeout=300)
        return ok(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.args[1])

    try:
        listing = harness("list")
        run = harness("run", *TINY_RUN, "--out", "results")  # relative: the user's folder, not the package's
        listed, _ = done(listing), done(run)
        (record,) = (work / "results").glob("*.json")
        rec = json.loads(record.read_text())
        shutil.copy2(TRACE, work)
        readers = {
            "report": harness("report", "results"),
            "check": harness("check", "results"),
            "compare": harness("compare", str(record), str(record)),
            "trace": harness("trace", TRACE.name),
            "predict": harness("predict", *PREDICT),
        }
        out = {name: done(proc) for name, proc in readers.items()}
    finally:
        for proc in running:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    assert "torch-ddp" in listed and "tiny" in listed
    assert " -e " not in listed and str(purelib) not in listed, listed  # an install command names no tree
    assert rec["status"] == "ok", rec.get("error")
    assert rec["environment"]["git"] == {"commit": None, "dirty": None}, rec["environment"]["git"]
    assert "# distbench report" in out["report"] and "torch-ddp" in out["report"]
    assert f"results/{record.name}: ok (training, schema" in out["check"]
    assert "| ok |" in out["compare"]
    assert "rank 0 of 2" in out["trace"] and "all_reduce" in out["trace"]
    assert "PREDICTED (not measured)" in out["predict"]
    assert "published check: torch-ddp" in out["predict"], out["predict"]  # its published rows' track record
