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

    def __init__(self, cfg, comm=dist):
        super().__init__(cfg)
        torch.set_num_threads(cfg.topology.threads_per_worker)
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

    def call(self, op, buffers):
        send, receive = buffers
        if op == "all_reduce":
            self.comm.all_reduce(send)
        elif op == "broadcast":
            self.comm.broadcast(send, 0)
        elif op == "all_gather":
            self.comm.all_gather_into_tensor(receive, send)
        elif op == "reduce_scatter":
            self.comm.reduce_scatter_tensor(receive, send)
        elif op == "all_to_all":
            self.comm.all_to_all_single(receive, send)
        else:
            raise ValueError(f"unknown collective {op}")

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
