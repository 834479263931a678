"""`harness select --confirm`: the top candidates, priced on this machine's local profile from recorded
calibration runs, are run here briefly, and the selection record holds predicted against measured.

The calibration is the recorded torch-ddp set of tests/data/predict/ (1-rank `tiny` runs and a 2-rank
commbench, one thread a worker, on a 2-core VM). Only gross claims are made of the live runs (they ran,
their step times are positive and recorded beside the predicted band); whether a prediction lands in its
band on a machine other than the one the calibration came from is what the record reports, not what the
test asserts. What the record derives from the two figures (in band, the error, the measured order) is
asserted against the figures themselves, which holds whatever the timings were.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from core.records import run_config, validate_record
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
    confirmed, ranked = record["confirmed"], record["ranked"]
    assert len(confirmed) == 2 and [c["label"] for c in confirmed] == [r["label"] for r in ranked[:2]]
    for c, r in zip(confirmed, ranked):
        # each run is the candidate as priced, for --confirm-steps measured steps, beside its own prediction
        assert c["run_argv"] == r["run_argv"] and c["predicted_step_s"] == r["step_time_s"]
        assert c["status"] == "ok" and c["why"] is None
        run = json.loads(open(c["record"]).read())
        cfg = run_config(run)
        assert cfg.measurement.steps == 4 and cfg.backend == "torch-ddp" and cfg.variant == r["variant"]
        assert (cfg.batch.micro_batch, cfg.batch.grad_accum) == (r["micro_batch"], r["grad_accum"])
        measured, band = c["measured_step_s"], c["predicted_step_s"]
        assert measured == pytest.approx(run["summary"]["step_time_s"]["median"]) and measured > 0
        # what the record says of each follows from its figures, worked out here
        assert c["in_band"] is (band["low"] <= measured <= band["high"])
        assert c["error"] == pytest.approx(measured / band["nominal"] - 1)
    by_measured = sorted(confirmed, key=lambda c: c["measured_step_s"])
    assert [c["measured_rank"] for c in by_measured] == [1, 2]
    # the stack's tuned set has no 1-rank run in the calibration: dropped as uncalibrated, with the reason
    assert any("not calibrated" in e["why"] and "+tuned" in e["label"] for e in record["excluded"])
    assert all(r["calibrated"] for r in record["ranked"])
