"""TensorFlow MultiWorkerMirroredStrategy's collectives in a step (framework-free)."""

from __future__ import annotations

from backends.schedule import CommTerm, Schedule, whole_tensors
from core.config import RunConfig


def mwms_schedule(cfg: RunConfig) -> Schedule:
    """apply_gradients all-reduces every fp32 gradient once a step, after the whole backward, packed into
    one collective (the strategy's all-reduce of the gradient list), not overlapped with compute."""
    return whole_tensors(
        cfg,
        [CommTerm("all_reduce", cfg.model.spec.n_params, 4, 1, "gradients")],
        "one packed all-reduce after backward (not overlapped)",
    )
