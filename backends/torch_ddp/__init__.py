"""torch-ddp adapter: DistributedDataParallel launched by torchrun, one process per device."""

from backends.base import Backend, CommPattern, torchrun


class TorchDDP(Backend):
    name = "torch-ddp"
    framework = "torch"
    launcher = "torchrun"
    compute_methods = ("no_sync", "isolated")

    def comm_pattern(self, cfg):
        return CommPattern("allreduce", 4)  # DDP buckets the fp32 .grad tensors, also under autocast

    def launch(self, cfg, run_dir, port, devices):
        return torchrun(self, cfg, run_dir, port, devices)
