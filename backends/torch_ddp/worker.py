"""torch-ddp worker: DDP over the spec's GPT; gradient accumulation skips the all-reduce with no_sync."""

from contextlib import nullcontext

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from backends.torch_common import TorchTrainer
from backends.torch_ddp.options import DDPOptions


class DDPTrainer(TorchTrainer):
    can_skip_grad_sync = True  # no_sync() switches the gradient all-reduce off without changing the compute
    sync_off_switch = "DistributedDataParallel.no_sync()"
    model: DDP

    def __init__(self, cfg):
        super().__init__(cfg)
        self.init_process_group()
        opts = DDPOptions.from_dict(cfg.backend_options)
        model = self.build_model()
        self.compile_blocks(model)  # before the wrapper: DDP's hooks fire between blocks (TorchDDP.tuned)
        self.model = DDP(
            model,
            device_ids=[self.local_rank] if self.device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
        )
        self.optimizer = self.make_optimizer(model)

    def step(self, batches, sync_grads=True):
        self.optimizer.zero_grad(set_to_none=True)
        loss: float | Tensor = 0.0
        for i, (x, y) in enumerate(batches):
            sync_now = sync_grads and i == len(batches) - 1
            with nullcontext() if sync_now else self.model.no_sync():
                loss += self.backward(self.model, x, y, len(batches))
        self.optimizer_step()
        return float(loss)


def make_trainer(cfg):
    return DDPTrainer(cfg)
