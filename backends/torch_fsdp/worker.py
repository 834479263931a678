"""torch-fsdp worker: FSDP2 `fully_shard` on each transformer block, then on the root module.

The root's own parameters are tok_emb, pos_emb and ln_f. The LM head has no parameter of its own: it is
tok_emb.weight (tied), so the root's unit gathers it once and both the embedding lookup and the head use
that one gathered tensor, and their gradients add up in its single sharded gradient.
"""

from contextlib import nullcontext

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from backends.torch_common import TorchTrainer, joined
from backends.torch_fsdp import FSDPOptions


class FSDPTrainer(TorchTrainer):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.init_process_group()
        opts = FSDPOptions.from_dict(cfg.backend_options)
        model = self.build_model()
        reduce_dtype = torch.float32 if self.amp_dtype and opts.fp32_reduce else self.amp_dtype
        policy = MixedPrecisionPolicy(param_dtype=self.amp_dtype, reduce_dtype=reduce_dtype)
        self.compile_blocks(model)  # after activation checkpointing, before fully_shard: torchtitan's order
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=opts.reshard_after_forward, mp_policy=policy)
        # The root keeps its parameters gathered until backward anyway. fully_shard returns the module itself,
        # now also an FSDPModule: `root` is the model typed as one (its sync switch, its state).
        self.root = fully_shard(model, mp_policy=policy)
        self.model = model
        self.optimizer = self.make_optimizer(model)  # over the sharded (DTensor) parameters
        if self.scaler:  # every rank must agree to skip a step on inf/NaN, but each sees only its shard
            self.scaler = ShardedGradScaler(self.device.type)

    def reduced_gradient_dtype(self):
        """The dtype FSDP2 reduce-scatters in, as it resolved the policy: its foreach_reduce casts the
        gradients to the unit's reduce_dtype, or leaves them in the parameters' compute dtype where that is
        None (FSDP sets it None when it equals param_dtype). Read from FSDP2's internal state (torch
        2.13's FSDPParam); None, i.e. not observed, where a torch release names it otherwise."""
        if self.world_size == 1:
            return None
        try:
            group = self.root._get_fsdp_state()._fsdp_param_group
            if group is None:  # a root without parameters of its own reduces nothing
                return None
            return joined(p.reduce_dtype or p.param_dtype or p.orig_dtype for p in group.fsdp_params)
        except AttributeError:
            return None

    def autocast(self):
        return nullcontext()  # MixedPrecisionPolicy casts parameters and inputs; autocast would cast again

    def step(self, batches, sync_grads=True):
        """Gradient accumulation as FSDP users do it: gradient sync off (set_requires_gradient_sync) for all
        but the last micro-batch, so gradients are reduce-scattered once per step, not once per micro-batch
        (the unsharded gradients accumulate locally meanwhile)."""
        self.optimizer.zero_grad()
        loss: float | torch.Tensor = 0.0
        for i, (x, y) in enumerate(batches):
            self.root.set_requires_gradient_sync(i == len(batches) - 1)
            loss += self.backward(self.model, x, y, len(batches))
        self.optimizer_step()
        return float(loss)


def make_trainer(cfg):
    return FSDPTrainer(cfg)
