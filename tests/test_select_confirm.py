"""`harness select --confirm`: the top candidates, priced on this machine's local profile from recorded
calibration runs, are run here briefly, and the selection record holds predicted against measured.

The calibration is the recorded torch-ddp set of tests/data/predict/ (1-rank `tiny` runs and a 2-rank
commbench, one thread a worker, on a 2-core VM). Only gross claims are made of the live runs (they ran,
their step times are positive and recorded beside the predicted band); whether a prediction lands in its
band on a machine other than the one the calibration came from is what the record reports, not what the
test asserts.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from core.records import validate_record
from harness.cli import main

pytestmark = pytest.mark.slow

CALIBRATION = REPO / "tests" / "data" / "predict" / "torch-ddp"


def test_confirm_runs_the_top_two_and_records_predicted_against_measured(tmp_path, capsys):
    code = main(
        ["select", "--hardware", "local", "--calibrate", str(CALIBRATION), "--stacks", "torch-ddp",
         "--workload", "tiny", "--gpus", "2", "--global-batch", "8", "--precision", "fp32",
         "--confirm", "2", "--confirm-steps", "4", "--out", str(tmp_path)]
    )  # fmt: skip
    shown = capsys.readouterr().out
    assert code == 0, shown
    assert "CONFIRMED (measured here, briefly)" in shown
    (path,) = tmp_path.glob("select-*.json")
    record = json.loads(path.read_text())
    validate_record(record)
    confirmed = record["confirmed"]
    assert len(confirmed) == 2 and [c["label"] for c in confirmed] == [
        r["label"] for r in record["ranked"][:2]
    ]
    for c in confirmed:
        assert c["status"] == "ok" and c["measured_step_s"] > 0 and c["predicted_step_s"]["nominal"] > 0
        assert c["in_band"] in (True, False) and c["measured_rank"] in (1, 2)
        run = json.loads(open(c["record"]).read())
        assert run["summary"]["step_time_s"]["median"] == pytest.approx(c["measured_step_s"])
    # the stack's tuned set has no 1-rank run in the calibration: dropped as uncalibrated, with the reason
    assert any("not calibrated" in e["why"] and "+tuned" in e["label"] for e in record["excluded"])
    assert all(r["calibrated"] for r in record["ranked"])
