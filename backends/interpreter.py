"""Which Python interpreter a backend's workers run under, and what is installed there.

One venv cannot hold the CUDA builds of every stack: torch's, `tensorflow[and-cuda]`'s and
`paddlepaddle-gpu`'s pinned `nvidia-*` wheels (cuDNN, cuBLAS, NCCL, ...) conflict. So each stack may run
from an environment of its own, and the harness, which imports no framework, starts the stack's launcher
with that environment's interpreter and asks that interpreter (not itself) whether the stack is installed.

A backend's interpreter is the first of:
1. the run's `--python PATH` (or `--python BACKEND=PATH` in a sweep of several backends);
2. the environment variable DISTBENCH_PYTHON_<BACKEND> (upper case, '-' as '_': DISTBENCH_PYTHON_TF_MWMS);
3. `.venvs/<stack>/bin/python` in this repository, which `./setup.sh --stack <stack>` builds; the stacks are
   `torch` (torch-ddp, torch-fsdp, deepspeed, horovod), `tf` (tf-mwms) and `paddle` (paddle-fleet);
4. the harness's own (`./setup.sh` with no arguments puts everything in .venv: CPU machines and CI).

This file also runs as a script in the other interpreter (`python backends/interpreter.py [--versions]
MODULE...` prints one JSON line), so it imports the standard library only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STACKS_DIR = REPO_ROOT / ".venvs"
# framework -> the stack (environment) that holds it; torch's stack also holds DeepSpeed and Horovod
STACKS = {"torch": "torch", "tensorflow": "tf", "paddle": "paddle"}
ENV_PREFIX = "DISTBENCH_PYTHON_"
PROBE_TIMEOUT_S = 120
OWN = "harness"  # where the choice came from, when nothing chose another


class InterpreterError(ValueError):
    """An interpreter that was named but cannot be used (missing, not executable, or failing to start)."""


def env_var(backend: str) -> str:
    """The environment variable that names `backend`'s interpreter: DISTBENCH_PYTHON_TORCH_DDP, ..."""
    return ENV_PREFIX + backend.upper().replace("-", "_")


def usable(path: str, what: str) -> str:
    """`path` as an absolute path (symlinks kept: a venv's bin/python is one, and the venv is found by it), if
    it is an executable file; InterpreterError naming `what` gave it otherwise."""
    full = os.path.abspath(os.path.expanduser(path))
    if not (os.path.isfile(full) and os.access(full, os.X_OK)):
        raise InterpreterError(f"{what}={path}: not an executable file")
    return full


def configured(
    backend: str, framework: str, environ: Mapping[str, str] | None = None, stacks_dir: Path | None = None
) -> tuple[str, str]:
    """(interpreter, where that choice came from) for `backend` when no --python names one: its
    environment variable, else its stack's environment under .venvs (STACKS_DIR), else this interpreter."""
    environ = os.environ if environ is None else environ
    var = env_var(backend)
    if environ.get(var):
        return usable(environ[var], var), var
    stack = (stacks_dir or STACKS_DIR) / STACKS.get(framework, framework)
    python = stack / "bin" / "python"
    if python.is_file() and os.access(python, os.X_OK):
        shown = stack.relative_to(REPO_ROOT) if stack.is_relative_to(REPO_ROOT) else stack
        return str(python), str(shown)
    return sys.executable, OWN


def is_this_one(python: str | None) -> bool:
    return python is None or os.path.abspath(python) == os.path.abspath(sys.executable)


def venv_prefix(python: str | None) -> Path | None:
    """The virtual environment `python` belongs to (None outside one): for another interpreter, the folder
    above its bin/ when that holds a pyvenv.cfg, read without starting it."""
    if python is None or is_this_one(python):
        return Path(sys.prefix) if sys.prefix != sys.base_prefix else None
    prefix = Path(python).parent.parent
    return prefix if (prefix / "pyvenv.cfg").is_file() else None


@dataclass(frozen=True)
class Interpreter:
    """What one interpreter holds, as that interpreter sees it."""

    executable: str
    prefix: str
    python_version: str
    modules: dict[str, str | None]
    """module -> where its spec says it is ('' for a namespace package); None: not importable there"""
    versions: dict[str, str | None]
    """module -> the version of the installed distribution that provides it (filled when asked for)"""

    @property
    def this_one(self) -> bool:
        return is_this_one(self.executable)


def probe(modules: list[str], versions: bool = False) -> dict:
    """What this interpreter holds, found without importing any of `modules` (find_spec reads the import
    path; the versions come from the installed distributions' metadata)."""
    found: dict[str, str | None] = {}
    for module in modules:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        found[module] = None if spec is None else (spec.origin or "")
    dists = distributions() if versions else {}
    known: dict[str, str | None] = {}
    for module in modules if versions else []:
        names = dists.get(module, [])
        try:
            known[module] = importlib.metadata.version(names[0]) if names else None
        except importlib.metadata.PackageNotFoundError:
            known[module] = None
    return {
        "executable": sys.executable,
        "prefix": sys.prefix,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "modules": found,
        "versions": known,
    }


def facts(python: str | None, modules, versions: bool = False) -> Interpreter:
    """What `python` (None: this interpreter) holds of `modules`. This interpreter is asked in this
    process, every time; another one in a subprocess, once per process (a run or a sweep asks it again
    for every configuration)."""
    if is_this_one(python):
        return Interpreter(**probe(list(modules), versions))
    return Interpreter(**asked(python, tuple(sorted(set(modules))), versions))


@functools.cache
def distributions() -> Mapping[str, list[str]]:
    """Top-level module -> the installed distributions that provide it (a scan of every one's metadata)."""
    return importlib.metadata.packages_distributions()


@functools.cache
def asked(python: str, modules: tuple[str, ...], versions: bool) -> dict:
    argv = [python, __file__, *(["--versions"] if versions else []), *modules]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise InterpreterError(f"{python}: no answer within {PROBE_TIMEOUT_S} s") from None
    except OSError as exc:
        raise InterpreterError(f"{python}: cannot start it ({exc.strerror or exc})") from None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        said = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise InterpreterError(f"{python} failed (exit {out.returncode}): {said}")
    return {**json.loads(lines[-1]), "executable": python}


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # this folder (backends/) is not on a worker's import path: do not find modules in it
    args = sys.argv[1:]
    print(json.dumps(probe([a for a in args if a != "--versions"], versions="--versions" in args)))
