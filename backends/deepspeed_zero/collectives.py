"""deepspeed.comm's collectives for `harness commbench`: DeepSpeed's own communication layer, which ZeRO
calls, started by the deepspeed launcher; same signatures as torch.distributed's."""

from datetime import timedelta

import deepspeed
import deepspeed.comm as ds_comm

from backends.torch_ddp.collectives import TorchCollectives


class DeepSpeedCollectives(TorchCollectives):
    def __init__(self, cfg):
        super().__init__(cfg, comm=ds_comm)

    def init_process_group(self, timeout: timedelta) -> None:
        deepspeed.init_distributed(
            dist_backend="nccl" if self.device.type == "cuda" else "gloo", timeout=timeout
        )

    def versions(self):
        return {**super().versions(), "deepspeed": deepspeed.__version__}

    def close(self):
        ds_comm.destroy_process_group()


def make_collectives(cfg):
    return DeepSpeedCollectives(cfg)
