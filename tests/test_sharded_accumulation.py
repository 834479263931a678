"""What FSDP2 really issues per step under gradient accumulation, counted in its workers: gradients are
reduce-scattered once per step (sync off on the earlier micro-batches), parameters gathered per micro-batch,
the root once and each block twice (forward, and backward after resharding), as the analytic terms say."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

from workloads.spec import PRESETS

pytestmark = pytest.mark.slow


def test_fsdp_reduces_once_per_step_and_gathers_per_micro_batch():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            str(REPO / "tests" / "probes" / "fsdp_collectives.py"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COUNTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    counts = json.loads(lines[0][len("COUNTS ") :])
    units = PRESETS["tiny"].n_layers + 1  # one FSDP unit per block, and the root
    assert counts["1"]["reductions"] == counts["2"]["reductions"] == units
    assert counts["1"]["gathers"] == 1 + 2 * PRESETS["tiny"].n_layers  # root once, blocks twice
    assert counts["2"]["gathers"] == 2 * counts["1"]["gathers"]
