"""DeepSpeed ZeRO's communication per step, as the engine behaves with the settings it is given (the
schedule itself, which the analytic volume and the prediction read: schedule.py).

Stage 0 all-reduces the gradients at the accumulation boundary. Stages 1 and 2 reduce each gradient for
its owner's partition (stage 1 at the boundary only, stage 2 in every backward) and all-gather the updated
parameters after the step. The reduction is an all-reduce, not a reduce-scatter: DeepSpeed 0.19's
stage_1_and_2.py sends stage 1's gradients through buffered_reduce_fallback and stage 2's (`reduce_scatter`
on, its default) through average_tensor -> allreduce_no_retain(rank=owner), both dist.all_reduce of the
whole bucket, each rank keeping its own slice. The collective trace of a run shows it (c10d::allreduce_ of
every gradient element), and its bytes are an all-reduce's, 2(N-1)/N of the gradients, not (N-1)/N.
Stage 3 gathers the partitioned parameters for every micro-batch's forward and reduce-scatters gradients
in every backward; what it gathers depends on two settings, which ds_config sets explicitly so that each
record names them:
- stage3_param_persistence_threshold: a tensor of at most this many elements persists (stays whole on
  every rank), so forward and backward never gather it; but its optimizer step is partitioned like every
  other's, so after each step the engine all-gathers the persistent tensors once (stage3.py `_post_step`:
  `persistent_parameters[0].all_gather(persistent_parameters)`). The collective trace showed it: 52
  gathers of 128-element LayerNorm tensors in two steps on tiny (accum 2), and the bytes agree only with
  this term;
- stage3_max_reuse_distance: after forward, a module's parameters stay gathered if the engine will use them
  again before it has fetched this many more parameter elements. Between a block's forward and its
  backward the engine fetches the later blocks' parameters twice (their forward, then their backward),
  so a block is re-gathered for backward only when those exceed the distance: for models up to ~500M
  parameters with the default, every parameter is gathered once per micro-batch.
"""

from __future__ import annotations

from backends.schedule import CommTerm

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold
MAX_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's default stage3_max_reuse_distance
PREFETCH_BUCKET_ELEMENTS = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size


def stage3_settings(prefetch_bucket: int = PREFETCH_BUCKET_ELEMENTS) -> dict:
    return {
        "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        "stage3_max_reuse_distance": MAX_REUSE_DISTANCE,
        "stage3_prefetch_bucket_size": prefetch_bucket,
    }


def partitioned(numels: dict[str, int]) -> dict[str, int]:
    """The tensors ZeRO-3 partitions (the others persist whole on every rank)."""
    return {name: n for name, n in numels.items() if n > PERSISTENCE_THRESHOLD}


def regathered_blocks(numels: dict[str, int]) -> dict[int, int]:
    """Block index -> elements of its partitioned parameters, for the blocks released after forward and
    gathered again for backward: block i, when the later blocks' partitioned parameters, fetched twice in
    between, exceed the reuse distance. The others stay gathered from their forward to their backward."""
    per_block: dict[int, int] = {}
    for name, n in partitioned(numels).items():
        if name.startswith("blocks."):
            index = int(name.split(".")[1])
            per_block[index] = per_block.get(index, 0) + n
    out, later = {}, 0
    for i in sorted(per_block, reverse=True):  # one pass from the last block: `later` is what follows i
        if 2 * later >= MAX_REUSE_DISTANCE:
            out[i] = per_block[i]
        later += per_block[i]
    return out


def regathered_for_backward(numels: dict[str, int]) -> int:
    """Elements gathered a second time for backward in a step (regathered_blocks, summed)."""
    return sum(regathered_blocks(numels).values())


def step_scalars(stage: int, precision: str) -> list[CommTerm]:
    """The scalar all-reduces the ZeRO optimizer issues once a step, after the gradients' reduction, as the
    collective trace shows them (tiny, 2 ranks, stages 0-3, fp32 and bf16, accumulation 1 and 2): stages 1
    and 2 two fp32 scalars of the gradient norm (get_grad_norm_direct) and, with a bf16 module (DeepSpeed's
    native bf16, not torch_autocast over fp32 parameters), the 1-byte overflow flag (has_overflow); stage 3
    two fp64 scalars; stage 0 none. `precision`: the module's dtype (backends.deepspeed_zero's
    module_precision). fp16 is taken to check overflow as bf16 does (not traced). A few bytes: their cost is
    a collective's latency, not volume."""
    if stage in (1, 2):
        terms = [CommTerm("all_reduce", 1, 1, 1, "overflow flag")] if precision != "fp32" else []
        return terms + [CommTerm("all_reduce", 1, 4, 2, "gradient-norm scalars")]
    if stage == 3:
        return [CommTerm("all_reduce", 1, 8, 2, "gradient-norm scalars (fp64)")]
    return []
