"""torch-fsdp worker: FSDP2 `fully_shard` on each transformer block, then on the root module.

The root's own parameters are tok_emb, pos_emb and ln_f. The LM head has no parameter of its own: it is
tok_emb.weight (tied), so the root's unit gathers it once and both the embedding lookup and the head use
that one gathered tensor, and their gradients add up in its single sharded gradient.
"""

from contextlib import nullcontext

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from backends.torch_common import TorchTrainer
from backends.torch_fsdp import FSDPOptions
from workloads.torch_model import make_optimizer


class FSDPTrainer(TorchTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.init_process_group()
        opts = FSDPOptions.from_dict(cfg.backend_options)
        model = self.build_model()
        policy = MixedPrecisionPolicy(
            param_dtype=self.amp_dtype, reduce_dtype=torch.float32 if opts.fp32_reduce else self.amp_dtype
        )
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=opts.reshard_after_forward, mp_policy=policy)
        fully_shard(model, mp_policy=policy)  # the root keeps its parameters gathered until backward anyway
        self.model = model
        self.optimizer = make_optimizer(model)  # over the sharded (DTensor) parameters
        if self.scaler:  # every rank must agree to skip a step on inf/NaN, but each sees only its shard
            self.scaler = ShardedGradScaler(self.device.type)

    def autocast(self):
        return nullcontext()  # MixedPrecisionPolicy casts parameters and inputs; autocast would cast again

    def step(self, batches, sync_grads=True):
        """Gradient accumulation as FSDP users do it: gradient sync off (set_requires_gradient_sync) for all
        but the last micro-batch, so gradients are reduce-scattered once per step, not once per micro-batch
        (the unsharded gradients accumulate locally meanwhile)."""
        self.optimizer.zero_grad()
        loss = 0.0
        for i, (x, y) in enumerate(batches):
            self.model.set_requires_gradient_sync(i == len(batches) - 1)
            loss += self.backward(self.model, x, y, len(batches))
        self.optimizer_step()
        return float(loss)


def make_trainer(cfg):
    return FSDPTrainer(cfg)
