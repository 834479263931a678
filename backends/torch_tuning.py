"""The settings the PyTorch-family stacks share (torch-ddp, torch-fsdp, Horovod): torch.compile and the
AdamW implementation, as options and as their part of each stack's tuned set. Framework-free: the adapters
import it.

Sources (stored copies read for docs/notes/2026-12-02-tuned-settings-research.md):
- nanoGPT's train.py compiles the whole model before wrapping it in DDP; torchtitan's
  models/llama3/infra/parallelize.py (`apply_compile`) compiles each TransformerBlock after activation
  checkpointing and before fully_shard. Both use torch.compile's default mode. Every stack here compiles
  per block: compiled whole, the backward is one autograd node after which every gradient hook fires
  (torch-ddp's DDPOptimizer split does not help with the tied head: backends.torch_ddp.TorchDDP.tuned).
- nanoGPT's `configure_optimizers` and torchtitan's `Optimizer.implementation = "fused"` use fused AdamW;
  since torch 2.4 the fused kernel exists for CPU too (pytorch/pytorch#123074), so the tuned set uses it on
  every device.
- Scaled-dot-product attention needs no setting: the model calls F.scaled_dot_product_attention, whose
  automatic dispatch picks flash / memory-efficient / cuDNN on a GPU and the CPU flash kernel on a CPU, as
  nanoGPT relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.base import Options, Tuned, option, switch

ADAMW_IMPLEMENTATIONS = ("default", "foreach", "fused")
NANOGPT = "karpathy/nanoGPT train.py and model.py configure_optimizers"
TORCHTITAN = "pytorch/torchtitan models/llama3/infra/parallelize.py apply_compile; config Optimizer"


@dataclass(frozen=True)
class TorchTuning(Options):
    """torch.compile and AdamW's implementation, options of every torch-family stack that steps a torch
    optimizer itself (DeepSpeed's engine takes its own: --ds-optimizer)."""

    compile: bool = switch(
        False,
        "--compile",
        help="torch.compile each transformer block before the stack's wrapper or hooks, as torchtitan",
    )
    adamw: str = option(
        "default",
        "--adamw",
        choices=ADAMW_IMPLEMENTATIONS,
        help="AdamW's implementation: torch's default for the device (foreach on GPU, a for-loop on CPU), "
        "foreach, or fused (one kernel for all parameters)",
    )

    def optimizer_kernel(self) -> str:
        """torch's default on a GPU is the foreach implementation (torch.optim.optimizer
        _default_to_fused_or_foreach picks foreach, never fused, for CUDA parameters)."""
        return "fused" if self.adamw == "fused" else "foreach"


def torch_tuned(how_compiled: str) -> dict[str, Tuned]:
    """The torch family's part of a tuned set. Both change the floating-point result in its last bits:
    inductor fuses and reorders the forward and backward, the fused kernel rounds AdamW's update in another
    order."""
    return {
        "compile": Tuned(True, f"{how_compiled}; default mode", numerics=True),
        "adamw": Tuned("fused", f"{NANOGPT}; {TORCHTITAN} (implementation 'fused')", numerics=True),
    }
