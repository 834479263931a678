"""What measured records tell the step model: forward+backward seconds per FLOP and optimizer seconds per
parameter from 1-rank training runs of the same stack, a rank's step-to-step variation, and the activation
factor fitted to measured GPU peaks. The FLOPs a step's segments compute (`segment_flops`) are counted
here, as the calibration divides a measured step by them and the step model multiplies them back: one
count, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from backends import get_backend
from backends.schedule import Steps
from core.config import RunConfig
from core.records import run_config
from harness.analyze.metrics import summarize
from harness.predict import margin
from harness.predict.hardware import Profile
from harness.predict.memory import memory

ASSUMED_ACTIVATION_FACTOR = (0.8, 1.0, 1.25)
NORMAL_P10_P90 = 2 * 1.2816  # p90 - p10 of a normal distribution, in σ


@dataclass
class Calibration:
    """What measured records tell the model: forward+backward seconds per FLOP and optimizer seconds per
    parameter at the fast/nominal/slow corners (None: assumed), the activation factor, and provenance."""

    seconds_per_flop: tuple | None = None
    optimizer_seconds_per_param: tuple | None = None
    activation_factor: tuple = ASSUMED_ACTIVATION_FACTOR
    step_cv: float | None = None  # a rank's step-to-step variation (σ / median), from the runs' p10-p90
    # Per-GPU throughput lost per doubling of N beyond a node at the slow end, fitted on published runs
    # (harness.predict.margin): empirical, not modelled; 0 gives the model's own band.
    empirical_scale_loss: float = 0.0
    sources: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def segment_flops(cfg: RunConfig, steps: Steps) -> np.ndarray:
    """FLOPs of each segment per rank: a block's matmuls and attention, the head's vocabulary projection,
    backward twice forward (plus a forward again under activation checkpointing); the embedding is a
    lookup."""
    spec, tokens = cfg.model.spec, cfg.batch.micro_batch * cfg.model.spec.seq_len
    head = 2 * spec.d_model * spec.vocab_size
    block = (spec.flops_per_token / 3 - head) / spec.n_layers
    out = []
    for s in steps.list:
        per_token = {"embed": 0.0, "head": head}.get(s.unit, block)
        if s.phase == "backward":
            per_token *= 2 + (1 if cfg.model.activation_checkpointing and s.unit.startswith("block") else 0)
        if s.phase == "optimizer":
            per_token = 0.0
        out.append(per_token * tokens)
    return np.array(out)


def calibrate(records: list[dict], cfg: RunConfig, profile: Profile) -> Calibration:
    """Compute from the ok training records of the same stack (label) at one rank on the profile's device
    (same device name, or CPU for the local profile) and precision: the step time less the optimizer time,
    per FLOP of forward+backward, and the optimizer time per parameter. Records that do not match are named
    in the notes, never used. The slow end carries the empirical scale-loss margin of the published rows."""
    calib = Calibration(empirical_scale_loss=margin.per_doubling())
    if profile.device == "cuda":
        fit_activation_factor(records, calib)
    label = get_backend(cfg.backend).label(cfg)
    candidates = []
    for r in records:
        rc = run_config(r)
        why = None
        if r["status"] != "ok":
            why = f"status {r['status']}"
        elif (r.get("backend_info") or {}).get("label") != label:
            why = f"{(r.get('backend_info') or {}).get('label')}, not {label}"
        elif rc.topology.world_size != 1:
            why = f"{rc.topology.world_size} ranks (compute calibrates from a 1-rank run)"
        elif rc.model.precision != cfg.model.precision:
            why = f"precision {rc.model.precision}"
        elif profile.device == "cpu" and rc.topology.device != "cpu":
            why = "not a CPU run"
        elif profile.device == "cpu" and rc.topology.threads_per_worker != cfg.topology.threads_per_worker:
            why = (
                f"{rc.topology.threads_per_worker} threads per worker, not {cfg.topology.threads_per_worker}"
            )
        elif profile.device == "cuda" and (r["ranks"][0].get("device") != profile.device_name):
            why = f"device {r['ranks'][0].get('device')} is not {profile.device_name}"
        if why:
            calib.notes.append(f"{r['run_id']}: not used ({why})")
        else:
            candidates.append(r)
    if not candidates:
        return calib
    # One shape: seconds per FLOP differ between model sizes, so runs of other shapes are not mixed in (the
    # newest run's shape is taken; the prediction scales it by FLOPs to the shape asked for).
    newest = max(candidates, key=lambda r: (r.get("environment") or {}).get("start_time") or "")

    def shape(record: dict) -> tuple:
        model = run_config(record).model
        return model.spec, model.activation_checkpointing

    for r in candidates:
        if shape(r) != shape(newest):
            calib.notes.append(f"{r['run_id']}: not used (another shape than {newest['run_id']})")
    candidates = [r for r in candidates if shape(r) == shape(newest)]
    # Repeats (separate launches) of the same run: the median of their median steps, the band from the
    # lowest p10 to the highest p90, as launches on a shared machine differ by more than steps within one.
    flops, nominal, fast, slow, optimizer, cvs = 0.0, [], [], [], [], []
    for record in candidates:
        rc = run_config(record)
        summary = summarize(record)
        opt = [
            t for r in record["ranks"] if r.get("status") == "ok" for t in r.get("optimizer_step_times") or []
        ]
        t_opt = float(np.median(opt)) if opt else 0.0
        flops = float(np.sum(segment_flops(rc, Steps(rc))))
        step = summary["step_time_s"]
        nominal.append((step["median"] - t_opt) / flops)
        cvs.append((step["p90"] - step["p10"]) / NORMAL_P10_P90 / step["median"])
        fast.append((step["p10"] - t_opt) / flops)
        slow.append((step["p90"] - t_opt) / flops)
        if opt:
            optimizer.append(t_opt / rc.model.spec.n_params)
        else:
            calib.notes.append(
                f"{record['run_id']}: no optimizer times recorded; the optimizer scales with FLOPs"
            )
        calib.sources.append(
            {
                "run_id": record["run_id"],
                "backend": get_backend(rc.backend).label(rc),
                "step_time_s": step["median"],
                "optimizer_s": t_opt,
                "threads_per_worker": rc.topology.threads_per_worker,
            }
        )
    calib.seconds_per_flop = (min(fast), float(np.median(nominal)), max(slow))
    calib.step_cv = float(np.median(cvs))
    if len(optimizer) == len(candidates):
        calib.optimizer_seconds_per_param = (float(np.median(optimizer)),) * 3
    elif optimizer:  # some runs timed it, some did not: count it within the FLOP rate for all of them
        calib.notes.append("optimizer times in some calibration runs only: counted within the FLOP rate")
        return calibrate([r for r in records if not has_optimizer_times(r)], cfg, profile)
    return calib


def fit_activation_factor(records: list[dict], calib: Calibration) -> None:
    """The one activation factor, fitted to measured GPU peaks: for each ok GPU training record with an
    allocator peak (any stack, any N), (peak - every modelled term but activations) / modelled
    activations; their median, with the smallest and largest as the band. The allocator's peak is the
    only fair measure (a CPU's RSS holds the framework runtime)."""
    ratios = []
    for r in records:
        if r.get("status") != "ok" or run_config(r).topology.device != "cuda":
            continue
        peak = summarize(r)["peak_allocated_bytes"]
        if not peak:
            continue
        rc = run_config(r)
        modelled = memory(rc, 1.0)
        if modelled["activations"] > 0:
            ratios.append((peak - (modelled["total"] - modelled["activations"])) / modelled["activations"])
            calib.sources.append({"run_id": r["run_id"], "activation_factor": ratios[-1]})
    if ratios:
        calib.activation_factor = (min(ratios), float(np.median(ratios)), max(ratios))
        calib.notes.append(f"activation factor fitted to {len(ratios)} measured allocator peak(s)")


def has_optimizer_times(record: dict) -> bool:
    return any(r.get("optimizer_step_times") for r in record.get("ranks", []) if r.get("status") == "ok")
