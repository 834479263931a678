"""torch-ddp adapter: DistributedDataParallel launched by torchrun, one process per device."""

from backends.base import TORCH_DISTRIBUTED_PEER_LOST, Backend, Tuned, torchrun
from backends.torch_ddp.options import DDP_DOCSTRING, DDPOptions
from backends.torch_ddp.schedule import ddp_schedule
from backends.torch_tuning import NANOGPT, torch_tuned


class TorchDDP(Backend[DDPOptions]):
    name = "torch-ddp"
    framework = "torch"
    launcher = "torchrun"
    extra = "torch"
    collective_api = "torch.distributed"
    compute_methods = ("no_sync", "isolated")
    kubeflow_job = "PyTorchJob"
    trace_reader = "backends.torch_trace"
    peer_lost_texts = TORCH_DISTRIBUTED_PEER_LOST
    Options = DDPOptions

    def tuned(self, cfg):
        """nanoGPT's compile-then-wrap and fused AdamW; torchtitan's 100 MiB buckets (its `replicate(...,
        bucket_cap_mb=100)`); gradients as bucket views, which DDP's docstring recommends to save memory and
        copies (no change to the maths)."""
        return {
            **torch_tuned(f"{NANOGPT}: model = torch.compile(model) before DDP(model)"),
            "bucket_cap_mb": Tuned(
                100, "pytorch/torchtitan torchtitan/distributed (apply_ddp: bucket_cap_mb=100)"
            ),
            "gradient_as_bucket_view": Tuned(True, f"{DDP_DOCSTRING} (gradient_as_bucket_view)"),
        }

    def schedule(self, cfg):
        """DDP's fp32 gradient buckets, all-reduced during backward: schedule.py."""
        return ddp_schedule(cfg)

    def launch(self, cfg, run_dir, port, devices):
        return torchrun(self, cfg, run_dir, port, devices)
