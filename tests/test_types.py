"""The code the CPU tests cannot run type-checks: mypy over core, workloads, backends and harness (settings in
pyproject.toml's [tool.mypy]). Most worker code runs only under its framework, and the bf16/fp16, ZeRO-2/3
and NCCL paths only on a GPU, so a misspelt attribute there would first fail on a GPU machine: Paddle's bf16
path once called `options.get(...)` on its frozen options dataclass, which has no `.get`.

mypy reads PyTorch's and Paddle's own type information and checks the calls into them; it runs offline and
keeps its cache in .mypy_cache/, so a second run checks only what changed."""

import subprocess
import sys
from pathlib import Path

from conftest import REPO

BIN = Path(sys.executable).parent
PACKAGES = ["core", "workloads", "backends", "harness"]


def test_packages_type_check():
    proc = subprocess.run(
        [str(BIN / "mypy"), *PACKAGES], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"mypy found errors:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
