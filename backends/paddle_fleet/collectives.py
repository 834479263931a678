"""paddle.distributed's collectives for `harness commbench`, started by paddle.distributed.launch:
all_reduce, all_gather, reduce_scatter, broadcast and alltoall_single (NCCL on GPU). On CPU, Paddle's gloo
process group implements only all_reduce, all_gather and broadcast ("ProcessGroupGLOO does not support
reduce_scatter / all_to_all"), so the adapter offers only those there."""

from __future__ import annotations

from typing import Literal

import paddle
import paddle.distributed as dist

from backends.commbench import Collectives, message_elements
from backends.paddle_fleet.worker import use_rank_device

DTYPES: dict[str, Literal["float32", "bfloat16"]] = {"fp32": "float32", "bf16": "bfloat16"}


class PaddleCollectives(Collectives):
    framework = "paddle"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.device_name = use_rank_device(cfg)
        dist.init_parallel_env()
        self.dtype = DTYPES[self.spec.dtype]

    def prepare(self, op, elements, value):
        sent, received = message_elements(op, elements, self.world_size)
        send = paddle.full([sent], value, dtype=self.dtype)
        if op in ("all_reduce", "broadcast"):  # in place
            return (send, send)
        return (send, paddle.empty([received], dtype=self.dtype))

    def call(self, op, buffers):
        send, receive = buffers
        if op == "all_reduce":
            dist.all_reduce(send)
        elif op == "broadcast":
            dist.broadcast(send, src=0)
        elif op == "all_gather":
            dist.all_gather(receive, send)
        elif op == "reduce_scatter":
            dist.reduce_scatter(receive, send)
        elif op == "all_to_all":
            dist.alltoall_single(send, receive)
        else:
            raise ValueError(f"unknown collective {op}")

    def result(self, op, buffers):
        return buffers[1].astype("float64").numpy().reshape(-1)

    def barrier(self):
        dist.barrier()

    def synchronize(self):
        if self.cfg.topology.device == "cuda":
            paddle.device.synchronize()

    def versions(self):
        return {"paddle": paddle.__version__}

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def make_collectives(cfg):
    return PaddleCollectives(cfg)
