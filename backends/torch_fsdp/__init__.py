"""torch-fsdp adapter: FSDP2 (`fully_shard`) on every transformer block and on the root, launched by torchrun.

Parameters, gradients and AdamW state are all sharded (ZeRO-3 in FSDP's terms). bf16/fp16 go through FSDP's
MixedPrecisionPolicy: the sharded parameters, gradients and moments stay fp32, and FSDP casts parameters to
the low precision when it all-gathers them, so the gathers move low-precision elements and all of forward
runs in it (param_dtype; no autocast); gradients are reduce-scattered in fp32 (reduce_dtype), as the
suite's bf16 definition (core.precision) and torchtitan's default have it, unless --fp32-reduce off.
"""

import math
from dataclasses import dataclass

from backends.base import Backend, CommPattern, CommTerm, Options, on_off, option, torchrun
from core.config import RunConfig
from core.precision import LOW_PRECISIONS, autocast_numerics

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
EMBEDDINGS = ("tok_emb", "pos_emb")


def gathered_numels(cfg: RunConfig) -> dict[str, int]:
    """Elements each parameter's all-gather returns (and its reduce-scatter takes) under FSDP2, by neutral
    name: FSDP2 cuts a parameter on dim 0 into world-size chunks padded to the first one's length, so dim
    0 counts as rounded up to a multiple of N. Dim 0 in PyTorch's layout: a Linear's out_features (the
    neutral spec stores the transpose, workloads/spec.py), an embedding's rows."""
    world, out = cfg.world_size, {}
    for name, shape in cfg.spec.parameter_shapes().items():
        dim0 = shape[1] if len(shape) == 2 and name not in EMBEDDINGS else shape[0]
        out[name] = math.prod(shape) // dim0 * (-(-dim0 // world) * world)
    return out


@dataclass(frozen=True)
class FSDPOptions(Options):
    reshard_after_forward: bool = option(
        True,
        "--reshard-after-forward",
        choices=("on", "off"),
        parse=on_off,
        help="free each block's gathered parameters after forward and gather them again for backward (on: "
        "less memory), or keep them (off)",
    )
    fp32_reduce: bool = option(
        True,
        "--fp32-reduce",
        choices=("on", "off"),
        parse=on_off,
        help="with bf16/fp16: reduce-scatter gradients in fp32 (on, reduce_dtype=fp32: the suite's "
        "definition) or in the low precision (off: half the bytes)",
    )


class TorchFSDP(Backend[FSDPOptions]):
    name = "torch-fsdp"
    framework = "torch"
    launcher = "torchrun"
    collective_api = "torch.distributed (FSDP2's)"
    # With gradient sync off FSDP would still all-gather every parameter, so only the isolated
    # counterfactual measures compute without communication.
    compute_methods = ("isolated",)
    mixed_precision = "autocast"  # fp32 state, low-precision compute: the same bytes as autocast
    Options = FSDPOptions

    def label(self, cfg):
        opts = self.options(cfg)
        return (
            self.name
            + ("" if opts.reshard_after_forward else "-noreshard")
            + (f"-{cfg.precision}reduce" if self.reduce_bytes(cfg) == 2 else "")
        )

    def reduce_bytes(self, cfg) -> int:
        """Element bytes of the gradients' reduce-scatter: fp32 unless a low-precision run turned
        --fp32-reduce off."""
        low = cfg.precision in LOW_PRECISIONS
        return ELEMENT_BYTES[cfg.precision] if low and not self.options(cfg).fp32_reduce else 4

    def numerics(self, cfg):
        """MixedPrecisionPolicy(param_dtype) casts each unit's parameters as it gathers them, with autocast
        off: every forward op, LayerNorm and the residual stream included, runs in the low precision."""
        if cfg.precision not in LOW_PRECISIONS:
            return autocast_numerics(cfg)
        reduce = "fp32" if self.reduce_bytes(cfg) == 4 else cfg.precision
        return autocast_numerics(
            cfg,
            f"FSDP2 MixedPrecisionPolicy(param_dtype={cfg.precision}, reduce_dtype={reduce}), no autocast",
            forward_params=cfg.precision,
            activations=cfg.precision,
            grad_reduce=reduce,
            why={"grad_reduce": "--fp32-reduce off"},
        )

    def sharding(self, cfg):
        return "parameters"

    def comm_pattern(self, cfg):
        """Per micro-batch, each block's parameters are all-gathered in the compute dtype for forward and,
        when resharded after forward, again for backward; the root's (embeddings, final LayerNorm) once,
        as FSDP2 never reshards the root after forward. Parameters are resharded after every backward, so
        each micro-batch gathers again. Gradients are reduce-scattered in reduce_dtype once per step
        (gradient sync off on the earlier micro-batches). Each tensor counts as FSDP2 pads its shards
        (gathered_numels)."""
        opts = self.options(cfg)
        gather = ELEMENT_BYTES[cfg.precision]
        numels = gathered_numels(cfg)
        blocks = sum(n for name, n in numels.items() if name.startswith("blocks."))
        root = sum(numels.values()) - blocks
        block_gathers = 2 if opts.reshard_after_forward else 1
        return CommPattern(
            (
                CommTerm("all_gather", root, gather, cfg.grad_accum, "root parameters (embeddings, ln_f)"),
                CommTerm("all_gather", blocks, gather, block_gathers * cfg.grad_accum, "block parameters"),
                CommTerm("reduce_scatter", sum(numels.values()), self.reduce_bytes(cfg), 1, "gradients"),
            )
        )

    def launch(self, cfg, run_dir, port, devices):
        return torchrun(self, cfg, run_dir, port, devices)
