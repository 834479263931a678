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
in every backward; what it gathers and how it reduces depend on the settings of `Stage3`, which ds_config
writes into every ZeRO-3 configuration (DeepSpeed's defaults, or the tuned set's: ds_config.py's
stage3_tuning) so that each record names them, and which the schedule reads from the same options:
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
  parameters with the default, every parameter is gathered once per micro-batch;
- stage3_prefetch_bucket_size and reduce_bucket_size: how many elements one all-gather of parameters and
  one reduce-scatter of gradients carry (schedule.py: fetches, reduce_buckets);
- stage3_max_live_parameters: not modelled (schedule.py fetches): where it binds, a withheld prefetch
  becomes an on-demand fetch of one module's parameters. It binds only on models above it (1e9 by
  default), and the tuned set raises it to the model's size there.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.schedule import CommTerm

PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold
MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters
MAX_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's default stage3_max_reuse_distance
PREFETCH_BUCKET_ELEMENTS = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size
REDUCE_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce_bucket_size (and allgather_bucket_size)


@dataclass(frozen=True)
class Stage3:
    """The ZeRO-3 settings that decide what the engine gathers, keeps and reduces, each DeepSpeed's default
    (deepspeed/runtime/zero/config.py) unless a run sets it. ds_config writes all five into the engine's
    configuration, so a record names them; the schedule reads the same object, so it prices the settings
    the engine ran with.
    - persistence_threshold: tensors of at most this many elements persist (never gathered in forward or
      backward; all-gathered once after each step);
    - max_live_parameters: the gathered parameter elements above which the coordinator prefetches no more
      (partitioned_param_coordinator.py: the prefetch takes min(this - available, prefetch bucket));
    - max_reuse_distance: a module's parameters stay gathered after its forward if it is used again within
      this many fetched elements (regathered_blocks);
    - prefetch_bucket: elements each prefetch gathers in one all_gather (fetches);
    - reduce_bucket: elements of gradients reduce-scattered together (stage3.py
      reduce_independent_p_g_buckets_and_remove_grads; reduce_buckets)."""

    persistence_threshold: int = PERSISTENCE_THRESHOLD
    max_live_parameters: int = MAX_LIVE_PARAMETERS
    max_reuse_distance: int = MAX_REUSE_DISTANCE
    prefetch_bucket: int = PREFETCH_BUCKET_ELEMENTS
    reduce_bucket: int = REDUCE_BUCKET_ELEMENTS

    def config(self) -> dict:
        """The zero_optimization keys, as DeepSpeed's config docs name them."""
        return {
            "stage3_param_persistence_threshold": self.persistence_threshold,
            "stage3_max_live_parameters": self.max_live_parameters,
            "stage3_max_reuse_distance": self.max_reuse_distance,
            "stage3_prefetch_bucket_size": self.prefetch_bucket,
            "reduce_bucket_size": self.reduce_bucket,
        }


DEFAULTS = Stage3()  # DeepSpeed's own


def hidden_size_rule(d_model: int) -> dict[str, int]:
    """Hugging Face's "auto" values for ZeRO-3, from the model's hidden size (transformers,
    integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_finalize, under is_zero3()):
    reduce_bucket_size d^2, stage3_prefetch_bucket_size 0.9 d^2 (written as an int here: DeepSpeed's field
    is a count), stage3_param_persistence_threshold 10 d."""
    return {
        "reduce_bucket": d_model * d_model,
        "prefetch_bucket": int(0.9 * d_model * d_model),
        "persistence_threshold": 10 * d_model,
    }


def partitioned(numels: dict[str, int], threshold: int = PERSISTENCE_THRESHOLD) -> dict[str, int]:
    """The tensors ZeRO-3 partitions (the others, of at most `threshold` elements, persist whole on every
    rank)."""
    return {name: n for name, n in numels.items() if n > threshold}


def regathered_blocks(numels: dict[str, int], settings: Stage3 = DEFAULTS) -> dict[int, int]:
    """Block index -> elements of its partitioned parameters, for the blocks released after forward and
    gathered again for backward: block i, when the later blocks' partitioned parameters, fetched twice in
    between, exceed the reuse distance. The others stay gathered from their forward to their backward."""
    per_block: dict[int, int] = {}
    for name, n in partitioned(numels, settings.persistence_threshold).items():
        if name.startswith("blocks."):
            index = int(name.split(".")[1])
            per_block[index] = per_block.get(index, 0) + n
    out, later = {}, 0
    for i in sorted(per_block, reverse=True):  # one pass from the last block: `later` is what follows i
        if 2 * later >= settings.max_reuse_distance:
            out[i] = per_block[i]
        later += per_block[i]
    return out


def regathered_for_backward(numels: dict[str, int], settings: Stage3 = DEFAULTS) -> int:
    """Elements gathered a second time for backward in a step (regathered_blocks, summed)."""
    return sum(regathered_blocks(numels, settings).values())


def step_scalars(stage: int, precision: str) -> list[CommTerm]:
    """The scalar all-reduces the ZeRO optimizer issues once a step, after the gradients' reduction, as the
    collective trace shows them (tiny, 2 ranks, stages 0-3, fp32 and bf16, accumulation 1 and 2): stages 1
    and 2 two fp32 scalars of the gradient norm (get_grad_norm_direct) and, with a bf16 module (DeepSpeed's
    native bf16, not torch_autocast over fp32 parameters), the 1-byte overflow flag (has_overflow); stage 3
    two fp64 scalars; stage 0 none. `precision`: the module's dtype (ds_config.py's
    module_precision). fp16 is taken to check overflow as bf16 does (not traced). A few bytes: their cost is
    a collective's latency, not volume."""
    if stage in (1, 2):
        terms = [CommTerm("all_reduce", 1, 1, 1, "overflow flag")] if precision != "fp32" else []
        return terms + [CommTerm("all_reduce", 1, 4, 2, "gradient-norm scalars")]
    if stage == 3:
        return [CommTerm("all_reduce", 1, 8, 2, "gradient-norm scalars (fp64)")]
    return []
