"""FSDP2's collectives in a step: per-block gathers one block ahead and per-block reduce-scatters
(framework-free)."""

from __future__ import annotations

import math

from backends.schedule import Call, Schedule, Steps, Term, unit_of
from core.config import RunConfig

EMBEDDINGS = ("tok_emb", "pos_emb")


def gathered_numels(cfg: RunConfig) -> dict[str, int]:
    """Elements each parameter's all-gather returns (and its reduce-scatter takes) under FSDP2, by neutral
    name: FSDP2 cuts a parameter on dim 0 into world-size chunks padded to the first one's length, so dim
    0 counts as rounded up to a multiple of N. Dim 0 in PyTorch's layout: a Linear's out_features (the
    neutral spec stores the transpose, workloads/spec.py), an embedding's rows."""
    world, out = cfg.topology.world_size, {}
    for name, shape in cfg.model.spec.parameter_shapes().items():
        dim0 = shape[1] if len(shape) == 2 and name not in EMBEDDINGS else shape[0]
        out[name] = math.prod(shape) // dim0 * (-(-dim0 // world) * world)
    return out


def fsdp_schedule(
    cfg: RunConfig, gather_bytes: int, reduce_bytes: int, reshard_after_forward: bool
) -> Schedule:
    """Per micro-batch the root's parameters (embeddings, ln_f) are gathered before the first forward and
    never resharded after it (FSDP2 keeps the root's for backward); each block's all-gather is issued while
    the block before it runs (implicit prefetch) in forward and, when resharded after forward, again in
    backward. Parameters are resharded after every backward, so each micro-batch gathers again. Each block's
    gradients are reduce-scattered when its backward ends on the last micro-batch (sync off on the others),
    the root's last. Gathers move `gather_bytes` elements (param_dtype), reduce-scatters `reduce_bytes`
    (reduce_dtype); every tensor as FSDP2 pads its shards (gathered_numels)."""
    steps = Steps(cfg)
    numels = gathered_numels(cfg)
    blocks = [f"block.{i}" for i in range(cfg.model.spec.n_layers)]
    block_elems = dict.fromkeys(blocks, 0)
    for name, n in numels.items():
        if name.startswith("blocks."):
            block_elems[unit_of(name)] += n
    root = sum(numels.values()) - sum(block_elems.values())
    root_gathers, block_gathers = [], []
    for m in range(cfg.batch.grad_accum):
        first = steps.at("forward", "embed", m)
        root_gathers.append(Call(root, first - 1, first, "root parameters"))
        for u in blocks:
            before = steps.at("forward", u, m)
            block_gathers.append(Call(block_elems[u], before - 2, before, "block"))
        if reshard_after_forward:
            for u in blocks:
                before = steps.at("backward", u, m)
                block_gathers.append(Call(block_elems[u], before - 2, before, "block (backward)"))
    reduces = [Call(block_elems[u], steps.at("backward", u), steps.optimizer, u) for u in blocks]
    reduces.append(Call(root, steps.last_backward(steps.last), steps.optimizer, "root gradients"))
    per_micro = 2 if reshard_after_forward else 1
    return Schedule(
        (
            Term(
                "all_gather",
                "root parameters (embeddings, ln_f)",
                gather_bytes,
                cfg.batch.grad_accum,
                root_gathers,
            ),
            Term(
                "all_gather",
                "block parameters",
                gather_bytes,
                per_micro * cfg.batch.grad_accum,
                block_gathers,
            ),
            Term("reduce_scatter", "gradients", reduce_bytes, 1, reduces),
        ),
        "FSDP2 per-block all-gather one block ahead, per-block reduce-scatter in backward, root exposed",
        kept_blocks=frozenset() if reshard_after_forward else frozenset(range(cfg.model.spec.n_layers)),
    )
