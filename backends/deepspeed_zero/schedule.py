"""DeepSpeed ZeRO's collectives in a step, stage by stage (framework-free; the engine's settings and what
the traces showed: comm.py)."""

from __future__ import annotations

from backends.base import parameter_numels
from backends.deepspeed_zero.comm import (
    DEFAULTS,
    REDUCE_BUCKET_ELEMENTS,
    Stage3,
    partitioned,
    regathered_blocks,
    step_scalars,
)
from backends.schedule import Call, Schedule, Steps, Term, unit_of
from core.config import RunConfig
from workloads.spec import OPTIMIZER

BUCKET_ELEMENTS = REDUCE_BUCKET_ELEMENTS  # stages 1 and 2 run with DeepSpeed's default reduce_bucket_size


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


def gradient_order(cfg: RunConfig) -> list[str]:
    """The parameters in the order backward hands ZeRO-3 their gradients (its hooks fire as each one's
    gradient is accumulated): the modules in reverse, each module's own in its order (a Linear's weight
    before its bias, where plain torch hands the bias first: ZeRO-3's memory_efficient_linear, on by
    default, replaces F.linear with its own autograd function, zero/linear.py
    LinearFunctionForZeroStage3), the tied token embedding last (its gradient is complete only after the
    embedding's backward). The comm trace of a tuned run on tests/test_equivalence.py's
    RECORD_SHAPE, whose reduce bucket (d^2) holds a matrix or a few small tensors, shows this order."""
    modules: dict[str, list[str]] = {}
    for name in cfg.model.spec.parameter_shapes():
        modules.setdefault(name.rsplit(".", 1)[0] if "." in name else name, []).append(name)
    return [name for names in reversed(modules.values()) for name in names]


def reduce_buckets(cfg: RunConfig, steps: Steps, micro: int, bucket: int) -> list[tuple[int, int]]:
    """(segment, elements) of each reduce-scatter of one micro-batch's backward at ZeRO-3: gradients join
    the bucket in gradient_order, and one that would take it past `bucket` (reduce_bucket_size) elements
    first sends what it holds (stage3.py reduce_independent_p_g_buckets_and_remove_grads), so a gradient
    over the bucket goes alone; the rest goes at the end of backward. One reduce-scatter per bucket, of
    its tensors each padded to a multiple of the ranks (coalesced_collectives.reduce_scatter_coalesced),
    issued in the segment whose gradient sends it. One bucket at the end while the model has fewer than
    `bucket` parameters."""
    numels, world = parameter_numels(cfg), cfg.topology.world_size
    out, held, padded = [], 0, 0
    for name in gradient_order(cfg):
        n = numels[name]
        if held and held + n > bucket:
            out.append((steps.at("backward", unit_of(name), micro), padded))
            held = padded = 0
        held += n
        padded += -(-n // world) * world  # reduce_scatter_coalesced pads each tensor to a multiple of N
    if held:
        out.append((steps.last_backward(micro), padded))
    return out


def zero_schedule(
    cfg: RunConfig,
    stage: int,
    element_bytes: int,
    module_precision: str,
    overlap_comm: bool = True,
    settings: Stage3 = DEFAULTS,
    gather_bytes: int | None = None,
) -> Schedule:
    """Gradients travel in `element_bytes` elements (the engine's communication dtype), parameters in
    `gather_bytes` (the module's dtype; default: `element_bytes`); `module_precision` decides the
    optimizer's scalars; `settings`: ZeRO-3's. Stages 0-2 run with overlap_comm off (DeepSpeed's
    default below stage 3), so a bucket's reduction holds up the compute that follows it: stage 0 and 1
    reduce at the accumulation boundary, stage 2 after every micro-batch's backward; stages 1 and 2
    all-gather the updated parameters after the step (all_gather_dp_groups: one all_gather_into_tensor per
    parameter group, allgather_bucket_size unused)."""
    gather_bytes = element_bytes if gather_bytes is None else gather_bytes
    if stage == 3:
        return zero3(cfg, element_bytes, module_precision, overlap_comm, settings, gather_bytes)
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
    terms.append(Term("all_gather", "updated parameters", gather_bytes, 1, groups))
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
    settings: Stage3 = DEFAULTS,
    gather_bytes: int | None = None,
) -> Schedule:
    """Stage 3 with overlap_comm on (its default) gathers the partitioned parameters of every micro-batch's
    forward as the coordinator fetches them (`fetches`: the embedding's on demand, then prefetch buckets,
    as a run's comm trace shows), each call issued one unit ahead of the unit that needs its first
    parameter (the head's weight is the tied embedding, already gathered); gathers again, before their
    backward, the blocks whose reuse is beyond stage3_max_reuse_distance, in prefetch buckets of their own
    (the others stay gathered: `kept_blocks`); reduce-scatters gradients in reduce_bucket_size buckets on a
    side stream as backward fills them (reduce_buckets), the next micro-batch or the optimizer waiting for
    them; and after the step gathers every persistent parameter (`_post_step`'s
    all_gather(persistent_parameters), whose _allgather_params_coalesced launches one
    all_gather_into_tensor per parameter: 51 a step on tiny, as its comm trace shows), each priced as a call
    of its own. With overlap_comm off the gathers run on the compute stream (DeepSpeed's allgather stream is
    then the default one), so nothing is fetched ahead: a unit waits for its own gather, and a bucket's
    reduction holds up the backward that follows it."""
    gather_bytes = element_bytes if gather_bytes is None else gather_bytes
    prefetch_bucket = settings.prefetch_bucket
    steps = Steps(cfg)
    numels = parameter_numels(cfg)
    part = partitioned(numels, settings.persistence_threshold)
    again = regathered_blocks(numels, settings)
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
            for filled, size in reduce_buckets(cfg, steps, m, settings.reduce_bucket)
        ]
    persistent = [
        Call(size, steps.optimizer, None, "persistent parameter")
        for name, size in numels.items()
        if name not in part
    ]
    accum = cfg.batch.grad_accum
    terms = [  # reductions first: a micro-batch's end issues them before the next one's first gathers
        Term("reduce_scatter", "gradients", element_bytes, accum, reduces),
        Term("all_gather", "partitioned parameters (forward)", gather_bytes, accum, gathers),
        Term("all_gather", "parameters re-gathered for backward", gather_bytes, accum, regathers),
        *scalar_terms(steps, 3, module_precision),
        Term("all_gather", "persistent parameters, after the optimizer step", gather_bytes, 1, persistent),
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
        f"stage3_param_persistence_threshold={settings.persistence_threshold} ({held:,} elements in tensors "
        f"kept whole on every rank), stage3_max_live_parameters={settings.max_live_parameters}, "
        f"stage3_max_reuse_distance={settings.max_reuse_distance}, "
        f"stage3_prefetch_bucket_size={prefetch_bucket}, reduce_bucket_size={settings.reduce_bucket}",
        kept_blocks=frozenset(range(cfg.model.spec.n_layers)) - set(again),
    )
