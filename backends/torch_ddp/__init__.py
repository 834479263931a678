"""torch-ddp adapter: DistributedDataParallel launched by torchrun, one process per device."""

from backends.base import TORCH_DISTRIBUTED_PEER_LOST, Backend, Options, torchrun
from backends.torch_ddp.schedule import ddp_schedule


class TorchDDP(Backend[Options]):
    name = "torch-ddp"
    framework = "torch"
    launcher = "torchrun"
    extra = "torch"
    collective_api = "torch.distributed"
    compute_methods = ("no_sync", "isolated")
    kubeflow_job = "PyTorchJob"
    trace_reader = "backends.torch_trace"
    peer_lost_texts = TORCH_DISTRIBUTED_PEER_LOST
    Options = Options  # no options of its own

    def schedule(self, cfg):
        """DDP's fp32 gradient buckets, all-reduced during backward: schedule.py."""
        return ddp_schedule(cfg)

    def launch(self, cfg, run_dir, port, devices):
        return torchrun(self, cfg, run_dir, port, devices)
