"""torch-ddp worker: DDP over the spec's GPT; gradient accumulation skips the all-reduce with no_sync."""

from contextlib import nullcontext

from torch import Tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from backends.torch_common import TorchTrainer
from workloads.torch_model import make_optimizer


class DDPTrainer(TorchTrainer):
    can_skip_grad_sync = True  # no_sync() switches the gradient all-reduce off without changing the compute
    model: DDP

    def __init__(self, cfg):
        super().__init__(cfg)
        self.init_process_group()
        model = self.build_model()
        self.model = DDP(model, device_ids=[self.local_rank] if self.device.type == "cuda" else None)
        self.optimizer = make_optimizer(model)

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
