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
    burst_mode = "async, fused"  # a cycle's tensors are negotiated once and fused (not broadcast, alltoall)

    def __init__(self, cfg):
        super().__init__(cfg)
        torch.set_num_threads(cfg.threads_per_worker)
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

    def call_burst(self, op, buffer_sets):
        """Every call submitted to the background thread (hvd.*_async), then each handle synchronised: the
        calls of one cycle are negotiated, and may be fused, together, as DistributedOptimizer's are."""
        submit = {
            "all_reduce": lambda t: hvd.allreduce_async(t, op=hvd.Sum),
            "broadcast": lambda t: hvd.broadcast_async(t, root_rank=0),
            "all_gather": hvd.allgather_async,
            "reduce_scatter": lambda t: hvd.reducescatter_async(t, op=hvd.Sum),
            "all_to_all": hvd.alltoall_async,
        }[op]
        self.burst_outputs = [hvd.synchronize(handle) for handle in [submit(b) for b in buffer_sets]]

    def burst_results(self, op, buffer_sets):
        return [self.unwrap(output).double().cpu().numpy() for output in self.burst_outputs]

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
