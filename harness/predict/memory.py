"""A rank's memory, term by term, and what fits on a device: the predictor's terms (model state as the stack
holds it, gathered parameters and prefetch, communication buffers, activations), the attention a stack
materialises, the allocator margin, and the largest micro-batch that fits a rank's share of a global batch
(strong scaling, as users run it: the micro-batch that fits, and gradient accumulation for the rest).
`harness predict` prices each point's memory so, `harness select` sizes every candidate so, and
`harness predict --global-batch` each N. One module, as the bytes and whether they fit are one question.
"""

from __future__ import annotations

from backends import get_backend
from backends.base import parameter_numels
from backends.schedule import Schedule
from core.config import RunConfig
from harness.analyze.summary import fmt_bytes
from harness.predict.hardware import Profile

# Activations per layer per sequence position, in units of d_model x element bytes (Korthikanti et al.
# 2022, "Reducing Activation Recomputation in Large Transformer Models", 34·s·b·h bytes at 2-byte
# elements = 17 elements; attention scores are not stored, as SDPA's fused kernels recompute them).
ACTIVATION_ELEMENTS_PER_LAYER = 17
# What the caching allocator and the framework's runtime take beyond the modelled terms: a fraction of the
# device kept free (fragmentation, the CUDA context, NCCL's own buffers, cuBLAS workspaces).
ALLOCATOR_MARGIN = 0.10
MICRO_BATCHES = (64, 32, 16, 8, 4, 2, 1)  # tried largest first: the largest that fits is taken


def activation_bytes(cfg: RunConfig, element_bytes: int) -> dict:
    """Activations of one micro-batch kept for backward, and the logits' fp32 copies for the loss."""
    spec = cfg.model.spec
    tokens = cfg.batch.micro_batch * spec.seq_len
    layer = ACTIVATION_ELEMENTS_PER_LAYER * tokens * spec.d_model * element_bytes
    if (
        cfg.model.activation_checkpointing
    ):  # each block's input kept, one block's activations during recompute
        blocks = spec.n_layers * tokens * spec.d_model * element_bytes + layer
    else:
        blocks = spec.n_layers * layer
    logits = tokens * spec.vocab_size * (element_bytes + 8)  # logits, fp32 softmax and its gradient
    return {"blocks": blocks, "logits": logits}


def memory(cfg: RunConfig, factor: float, plan: Schedule | None = None) -> dict:
    """Bytes per rank: model state by sharding (the spec's rule, as the summary's analytic value), the
    parameters a sharded stack gathers for the block it computes and the one it prefetches, the buffers
    communication keeps, and activations (scaled by the activation factor). `plan`: cfg's schedule, where
    the caller has it."""
    backend = get_backend(cfg.backend)
    sharding = backend.sharding(cfg)
    plan = plan or backend.schedule(cfg)
    element = 4 if cfg.model.precision == "fp32" else 2
    state = backend.model_state_bytes(cfg)["total"]
    numels = parameter_numels(cfg)
    blocks = [0] * cfg.model.spec.n_layers
    for name, n in numels.items():
        if name.startswith("blocks."):
            blocks[int(name.split(".")[1])] += n
    largest_block = max(blocks)
    gathered = 0.0
    if sharding == "parameters" and cfg.topology.world_size > 1:
        root = cfg.model.spec.n_params - sum(n for name, n in numels.items() if name.startswith("blocks."))
        # the blocks the stack's schedule keeps whole from forward to backward (FSDP2 without
        # reshard_after_forward; ZeRO-3's within stage3_max_reuse_distance), at its start all at once;
        # else two blocks in flight (the one computed and the one prefetched); the root; one block's full
        # gradient
        kept = sum(blocks[i] for i in plan.kept_blocks)
        in_flight = 0 if len(plan.kept_blocks) == cfg.model.spec.n_layers else 2 * largest_block
        # gathered in the dtype the stack gathers in (FSDP2's param_dtype; fp32 under DeepSpeed's autocast)
        gather = next(t.dtype_bytes for t in plan.terms if t.op == "all_gather")
        gathered = (kept + in_flight + root) * gather + largest_block * 4
    buffers = 0.0
    if sharding == "none" and cfg.topology.world_size > 1:
        buffers = cfg.model.spec.n_params * 4  # DDP/Paddle buckets and TF's pack are a copy of the gradients
    act = activation_bytes(cfg, element)
    activations = factor * (act["blocks"] + act["logits"])
    terms = {
        "model_state": state,
        "gathered_parameters": gathered,
        "comm_buffers": buffers,
        "activations": activations,
    }
    return {**terms, "total": sum(terms.values())}


def peak_memory(cfg: RunConfig, factor: float = 1.0, plan=None) -> dict:
    """Bytes per rank: the predictor's terms (model state as the stack holds it, gathered parameters and
    prefetch, communication buffers, activations) and the attention a stack materialises where its
    settings say so (backend.settings()["attention"]: TF's (B,H,T,T) logits, and Paddle's off a GPU)."""
    backend = get_backend(cfg.backend)
    terms = memory(cfg, factor, plan)
    terms.pop("total")
    attention = (backend.settings(cfg) or {}).get("attention") or {}
    terms["materialised_attention"] = float(attention.get("bytes_held_for_backward", 0))
    return {**terms, "total": sum(terms.values())}


def fit_check(terms: dict, capacity: float | None, margin: float = ALLOCATOR_MARGIN) -> str | None:
    """None when the terms fit the device less the allocator margin; else why not, naming the term that
    broke it (the one whose addition, in order, first passes the usable memory)."""
    if not capacity:
        return None
    usable = capacity * (1 - margin)
    running = 0.0
    for name, value in terms.items():
        if name == "total":
            continue
        running += value
        if running > usable:
            return (
                f"{name.replace('_', ' ')} ({fmt_bytes(value)}) breaks it: "
                f"{fmt_bytes(terms['total'])} a rank > {fmt_bytes(usable)} usable "
                f"({fmt_bytes(capacity)} less {margin:.0%} allocator margin)"
            )
    return None


def largest_fitting(
    cfg: RunConfig, share: int, capacity: float | None
) -> tuple[RunConfig | None, dict, str | None]:
    """`cfg` at the largest micro-batch that divides `share` (a rank's sequences a step) and fits, with
    the accumulation that makes up the share: (that config, its memory terms, None); or, where none fits,
    (None, the terms at the smallest micro-batch tried, why it does not fit)."""
    terms: dict = {}
    why: str | None = f"no micro-batch of {MICRO_BATCHES} divides {share}"
    for micro in MICRO_BATCHES:
        if share % micro:
            continue
        trial = cfg.evolve(micro_batch=micro, grad_accum=share // micro)
        terms = peak_memory(trial)
        why = fit_check(terms, capacity)
        if why is None:
            return trial, terms, None
    return None, terms, why


def fits(nominal: dict, slow: dict, profile: Profile) -> dict:
    """Whether a rank's memory fits the device, and which term dominates when it does not."""
    if not profile.memory_bytes:
        return {"verdict": "unknown", "why": f"profile {profile.name} states no device memory"}
    terms = {k: v for k, v in nominal.items() if k != "total"}
    dominant = max(terms, key=terms.__getitem__)
    capacity = profile.memory_bytes
    if nominal["total"] > capacity:
        verdict = "no"
    elif slow["total"] > capacity:
        verdict = "tight"
    else:
        verdict = "yes"
    return {
        "verdict": verdict,
        "capacity_bytes": capacity,
        "dominant": dominant,
        "dominant_bytes": terms[dominant],
        "why": f"{dominant.replace('_', ' ')} dominates ({terms[dominant] / 2**30:.1f} GiB of "
        f"{nominal['total'] / 2**30:.1f} GiB; device {capacity / 2**30:.1f} GiB)",
    }
