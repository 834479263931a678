"""torch-ddp adapter: DistributedDataParallel launched by torchrun, one process per device."""

from backends.base import Backend, Options, gradient_allreduce, torchrun


class TorchDDP(Backend[Options]):
    name = "torch-ddp"
    framework = "torch"
    launcher = "torchrun"
    collective_api = "torch.distributed"
    compute_methods = ("no_sync", "isolated")
    Options = Options  # no options of its own

    def comm_pattern(self, cfg):
        """DDP all-reduces the fp32 .grad buckets (also under autocast), once per step: no_sync on the
        micro-batches before the last."""
        return gradient_allreduce(cfg, 4)

    def launch(self, cfg, run_dir, port, devices):
        return torchrun(self, cfg, run_dir, port, devices)
