"""How good the prediction is: measured runs of this suite predicted from other records (a run at N ranks
from the same stack's 1-rank runs and commbench records), with the signed error of every figure."""

from __future__ import annotations

import numpy as np

from core.config import RunConfig
from core.process import available_cpus
from core.records import run_config
from harness.analyze.metrics import summarize
from harness.predict.calibration import calibrate
from harness.predict.hardware import local_profile
from harness.predict.model import predict_point


def predicted(cfg: RunConfig, others: list[dict]) -> dict:
    """The nominal prediction of `cfg` on this machine from `others` (1-rank training runs calibrate the
    compute, commbench records price the collectives), with the records it came from."""
    profile = local_profile([r for r in others if r["kind"] == "commbench"], cfg.backend, available_cpus())
    calib = calibrate([r for r in others if r["kind"] == "training"], cfg, profile)
    if not calib.seconds_per_flop:
        raise ValueError(f"no 1-rank calibration run for {cfg.backend}: {'; '.join(calib.notes)}")
    nominal = predict_point(cfg, profile, calib, tokens=1.0, price=None)["corners"]["nominal"]
    return {
        "calibrated_from": [s["run_id"] for s in calib.sources],
        "calibration_notes": calib.notes,
        "commbench": profile.sources,
        "step_time_s": nominal["step_time_s"],
        "compute_s": nominal["t_compute_s"],
        "exposed_comm_ratio": nominal["exposed_comm_ratio"],
    }


def predict_measured(target: dict, records: list[dict]) -> dict:
    """`target` (an ok training record at N > 1 ranks on this machine) predicted from `records` (never
    from the target itself): step time and exposed communication ratio, predicted beside measured."""
    cfg = run_config(target)
    guess = predicted(cfg, [r for r in records if r["run_id"] != target["run_id"]])
    measured = summarize(target)
    step, exposed = measured["step_time_s"]["median"], measured["exposed_comm_ratio"]
    return {
        "run_id": target["run_id"],
        "label": target["backend_info"]["label"],
        "world_size": cfg.topology.world_size,
        "calibrated_from": guess["calibrated_from"],
        "calibration_notes": guess["calibration_notes"],
        "commbench": guess["commbench"],
        "step_time_s": {"measured": step, "predicted": guess["step_time_s"]},
        "step_time_error": guess["step_time_s"] / step - 1,
        "predicted_compute_s": guess["compute_s"],
        "exposed_comm_ratio": {"measured": exposed, "predicted": guess["exposed_comm_ratio"]},
        "exposed_error_points": 100 * (guess["exposed_comm_ratio"] - exposed)
        if exposed is not None
        else None,
    }


def predict_repeats(records: list[dict], world_size: int = 2) -> dict:
    """Repeated launches of one run at `world_size` (identical configs) predicted once, from the 1-rank
    runs and commbench records among `records` (no run at `world_size` feeds it), and the prediction set
    beside the median of their measurements, with their range: on a shared machine one launch is a draw,
    not the machine's figure, and a bound tighter than the launches' own spread cannot be read from one."""
    targets = sorted(
        (
            r
            for r in records
            if r["kind"] == "training"
            and r["status"] == "ok"
            and run_config(r).topology.world_size == world_size
        ),
        key=lambda r: r["run_id"],
    )
    if not targets:
        raise ValueError(f"no ok training record at {world_size} ranks to predict")
    if any(r["config"] != targets[0]["config"] for r in targets):
        raise ValueError(f"the {len(targets)} runs at {world_size} ranks are not repeats of one config")
    cfg = run_config(targets[0])
    target_ids = {r["run_id"] for r in targets}
    guess = predicted(cfg, [r for r in records if r["run_id"] not in target_ids])
    summaries = [summarize(r) for r in targets]
    steps = [s["step_time_s"]["median"] for s in summaries]
    exposed = [s["exposed_comm_ratio"] for s in summaries if s["exposed_comm_ratio"] is not None]
    step, ratio = float(np.median(steps)), (float(np.median(exposed)) if exposed else None)
    return {
        "label": targets[0]["backend_info"]["label"],
        "world_size": world_size,
        "run_ids": [r["run_id"] for r in targets],
        "calibrated_from": guess["calibrated_from"],
        "calibration_notes": guess["calibration_notes"],
        "commbench": guess["commbench"],
        "step_time_s": {"predicted": guess["step_time_s"], "measured_median": step, "measured": steps},
        "step_time_error": guess["step_time_s"] / step - 1,
        "predicted_compute_s": guess["compute_s"],
        "exposed_comm_ratio": {
            "predicted": guess["exposed_comm_ratio"],
            "measured_median": ratio,
            "measured": exposed,
        },
        "exposed_error_points": 100 * (guess["exposed_comm_ratio"] - ratio) if ratio is not None else None,
    }
