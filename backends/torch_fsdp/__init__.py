"""torch-fsdp adapter: FSDP2 (`fully_shard`) on every transformer block and on the root, launched by torchrun.

Parameters, gradients and AdamW state are all sharded (ZeRO-3 in FSDP's terms). bf16/fp16 go through FSDP's
MixedPrecisionPolicy: the sharded parameters, gradients and moments stay fp32, and FSDP casts parameters to
the low precision when it all-gathers them, so the gathers move low-precision elements and all of forward
runs in it (param_dtype; no autocast); gradients are reduce-scattered in fp32 (reduce_dtype), as the
suite's bf16 definition (core.precision) and torchtitan's default have it, unless --fp32-reduce off.
"""

from dataclasses import dataclass

from backends.base import (
    TORCH_DISTRIBUTED_PEER_LOST,
    Backend,
    switch,
    torchrun,
    torchrun_timeouts,
)
from backends.torch_fsdp.schedule import fsdp_schedule
from backends.torch_tuning import TORCHTITAN, TorchTuning, torch_tuned
from core.precision import LOW_PRECISIONS, autocast_numerics

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class FSDPOptions(TorchTuning):
    reshard_after_forward: bool = switch(
        True,
        "--reshard-after-forward",
        help="free each block's gathered parameters after forward and gather them again for backward (on: "
        "less memory), or keep them (off)",
    )
    fp32_reduce: bool = switch(
        True,
        "--fp32-reduce",
        help="with bf16/fp16: reduce-scatter gradients in fp32 (on, reduce_dtype=fp32: the suite's "
        "definition) or in the low precision (off: half the bytes)",
    )


class TorchFSDP(Backend[FSDPOptions]):
    name = "torch-fsdp"
    framework = "torch"
    launcher = "torchrun"
    extra = "torch"
    collective_api = "torch.distributed (FSDP2's)"
    # With gradient sync off FSDP would still all-gather every parameter, so only the isolated
    # counterfactual measures compute without communication.
    compute_methods = ("isolated",)
    mixed_precision = "autocast"  # fp32 state, low-precision compute: the same bytes as autocast
    kubeflow_job = "PyTorchJob"
    trace_reader = "backends.torch_trace"
    peer_lost_texts = TORCH_DISTRIBUTED_PEER_LOST
    Options = FSDPOptions

    def tuned(self, cfg):
        """torchtitan's recipe for a dense transformer: each block compiled before fully_shard, fused
        AdamW, and fully_shard's own defaults for the rest (every block resharded after forward; implicit
        prefetch of the next block's gather, which torchtitan overrides only for MoE models)."""
        return torch_tuned(f"{TORCHTITAN}: each TransformerBlock compiled, then fully_shard")

    def stack_label(self, cfg):
        opts = self.options(cfg)
        return (
            self.name
            + ("" if opts.reshard_after_forward else "-noreshard")
            + (f"-{cfg.model.precision}reduce" if self.reduce_bytes(cfg) == 2 else "")
        )

    def reduce_bytes(self, cfg) -> int:
        """Element bytes of the gradients' reduce-scatter: fp32 unless a low-precision run turned
        --fp32-reduce off."""
        low = cfg.model.precision in LOW_PRECISIONS
        return ELEMENT_BYTES[cfg.model.precision] if low and not self.options(cfg).fp32_reduce else 4

    def numerics(self, cfg):
        """MixedPrecisionPolicy(param_dtype) casts each unit's parameters as it gathers them, with autocast
        off: every forward op, LayerNorm and the residual stream included, runs in the low precision."""
        if cfg.model.precision not in LOW_PRECISIONS:
            return autocast_numerics(cfg)
        precision = cfg.model.precision
        reduce = "fp32" if self.reduce_bytes(cfg) == 4 else precision
        return autocast_numerics(
            cfg,
            f"FSDP2 MixedPrecisionPolicy(param_dtype={precision}, reduce_dtype={reduce}), no autocast",
            forward_params=cfg.model.precision,
            activations=cfg.model.precision,
            grad_reduce=reduce,
            why={"grad_reduce": "--fp32-reduce off"},
        )

    def sharding(self, cfg):
        return "parameters"

    def schedule(self, cfg):
        """Parameters gathered in the compute dtype (param_dtype), gradients reduce-scattered in
        reduce_dtype: schedule.py."""
        opts = self.options(cfg)
        return fsdp_schedule(
            cfg, ELEMENT_BYTES[cfg.model.precision], self.reduce_bytes(cfg), opts.reshard_after_forward
        )

    def timeouts(self, cfg):
        """torchrun's rendezvous and the process group: backends.base.torchrun_timeouts."""
        return torchrun_timeouts(cfg)

    def launch(self, cfg, run_dir, port, devices):
        return torchrun(self, cfg, run_dir, port, devices)
