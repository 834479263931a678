"""What measured records tell the step model: forward+backward seconds per FLOP, the fixed costs a step
pays whatever its size and optimizer seconds per parameter from 1-rank training runs of the same stack, a
rank's step-to-step variation, and the activation factor fitted to measured GPU peaks. The FLOPs a step's
segments compute (`segment_flops`) are counted here, as the calibration divides a measured step by them
and the step model multiplies them back: one count, so the two cannot disagree.

The step split (split_step): a part that scales with the tokens of a micro-batch (forward and backward), a
fixed cost each micro-batch pays whatever its size (a stack's per-module hooks, its kernel launches and
casts), and what the step costs once whatever its size (the optimizer, priced per parameter, and the
anatomy's "other": the step less forward, backward and optimizer). Read from the step's anatomy
(harness.analyze.anatomy), one of two ways:

- the parts of one run (or of repeats at one micro-batch): forward+backward per FLOP, the median "other" a
  fixed cost per step; a fixed cost inside forward and backward cannot be told from one micro-batch and
  is priced per FLOP;
- a least-squares line (scipy.stats.linregress) of forward+backward per micro-batch against tokens per
  micro-batch, over runs at two or more micro-batches of one stack and shape: its slope the cost per token
  (per FLOP, the shape being fixed), its intercept the fixed cost per micro-batch; "other" as above.

A step at micro-batch m and accumulation a is then priced a × (fixed per micro-batch + per FLOP × FLOPs
of m) + fixed per step + optimizer (harness.predict.model.compute_durations). Records without the anatomy
keep the step less the optimizer per FLOP, so a stack's fixed costs scale with the tokens there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import cast

import numpy as np
from scipy.stats import linregress

from backends import get_backend
from backends.schedule import Steps
from core.config import RunConfig
from core.records import run_config
from harness.analyze.anatomy import resolved
from harness.analyze.metrics import summarize
from harness.predict import margin
from harness.predict.hardware import Profile
from harness.predict.memory import memory

ASSUMED_ACTIVATION_FACTOR = (0.8, 1.0, 1.25)
NORMAL_P10_P90 = 2 * 1.2816  # p90 - p10 of a normal distribution, in σ


@dataclass
class Calibration:
    """What measured records tell the model: forward+backward seconds per FLOP, the fixed seconds each
    micro-batch and each step pay whatever their size, and optimizer seconds per parameter at the
    fast/nominal/slow corners (None: assumed, or not split from the step), the activation factor, and
    provenance: `fit` says how the step was split, from which runs (split_step)."""

    seconds_per_flop: tuple | None = None
    fixed_per_micro_batch_s: tuple | None = None
    fixed_per_step_s: tuple | None = None
    optimizer_seconds_per_param: tuple | None = None
    activation_factor: tuple = ASSUMED_ACTIVATION_FACTOR
    step_cv: float | None = None  # a rank's step-to-step variation (σ / median), from the runs' p10-p90
    # Per-GPU throughput lost per doubling of N beyond a node at the slow end, fitted on published runs
    # (harness.predict.margin): empirical, not modelled; 0 gives the model's own band.
    empirical_scale_loss: float = 0.0
    sources: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    fit: dict | None = None

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


# How the step was split (Calibration.fit's method)
PER_FLOP = "per FLOP: the step less the optimizer"
PARTS = "anatomy parts"
LINE = "least-squares line"


@dataclass(frozen=True)
class StepPoint:
    """One calibration run as the fit reads it: its batch, its median step with the p10 and p90, the
    forward+backward FLOPs of its step, and its anatomy's parts (seconds per step; None where absent)."""

    run_id: str
    micro_batch: int
    accum: int
    seq_len: int
    flops: float
    step: tuple[float, float, float]  # p10, median, p90
    optimizer_s: float
    forward_backward_s: float | None
    other_s: float | None

    @property
    def tokens_per_micro(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def per_micro_s(self) -> float:
        """Forward+backward seconds of one micro-batch."""
        return cast(float, self.forward_backward_s) / self.accum

    def spread(self) -> tuple[float, float]:
        """The step's p10 and p90 less the optimizer, over its median less the optimizer: how much faster
        and slower than nominal the run's compute went."""
        p10, median, p90 = self.step
        base = median - self.optimizer_s
        return ((p10 - self.optimizer_s) / base, (p90 - self.optimizer_s) / base) if base > 0 else (1.0, 1.0)


def anatomy_split(summary: dict) -> tuple[float | None, float | None, str | None]:
    """(forward+backward, other) seconds per step from a run's anatomy, or why they cannot be read from
    it: forward, backward and optimizer timed, and "other" resolved (a difference negative beyond its
    noise says the parts do not split the step)."""
    anatomy = summary.get("anatomy")
    if not anatomy:
        return None, None, "no anatomy (a record made before the anatomy steps)"
    parts = anatomy["parts"]
    for name in ("forward", "backward", "optimizer"):
        if parts[name]["status"] != "measured":
            return None, None, f"its anatomy has no {name} ({parts[name]['method']})"
    other = resolved(anatomy, "other")
    if other is None:
        return (
            None,
            None,
            f"its anatomy's other is {parts['other']['status']}: the parts do not split the step",
        )
    return parts["forward"]["s"] + parts["backward"]["s"], other, None


def corners(nominal: float, low: float, high: float) -> tuple[float, float, float]:
    return (nominal * low, nominal, nominal * high)


def split_step(points: list[StepPoint]) -> dict:
    """The split of the step from `points` (every one with its anatomy): seconds_per_flop, the fixed cost
    per micro-batch and per step, each at the fast/nominal/slow corners, and `fit`, what was fitted from
    which runs. A corner scales the nominal figures by the fastest p10 and the slowest p90 of the runs'
    steps (less the optimizer) over their medians, as the per-FLOP calibration's band does."""
    low = min(p.spread()[0] for p in points)
    high = max(p.spread()[1] for p in points)
    other = float(np.median([p.other_s for p in points]))
    runs = [p.run_id for p in points]
    micro_batches = sorted({p.micro_batch for p in points})
    if len({p.tokens_per_micro for p in points}) >= 2:
        x = np.array([p.tokens_per_micro for p in points], float)
        y = np.array([p.per_micro_s for p in points], float)
        line = linregress(x, y)
        flops_per_token = float(np.median([p.flops / p.accum / p.tokens_per_micro for p in points]))
        per_flop = float(line.slope) / flops_per_token
        per_micro = float(line.intercept)
        detail = {
            "method": LINE,
            "description": (
                f"forward+backward per micro-batch against its tokens over {len(points)} run(s) at "
                f"micro-batches {', '.join(map(str, micro_batches))}: {line.slope * 1e6:.4g} us a token, "
                f"{per_micro * 1e3:.4g} ms fixed a micro-batch; the step's other "
                f"{other * 1e3:.4g} ms fixed a step"
            ),
            "slope_s_per_token": float(line.slope),
            "slope_stderr": float(line.stderr),
            "intercept_s": per_micro,
            "intercept_stderr": float(line.intercept_stderr),
            "rvalue": float(line.rvalue),
        }
    else:
        per_flop = float(np.median([cast(float, p.forward_backward_s) / p.flops for p in points]))
        per_micro = 0.0
        detail = {
            "method": PARTS,
            "description": (
                f"forward+backward per FLOP from the anatomy of {len(points)} run(s) at micro-batch "
                f"{micro_batches[0]}; the step's other {other * 1e3:.4g} ms fixed a step (a fixed cost "
                "inside forward and backward needs runs at a second micro-batch to be told apart)"
            ),
        }
    return {
        "seconds_per_flop": corners(per_flop, low, high),
        "fixed_per_micro_batch_s": corners(per_micro, low, high),
        "fixed_per_step_s": corners(other, low, high),
        "fit": {
            **detail,
            "runs": runs,
            "points": [
                {
                    "run_id": p.run_id,
                    "micro_batch": p.micro_batch,
                    "grad_accum": p.accum,
                    "forward_backward_s": p.forward_backward_s,
                    "other_s": p.other_s,
                    "optimizer_s": p.optimizer_s,
                    "step_time_s": p.step[1],
                }
                for p in points
            ],
        },
    }


def calibrate(records: list[dict], cfg: RunConfig, profile: Profile) -> Calibration:
    """Compute from the ok training records of the same stack (label) at one rank on the profile's device
    (same device name, or CPU for the local profile) and precision: where they carry the step's anatomy,
    forward+backward per FLOP and the fixed costs per micro-batch and per step (split_step); where none
    does, the step time less the optimizer time per FLOP of forward+backward; and the optimizer time per
    parameter. Records that do not match are named in the notes, never used. The slow end carries the
    empirical scale-loss margin of the published rows."""
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
    summaries = {r["run_id"]: summarize(r) for r in candidates}
    # The runs whose anatomy splits the step are the calibration wherever there is one; the others' step
    # cannot be split, so they are not mixed in
    split = {r["run_id"]: anatomy_split(summaries[r["run_id"]]) for r in candidates}
    if any(why is None for _, _, why in split.values()):
        for r in candidates:
            if split[r["run_id"]][2] is not None:
                calib.notes.append(f"{r['run_id']}: not used ({split[r['run_id']][2]}; others have it)")
        candidates = [r for r in candidates if split[r["run_id"]][2] is None]
    # Repeats (separate launches) of the same run: the median of their median steps, the band from the
    # lowest p10 to the highest p90, as launches on a shared machine differ by more than steps within one.
    # The optimizer is priced per parameter where every run timed it; where only some did, it is counted
    # within the FLOP rate for all of them (their t_opt 0), so the runs stay comparable
    timed_optimizer = all(has_optimizer_times(r) for r in candidates)
    if not timed_optimizer and any(has_optimizer_times(r) for r in candidates):
        calib.notes.append(
            "optimizer times in some calibration runs only: counted within the FLOP rate for all of them"
        )
    flops, nominal, fast, slow, optimizer, cvs, points = 0.0, [], [], [], [], [], []
    for record in candidates:
        rc = run_config(record)
        summary = summaries[record["run_id"]]
        timed_ranks = [r for r in record["ranks"] if r.get("status") == "ok"] if timed_optimizer else []
        opt = [t for r in timed_ranks for t in r.get("optimizer_step_times") or []]
        t_opt = float(np.median(opt)) if opt else 0.0
        flops = float(np.sum(segment_flops(rc, Steps(rc))))
        step = summary["step_time_s"]
        nominal.append((step["median"] - t_opt) / flops)
        cvs.append((step["p90"] - step["p10"]) / NORMAL_P10_P90 / step["median"])
        fast.append((step["p10"] - t_opt) / flops)
        slow.append((step["p90"] - t_opt) / flops)
        if opt:
            optimizer.append(t_opt / rc.model.spec.n_params)
        elif not has_optimizer_times(record):
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
                "micro_batch": rc.batch.micro_batch,
                "grad_accum": rc.batch.grad_accum,
            }
        )
        forward_backward, other, _ = split[record["run_id"]]
        points.append(
            StepPoint(
                run_id=record["run_id"],
                micro_batch=rc.batch.micro_batch,
                accum=rc.batch.grad_accum,
                seq_len=rc.model.spec.seq_len,
                flops=flops,
                step=(step["p10"], step["median"], step["p90"]),
                optimizer_s=t_opt,
                forward_backward_s=forward_backward,
                other_s=other,
            )
        )
    calib.seconds_per_flop = (min(fast), float(np.median(nominal)), max(slow))
    calib.fit = {
        "method": PER_FLOP,
        "description": f"the step less the optimizer per FLOP of forward+backward, over {len(points)} run(s) "
        "without the step's anatomy: a fixed cost of the step scales with its tokens here",
        "runs": [p.run_id for p in points],
    }
    calib.step_cv = float(np.median(cvs))
    if timed_optimizer:
        calib.optimizer_seconds_per_param = (float(np.median(optimizer)),) * 3
    if all(p.forward_backward_s is not None for p in points):
        for name, value in split_step(points).items():
            setattr(calib, name, value)
        if calib.fixed_per_micro_batch_s is not None and calib.fixed_per_micro_batch_s[1] < 0:
            calib.notes.append(
                f"the fixed cost per micro-batch fitted below zero ({calib.fit['intercept_s'] * 1e3:.3g} ms, "
                f"standard error {calib.fit['intercept_stderr'] * 1e3:.3g} ms): kept as fitted"
            )
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
