"""How good the prediction is: measured runs of this suite predicted from other records (a run at N ranks
from the same stack's 1-rank run and commbench records), with the signed error of every figure."""

from __future__ import annotations

from core.config import RunConfig
from core.process import available_cpus
from harness.analyze.metrics import summarize
from harness.predict.hardware import local_profile
from harness.predict.model import calibrate, predict_point


def predict_measured(target: dict, records: list[dict]) -> dict:
    """`target` (an ok training record at N > 1 ranks on this machine) predicted from `records` (never
    from the target itself): step time and exposed communication ratio, predicted beside measured."""
    others = [r for r in records if r["run_id"] != target["run_id"]]
    cfg = RunConfig.from_dict(target["config"])
    profile = local_profile([r for r in others if r["kind"] == "commbench"], cfg.backend, available_cpus())
    calib = calibrate([r for r in others if r["kind"] == "training"], cfg, profile)
    if not calib.seconds_per_flop:
        raise ValueError(f"no 1-rank calibration run for {target['run_id']}: {'; '.join(calib.notes)}")
    nominal = predict_point(cfg, profile, calib, tokens=1.0, price=None)["corners"]["nominal"]
    measured = summarize(target)
    step, exposed = measured["step_time_s"]["median"], measured["exposed_comm_ratio"]
    return {
        "run_id": target["run_id"],
        "label": target["backend_info"]["label"],
        "world_size": cfg.world_size,
        "calibrated_from": [s["run_id"] for s in calib.sources],
        "commbench": profile.sources,
        "step_time_s": {"measured": step, "predicted": nominal["step_time_s"]},
        "step_time_error": nominal["step_time_s"] / step - 1,
        "predicted_compute_s": nominal["t_compute_s"],
        "exposed_comm_ratio": {"measured": exposed, "predicted": nominal["exposed_comm_ratio"]},
        "exposed_error_points": 100 * (nominal["exposed_comm_ratio"] - exposed)
        if exposed is not None
        else None,
    }
