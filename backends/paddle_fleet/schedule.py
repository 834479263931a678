"""Paddle Fleet's collectives in a step: DataParallel's gradient groups, or the sharding stages' terms
(framework-free)."""

from __future__ import annotations

from backends.base import parameter_numels
from backends.schedule import Call, CommTerm, MiB, Schedule, Steps, Term, buckets, unit_of, whole_tensors
from core.config import RunConfig

# fleet DistributedStrategy's defaults, which fleet.distributed_model hands paddle.DataParallel
GROUP_BYTES = 32 * MiB  # fuse_grad_size_in_MB
LAST_GROUP_BYTES = 1 * MiB  # last_comm_group_size_MB


def data_parallel(cfg: RunConfig, dtype_bytes: int) -> Schedule:
    """paddle.DataParallel all-reduces the gradients once a step (no_sync before the last micro-batch). It
    groups parameters in model order, the first group closed at last_comm_group_size_MB and the others at
    fuse_grad_size_in_MB, and hands the reducer the groups reversed (assign_group_by_size, then
    reversed(group_indices)): the small group, the embeddings, is the last all-reduced, and a group goes
    once all its gradients are ready."""
    steps = Steps(cfg)
    groups = buckets(list(parameter_numels(cfg).items()), GROUP_BYTES, LAST_GROUP_BYTES, dtype_bytes)
    calls = [
        Call(elements, max(steps.at("backward", unit_of(n)) for n in names), steps.optimizer)
        for names, elements in reversed(groups)
    ]
    return Schedule(
        (Term("all_reduce", "gradients", dtype_bytes, 1, calls),),
        "fleet DataParallel buckets (32 MB, last 1 MB) during backward",
    )


def sharded(cfg: RunConfig, stage: int, dtype_bytes: int) -> Schedule:
    """Stage 1 reduces gradients to their owners in the optimizer step and broadcasts the updated
    parameters (an all-reduce's volume, once per step), and on CPU gloo's reduce also gathers each reduced
    chunk to its owner; stages 2 and 3 reduce gradients in backward hooks, every micro-batch, and stage 3
    gathers parameters for forward and for backward (stages 2 and 3 run only on GPU: assumed, not yet
    measured). Their issue order is not modelled: whole tensors, not overlapped."""
    n, accum = cfg.model.spec.n_params, cfg.batch.grad_accum
    terms = [CommTerm("reduce_scatter", n, dtype_bytes, 1 if stage == 1 else accum, "gradients")]
    if stage == 3:
        terms.append(CommTerm("all_gather", n, dtype_bytes, 2 * accum, "parameters (forward and backward)"))
    else:
        terms.append(CommTerm("all_gather", n, dtype_bytes, 1, "updated parameters"))
    if stage == 1 and cfg.topology.device != "cuda":
        # gloo's reduce (gloo/reduce.cc) is a ring reduce-scatter and then a gather of each rank's chunk to
        # the root, so a rank also sends its reduced chunk of every tensor it does not own: on average
        # (n-1)/n x S/n, an all-gather's bytes for S/n (1/(2n) of the two terms above)
        terms.append(
            CommTerm(
                "all_gather",
                n // cfg.topology.world_size,
                dtype_bytes,
                1,
                "reduced chunks gathered to each gradient's owner (gloo's reduce)",
            )
        )
        note = (
            "on CPU gloo's reduce is a ring reduce-scatter then a gather to the root: each rank also "
            "sends its 1/n chunk of every gradient it does not own, counted as an all-gather of 1/n of "
            "the gradients (the same bytes; 1 + 1/(2n) times the reduce-scatter and all-gather)"
        )
    else:
        note = "" if stage == 1 else "stages 2/3: per-micro-batch reduction assumed"
    return whole_tensors(
        cfg,
        terms,
        f"fleet sharding stage {stage}: whole tensors, not overlapped (issue order not modelled)",
        note,
    )


def fleet_schedule(cfg: RunConfig, stage: int, dtype_bytes: int) -> Schedule:
    """Gradients travel in the parameters' dtype (`dtype_bytes`: fp32 under O1, bf16/fp16 under O2)."""
    return data_parallel(cfg, dtype_bytes) if stage == 0 else sharded(cfg, stage, dtype_bytes)
