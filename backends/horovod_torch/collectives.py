"""horovod.torch's collectives for `harness commbench`, started by horovodrun: allreduce, allgather,
reducescatter, broadcast and alltoall (sums, out of place, as DistributedOptimizer calls them). Each op goes
through Horovod's background thread and its negotiation cycle (HOROVOD_CYCLE_TIME), as in training."""

import horovod
import horovod.torch as hvd
import torch

from backends.commbench import Collectives, message_elements
from backends.torch_common import rank_device
from backends.torch_ddp.collectives import DTYPES


class HorovodCollectives(Collectives):
    framework = "torch"

    def __init__(self, cfg):
        super().__init__(cfg)
        torch.set_num_threads(cfg.topology.threads_per_worker)
        hvd.init()
        self.device, self.device_name = rank_device(cfg, hvd.local_rank())
        self.dtype = DTYPES[self.spec.dtype]
        self.output: torch.Tensor  # the last call's, set by call()

    def prepare(self, op, elements, value):
        sent, _ = message_elements(op, elements, self.world_size)  # Horovod allocates the output
        return torch.full((sent,), value, dtype=self.dtype, device=self.device)

    def call(self, op, buffers):
        if op == "all_reduce":
            self.output = hvd.allreduce(buffers, op=hvd.Sum)
        elif op == "broadcast":
            self.output = hvd.broadcast(buffers, root_rank=0)
        elif op == "all_gather":
            self.output = hvd.allgather(buffers)
        elif op == "reduce_scatter":
            self.output = hvd.reducescatter(buffers, op=hvd.Sum)
        elif op == "all_to_all":
            self.output = self.unwrap(hvd.alltoall(buffers))
        else:
            raise ValueError(f"unknown collective {op}")

    @staticmethod
    def unwrap(output):
        """alltoall returns (output, received splits)."""
        return output[0] if isinstance(output, tuple) else output

    def result(self, op, buffers):
        return self.output.double().cpu().numpy()

    def barrier(self):
        hvd.barrier()

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def versions(self):
        return {"torch": torch.__version__, "horovod": horovod.__version__}

    def close(self):
        hvd.shutdown()


def make_collectives(cfg):
    return HorovodCollectives(cfg)
