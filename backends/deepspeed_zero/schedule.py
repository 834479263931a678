"""DeepSpeed ZeRO's collectives in a step, stage by stage (framework-free; the engine's settings and what
the traces showed: comm.py)."""

from __future__ import annotations

from backends.base import parameter_numels
from backends.deepspeed_zero.comm import (
    MAX_REUSE_DISTANCE,
    PERSISTENCE_THRESHOLD,
    PREFETCH_BUCKET_ELEMENTS,
    partitioned,
    regathered_blocks,
    step_scalars,
)
from backends.schedule import Call, Schedule, Steps, Term, unit_of
from core.config import RunConfig
from workloads.spec import OPTIMIZER

BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size (and allgather_bucket_size) default


def chunks(elements: int) -> list[int]:
    """A reduction of `elements` in reduce_bucket_size buckets."""
    full, rest = divmod(elements, BUCKET_ELEMENTS)
    return [BUCKET_ELEMENTS] * full + ([rest] if rest else [])


def scalar_terms(steps: Steps, stage: int, module_precision: str) -> list[Term]:
    """The optimizer's scalar all-reduces (comm.step_scalars), after the gradients' reduction and before
    the update, nothing beside them."""
    reduced = steps.last_backward(steps.last)
    return [
        Term(
            t.op, t.what, t.dtype_bytes, t.per_step, [Call(t.elements, reduced, steps.optimizer)] * t.per_step
        )
        for t in step_scalars(stage, module_precision)
    ]


def filled_buckets(cfg: RunConfig, steps: Steps, micro: int) -> list[tuple[int, int]]:
    """(segment, elements) of each reduce_bucket_size bucket of one micro-batch's backward, closed at the
    segment whose gradients fill it (gradients arrive head first, embedding last); the rest of the
    gradients close the last bucket at the end of backward. One bucket at the end while the model has
    fewer than reduce_bucket_size parameters."""
    numels = parameter_numels(cfg)
    per_unit: dict[str, int] = {}
    for name, n in numels.items():
        per_unit[unit_of(name)] = per_unit.get(unit_of(name), 0) + n
    order = ["head", *(f"block.{i}" for i in reversed(range(cfg.model.spec.n_layers))), "embed"]
    out, filled, closed = [], 0, 0
    for unit in order:
        filled += per_unit.get(unit, 0)
        full = filled // BUCKET_ELEMENTS - closed
        out += [(steps.at("backward", unit, micro), BUCKET_ELEMENTS)] * full
        closed += full
    rest = filled - closed * BUCKET_ELEMENTS
    if rest:
        out.append((steps.last_backward(micro), rest))
    return out


def zero_schedule(
    cfg: RunConfig,
    stage: int,
    element_bytes: int,
    module_precision: str,
    overlap_comm: bool = True,
    prefetch_bucket: int = PREFETCH_BUCKET_ELEMENTS,
) -> Schedule:
    """Gradients and parameters travel in `element_bytes` elements (the engine's communication dtype);
    `module_precision` decides the optimizer's scalars. Stages 0-2 run with overlap_comm off (DeepSpeed's
    default below stage 3), so a bucket's reduction holds up the compute that follows it: stage 0 and 1
    reduce at the accumulation boundary, stage 2 after every micro-batch's backward; stages 1 and 2
    all-gather the updated parameters after the step (all_gather_dp_groups: one all_gather_into_tensor per
    parameter group, allgather_bucket_size unused)."""
    if stage == 3:
        return zero3(cfg, element_bytes, module_precision, overlap_comm, prefetch_bucket)
    steps = Steps(cfg)
    n = cfg.model.spec.n_params
    micros = range(cfg.batch.grad_accum) if stage == 2 else [steps.last]
    reductions = [
        Call(size, steps.last_backward(m), steps.last_backward(m) + 1, "gradients")
        for m in micros
        for size in chunks(n)
    ]
    what = "gradients" if stage == 0 else "gradients (owner keeps its slice)"
    terms = [Term("all_reduce", what, element_bytes, len(micros), reductions)]
    terms += scalar_terms(steps, stage, module_precision)
    if stage == 0:
        return Schedule(tuple(terms), "ZeRO-0: reductions hold up compute (overlap_comm off)")
    shapes = cfg.model.spec.parameter_shapes()
    numels = parameter_numels(cfg)
    decay = sum(numels[name] for name, shape in shapes.items() if OPTIMIZER.decays(shape))
    groups = [Call(size, steps.optimizer, None) for size in (decay, n - decay)]  # one per parameter group
    terms.append(Term("all_gather", "updated parameters", element_bytes, 1, groups))
    return Schedule(
        tuple(terms),
        f"ZeRO-{stage}: reductions hold up compute (overlap_comm off)",
        "gradients reduced by dist.all_reduce of each bucket (allreduce_no_retain / buffered_reduce_fallback "
        "in DeepSpeed 0.19), not reduce-scatter",
    )


def fetches(params: list[tuple[str, int]], bucket: int, leading: int = 0) -> list[tuple[str, int]]:
    """(first parameter, elements) of each all_gather DeepSpeed's parameter coordinator issues over
    `params` (partitioned parameters in the order the pass fetches them): the first `leading` as one call
    of their own (the first module's, fetched on demand), then the prefetches (fetch_sub_module), each
    popping the next parameters off the trace until it holds `bucket` elements (stage3_prefetch_bucket_size),
    the last one what is left. One coalesced all_gather_into_tensor per fetch (all_gather_coalesced). Not
    modelled: when each call goes out (DeepSpeed prefetches at every module's fetch, as far ahead as
    stage3_max_live_parameters less what is gathered allows; zero3 issues each bucket one unit ahead of its
    first parameter's unit), that cap withholding a prefetch (a module over the bucket is then fetched alone,
    as it is anyway), and a bucket that would run from the forward's last parameters into backward's first
    re-gathers (each pass is cut on its own)."""
    out = [(params[0][0], sum(n for _, n in params[:leading]))] if leading else []
    first, count = None, 0
    for name, n in params[leading:]:
        first = first or name
        count += n
        if count >= bucket:
            out.append((first, count))
            first, count = None, 0
    if first:
        out.append((first, count))
    return out


def zero3(
    cfg: RunConfig,
    element_bytes: int,
    module_precision: str,
    overlap_comm: bool = True,
    prefetch_bucket: int = PREFETCH_BUCKET_ELEMENTS,
) -> Schedule:
    """Stage 3 with overlap_comm on (its default) gathers the partitioned parameters of every micro-batch's
    forward as the coordinator fetches them (`fetches`: the embedding's on demand, then prefetch buckets,
    as a run's comm trace shows), each call issued one unit ahead of the unit that needs its first
    parameter (the head's weight is the tied embedding, already gathered); gathers again, before their
    backward, the blocks whose reuse is beyond stage3_max_reuse_distance, in prefetch buckets of their own
    (the others stay gathered: `kept_blocks`); reduce-scatters gradients in reduce_bucket_size buckets on a
    side stream as backward fills them (filled_buckets), the next micro-batch or the optimizer waiting for
    them; and after the step gathers every persistent parameter (`_post_step`'s
    all_gather(persistent_parameters), whose _allgather_params_coalesced launches one
    all_gather_into_tensor per parameter: 51 a step on tiny, as its comm trace shows), each priced as a call
    of its own. With overlap_comm off the gathers run on the compute stream (DeepSpeed's allgather stream is
    then the default one), so nothing is fetched ahead: a unit waits for its own gather, and a bucket's
    reduction holds up the backward that follows it."""
    steps = Steps(cfg)
    numels = parameter_numels(cfg)
    part = partitioned(numels)
    again = regathered_blocks(numels)
    units = ["embed", *(f"block.{i}" for i in range(cfg.model.spec.n_layers))]
    order = [(name, n) for name, n in part.items() if unit_of(name) in units]  # forward's fetch order
    first_module = next(iter(numels)).rsplit(".", 1)[0]  # tok_emb, fetched on demand
    leading = sum(1 for name, _ in order if name.rsplit(".", 1)[0] == first_module)
    forward = fetches(order, prefetch_bucket, leading) if order else []
    # backward fetches the re-gathered blocks last block first, each block's modules as its recompute
    # (activation checkpointing) or its backward (reverse order) runs them
    regather_order = []
    for i in sorted(again, reverse=True):
        block = [(name, n) for name, n in part.items() if name.startswith(f"blocks.{i}.")]
        regather_order += block if cfg.model.activation_checkpointing else block[::-1]
    backward = fetches(regather_order, prefetch_bucket) if regather_order else []
    reduces, gathers, regathers = [], [], []
    for m in range(cfg.batch.grad_accum):
        for first, size in forward:
            k = units.index(unit_of(first))
            needed = steps.at("forward", units[k], m)
            ahead = steps.at("forward", units[k - 1] if k else "embed", m)
            gathers.append(Call(size, (ahead if overlap_comm else needed) - 1, needed, "params"))
        for first, size in backward:
            before = steps.at("backward", unit_of(first), m)
            regathers.append(Call(size, before - (2 if overlap_comm else 1), before, "re-gather"))
        end = steps.last_backward(m)
        reduces += [
            Call(size, filled, end + 1 if overlap_comm else filled + 1)
            for filled, size in filled_buckets(cfg, steps, m)
        ]
    persistent = [
        Call(size, steps.optimizer, None, "persistent parameter")
        for name, size in numels.items()
        if name not in part
    ]
    accum = cfg.batch.grad_accum
    terms = [  # reductions first: a micro-batch's end issues them before the next one's first gathers
        Term("reduce_scatter", "gradients", element_bytes, accum, reduces),
        Term("all_gather", "partitioned parameters (forward)", element_bytes, accum, gathers),
        Term("all_gather", "parameters re-gathered for backward", element_bytes, accum, regathers),
        *scalar_terms(steps, 3, module_precision),
        Term("all_gather", "persistent parameters, after the optimizer step", element_bytes, 1, persistent),
    ]
    held = sum(numels.values()) - sum(part.values())
    how = (
        "gathers in prefetch buckets"
        if overlap_comm
        else "blocking gathers in prefetch buckets (overlap_comm off)"
    )
    return Schedule(
        tuple(terms),
        f"ZeRO-3: {how}",
        f"stage3_param_persistence_threshold={PERSISTENCE_THRESHOLD} ({held:,} elements in tensors kept "
        f"whole on every rank), stage3_max_reuse_distance={MAX_REUSE_DISTANCE}, "
        f"stage3_prefetch_bucket_size={prefetch_bucket}",
        kept_blocks=frozenset(range(cfg.model.spec.n_layers)) - set(again),
    )
