"""Installing one stack or all of them: pyproject.toml's extras are the one list of dependencies, every
adapter names the extra that installs it, `harness list` prints the command for a stack that is missing,
and `harness env` reports what a bug report needs."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys

import pytest
from conftest import REPO, harness

from backends import all_backends, get_backend, interpreter
from harness import cli
from harness.run.devices import query_gpus
from harness.run.environment import GPU_FIELDS, install_command, shown, text_lines

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, before the standard library took it in
    tomllib = pytest.importorskip("tomli")

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
SELF = re.compile(r"^distbench\[([^\]]*)\]$")


def dist_name(requirement: str) -> str:
    """'tensorflow-cpu==2.21.*' -> 'tensorflow-cpu': a requirement's distribution, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement.strip()).group()).lower()


def self_extras(extra: str) -> set[str]:
    """The extras a `distbench[a,b]` entry of `extra` pulls in, transitively, `extra` included."""
    found, todo = set(), [extra]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for requirement in EXTRAS[name]:
            if m := SELF.match(requirement.replace(" ", "")):
                todo += m.group(1).split(",")
    return found


def closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` install here: them and what each requires, read from the installed
    distributions' metadata (requirements of their own extras left out)."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        if m := SELF.match(requirement.replace(" ", "")):
            todo += [r for e in m.group(1).split(",") for r in EXTRAS[e]]
            continue
        name = dist_name(requirement)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [r for r in requires if "extra ==" not in r]
    return seen


def imported_modules(folder: str) -> set[str]:
    """The top-level modules the Python files under `folder` import (absolute imports, at any depth)."""
    found = set()
    for path in (REPO / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def undeclared(folders: tuple[str, ...], requirements: list[str], also: set[str] = frozenset()) -> dict:
    """Third-party modules imported under `folders` whose installed distribution is none of those
    `requirements` install; modules not installed here cannot be judged and are left out."""
    allowed = closure(requirements)
    providers = importlib.metadata.packages_distributions()
    first_party = {"harness", "backends", "core", "workloads", "conftest"} | {
        p.stem for p in (REPO / "tests").rglob("*.py")
    }
    bad = {}
    for module in set().union(*(imported_modules(f) for f in folders)):
        if module in sys.stdlib_module_names or module in first_party or module in also:
            continue
        dists = {dist_name(d) for d in providers.get(module, [])}
        if dists and not dists & allowed:
            bad[module] = sorted(dists)
    return bad


# ------------------------------------------------------------------------------------------------- extras
@pytest.mark.unit
def test_every_adapter_names_an_extra_that_pyproject_defines():
    missing = {b.name: b.extra for b in all_backends() if b.extra not in EXTRAS}
    assert not missing, f"adapters whose `extra` pyproject.toml lacks: {missing}"


@pytest.mark.unit
def test_all_installs_every_stack_and_dev_is_separate():
    assert {b.extra for b in all_backends()} <= self_extras("all")
    assert "dev" not in self_extras("all")  # a user's `.[all]` gets stacks, not the test tools


@pytest.mark.unit
def test_each_stack_extra_installs_the_modules_its_adapters_require():
    """A stack's extra brings its framework (and DeepSpeed's, ...): after `pip install -e '.[torch]'`,
    torch-ddp's `torch` is importable. Horovod itself comes from scripts/install_horovod.sh, which its
    install command runs after the extra."""
    providers = importlib.metadata.packages_distributions()
    for b in all_backends():
        installs = closure(EXTRAS[b.extra])
        for module in b.requires:
            if (REPO / "scripts" / f"install_{module}.sh").is_file() or module not in providers:
                continue
            dists = {dist_name(d) for d in providers[module]}
            assert dists & installs, f"{b.name}: extra '{b.extra}' does not install {module} ({dists})"


@pytest.mark.unit
def test_one_list_of_dependencies():
    """No requirements.txt beside pyproject.toml, and nothing that installs names one."""
    assert not (REPO / "requirements.txt").exists()
    installers = [REPO / "setup.sh", REPO / ".ci" / "run", *(REPO / "scripts").glob("*.sh")]
    installers += list((REPO / ".github").rglob("*.yml"))
    naming = [str(p.relative_to(REPO)) for p in installers if "requirements.txt" in p.read_text()]
    assert not naming, f"these still name requirements.txt: {naming}"


@pytest.mark.unit
def test_setup_installs_every_stack_and_the_test_tools_from_the_extras():
    """setup.sh, the everything path CI runs, installs the project with its `all` and `dev` extras."""
    script = (REPO / "setup.sh").read_text().splitlines()
    lines = [line for line in script if not line.lstrip().startswith("#")]
    installs = [line for line in lines if re.search(r"\bpip install\b", line)]
    assert any(re.search(r"pip install (-q )?-e '\.\[all,dev\]'", line) for line in installs), installs
    assert not any(" -r " in line for line in installs), installs


@pytest.mark.unit
@pytest.mark.subprocess  # bash; --dry-run installs nothing
def test_per_stack_setup_takes_its_pins_from_the_extras():
    """`./setup.sh --gpu` (scripts/setup_stacks.sh) installs the extras' versions, as CUDA builds."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SPEC")}  # a user's own spec wins
    argv = ["bash", str(REPO / "setup.sh"), "--dry-run", "--gpu"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    pin = {dist_name(r): r for extra in ("torch", "deepspeed", "tf", "paddle") for r in EXTRAS[extra]}
    assert proc.stdout.splitlines() == [
        f"torch: .venvs/torch (CUDA build: {pin['torch']} {pin['deepspeed']})",
        f"tf: .venvs/tf (CUDA build: {pin['tensorflow-cpu'].replace('-cpu', '[and-cuda]')})",
        f"paddle: .venvs/paddle (CUDA build: {pin['paddlepaddle'].replace('paddle==', 'paddle-gpu==')})",
    ]


@pytest.mark.unit
def test_what_the_code_imports_is_declared():
    """A fresh `pip install -e '.[torch]'` can run the harness: what harness/ and core/ import is among the
    core dependencies; the workers' modules come with a stack's extra; the suite's with `dev`."""
    core = PROJECT["dependencies"]
    stacks = [f"distbench[{','.join(sorted(self_extras('all') - {'all'}))}]"]
    frameworks = {m for b in all_backends() for m in b.requires}  # horovod: its extra, then its script
    assert undeclared(("harness", "core"), core) == {}
    assert undeclared(("backends", "workloads"), core + stacks, frameworks) == {}
    assert undeclared(("tests", "scripts"), core + stacks + EXTRAS["dev"], frameworks) == {}


# ------------------------------------------------------------------------------------------ harness list
@pytest.mark.unit
def test_list_prints_the_command_that_installs_a_missing_stack(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    for b in all_backends():
        monkeypatch.delenv(interpreter.env_var(b.name), raising=False)
    monkeypatch.setattr(interpreter, "STACKS_DIR", REPO / "no-such-stacks-dir")
    tf, hvd = type(get_backend("tf-mwms")), type(get_backend("horovod"))
    monkeypatch.setattr(tf, "availability", lambda self, python=None: (False, "not installed: tensorflow"))
    monkeypatch.setattr(hvd, "availability", lambda self, python=None: (False, "not installed: horovod"))
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    py = shown(sys.executable)
    assert f"  tf-mwms  {py} -m pip install -e '.[tf]'\n" in out
    assert f"  horovod  {py} -m pip install -e '.[horovod]' && bash scripts/install_horovod.sh {py}\n" in out
    listed = out.split("the one command that installs each:")[1].split("workloads")[0]
    if get_backend("torch-ddp").availability()[0]:
        assert "torch-ddp" not in listed  # installed: nothing to add


@pytest.mark.unit
def test_an_adapter_without_an_extra_gets_no_command():
    dummy = type("Dummy", (type(get_backend("torch-ddp")),), {"extra": ""})()
    assert install_command(dummy, sys.executable) is None


# -------------------------------------------------------------------------------------------- harness env
@pytest.mark.unit
@pytest.mark.subprocess  # a stand-in nvidia-smi
def test_gpus_are_read_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\n[ "$1" = "--query-gpu=name,driver_version,memory.total" ] || exit 9\n'
        'echo "NVIDIA H200, 570.86.15, 143771 MiB"; echo "NVIDIA H200, 570.86.15, 143771 MiB"\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpu = {"name": "NVIDIA H200", "driver_version": "570.86.15", "memory.total": "143771 MiB"}
    assert query_gpus(GPU_FIELDS) == [gpu, gpu]


@pytest.mark.unit
def test_env_text_shows_a_gpu_machine_s_cuda_and_nccl():
    """The lines only a GPU machine produces, from a GPU machine's facts (this one may have none)."""
    backend = {"python": "/x/.venvs/torch/bin/python", "python_source": ".venvs/torch", "available": True,
               "reason": None, "versions": {"torch": "2.13.0"}, "install": None,
               "launcher": {"name": "torchrun", "from": "torch", "version": "2.13.0"}}  # fmt: skip
    env = {
        "distbench": {"version": "0.1.0", "root": "/x", "commit": "a" * 40, "dirty": False},
        "python": {"version": "3.12.3", "implementation": "CPython", "executable": "/x/.venv/bin/python"},
        "os": {"platform": "Linux", "distribution": None, "libc": None},
        "cpu": {"model": "EPYC", "logical_cores": 16, "physical_cores": 8, "affinity": "0-15", "usable": 16},
        "memory": {"total_bytes": 128 << 30, "available_bytes": 100 << 30},
        "gpus": [{"name": "NVIDIA H200", "driver_version": "570.86.15", "memory.total": "143771 MiB"}],
        "cuda": {"driver_supports": "12.8", "CUDA_VISIBLE_DEVICES": "0"},
        "tools": {"mpirun": None},
        "interpreters": {"/x/.venvs/torch/bin/python": {
            "python_version": "3.12.3", "prefix": "/x/.venvs/torch", "versions": {"torch": "2.13.0"},
            "torch_build": {"cuda": "12.8", "hip": None, "cudnn": 91002, "nccl": "2.27.3"}}},
        "backends": {"torch-ddp": backend},
    }  # fmt: skip
    text = "\n".join(text_lines(env))
    assert "gpus          NVIDIA H200 (143771 MiB, driver 570.86.15)\n" in text
    assert "cuda          driver supports 12.8; CUDA_VISIBLE_DEVICES=0\n" in text
    assert "torch 2.13.0; torch built with CUDA 12.8, cuDNN 91002, NCCL 2.27.3\n" in text
    assert "  torch-ddp  yes: torch 2.13.0; launcher torchrun (torch 2.13.0); python .venvs/torch" in text


def test_env_text_names_every_fact_and_backend():
    proc = harness("env", timeout=600)
    assert proc.returncode == 0, proc.stderr
    heads = [line.split()[0] for line in proc.stdout.splitlines() if line and not line.startswith(" ")]
    assert heads == [
        "distbench", "python", "os", "cpu", "memory", "gpus", "cuda", "tools", "interpreters", "backends",
    ]  # fmt: skip
    backends = proc.stdout.split("\nbackends\n")[1].splitlines()
    assert [line.split()[0] for line in backends] == [b.name for b in all_backends()]
    assert f"python        {platform.python_version()} " in proc.stdout


def test_env_json_has_the_facts_of_a_bug_report():
    proc = harness("env", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    assert env["distbench"]["version"] == importlib.metadata.version("distbench")
    assert re.fullmatch(r"[0-9a-f]{40}", env["distbench"]["commit"])
    assert env["python"]["version"] == platform.python_version()
    assert env["cpu"]["logical_cores"] == os.cpu_count() and env["cpu"]["model"]
    assert env["memory"]["total_bytes"] > 0
    assert isinstance(env["gpus"], list) and {"driver_supports", "CUDA_VISIBLE_DEVICES"} <= set(env["cuda"])
    assert {"mpirun", "sinfo", "kubectl", "nvcc"} <= set(env["tools"])
    assert list(env["backends"]) == [b.name for b in all_backends()]
    for b in all_backends():
        row = env["backends"][b.name]
        python = interpreter.configured(b.name, b.framework)[0]
        assert row["python"] == python and row["available"] == b.availability(python)[0], b.name
        assert set(row["versions"]) == set(b.requires) and row["launcher"]["name"] == b.launcher
        assert (row["install"] is None) == row["available"], b.name
        facts = env["interpreters"][python]
        assert "torch_build" in facts and {"torch", "numpy"} & set(facts["versions"])
        if row["available"]:
            versions = interpreter.facts(python, b.requires, versions=True).versions
            assert row["versions"] == versions, b.name
    torch_ddp = env["backends"]["torch-ddp"]
    if torch_ddp["available"]:  # torch's build: CUDA and NCCL, or why there are none
        build = env["interpreters"][torch_ddp["python"]]["torch_build"]
        assert {"cuda", "nccl"} <= set(build)
