"""Shared test helpers. The pytest process imports no ML framework: training runs go through the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def harness(*args, timeout=300) -> subprocess.CompletedProcess:
    """Run `python -m harness ARGS` from the repo root."""
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def run_record(out: Path, *args, expect_rc=0, timeout=300) -> dict:
    """`harness run ARGS --out OUT`, check its exit code, and return the record it wrote."""
    before = set(out.glob("*.json")) if out.exists() else set()
    proc = harness("run", *args, "--out", out, timeout=timeout)
    assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    new = sorted(set(out.glob("*.json")) - before)
    assert len(new) == 1, f"expected one new record in {out}, got {new}"
    return json.loads(new[0].read_text())


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "results"
