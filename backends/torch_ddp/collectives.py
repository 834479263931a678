"""torch.distributed's collectives for `harness commbench` (NCCL on GPU, gloo on CPU), as DDP and FSDP2 call
them: all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast, all_to_all_single.

`comm` is the module whose functions are called: torch.distributed here, deepspeed.comm (the same
signatures) for DeepSpeed.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from backends.commbench import Collectives, message_elements
from backends.torch_common import rank_device

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TorchCollectives(Collectives):
    framework = "torch"
    burst_mode = "async"

    def __init__(self, cfg, comm=dist):
        super().__init__(cfg)
        torch.set_num_threads(cfg.threads_per_worker)
        self.comm = comm
        self.device, self.device_name = rank_device(cfg, int(os.environ.get("LOCAL_RANK", 0)))
        self.dtype = DTYPES[self.spec.dtype]
        self.init_process_group(timedelta(seconds=cfg.collective_timeout))

    def init_process_group(self, timeout: timedelta) -> None:
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout)

    def prepare(self, op, elements, value):
        sent, received = message_elements(op, elements, self.world_size)
        send = torch.full((sent,), value, dtype=self.dtype, device=self.device)
        if op in ("all_reduce", "broadcast"):  # in place
            return (send, send)
        return (send, torch.empty(received, dtype=self.dtype, device=self.device))

    def call(self, op, buffers, async_op=False):
        send, receive = buffers
        if op == "all_reduce":
            return self.comm.all_reduce(send, async_op=async_op)
        if op == "broadcast":
            return self.comm.broadcast(send, 0, async_op=async_op)
        if op == "all_gather":
            return self.comm.all_gather_into_tensor(receive, send, async_op=async_op)
        if op == "reduce_scatter":
            return self.comm.reduce_scatter_tensor(receive, send, async_op=async_op)
        if op == "all_to_all":
            return self.comm.all_to_all_single(receive, send, async_op=async_op)
        raise ValueError(f"unknown collective {op}")

    def call_burst(self, op, buffer_sets):
        """Every call queued with async_op=True, then each handle waited for, as ZeRO-3's coalesced
        gathers and nccl-tests' iterations run."""
        for work in [self.call(op, buffers, async_op=True) for buffers in buffer_sets]:
            work.wait()

    def result(self, op, buffers):
        return buffers[1].double().cpu().numpy()

    def barrier(self):
        self.comm.barrier()

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def versions(self):
        out: dict[str, str | None] = {"torch": torch.__version__}
        if self.device.type == "cuda":
            out.update({"cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
        return out

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def make_collectives(cfg):
    return TorchCollectives(cfg)
