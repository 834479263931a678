"""torch-ddp adapter: DistributedDataParallel launched by torchrun, one process per device."""

from backends.base import TORCH_DISTRIBUTED_PEER_LOST, Backend, Tuned, torchrun, torchrun_timeouts
from backends.schedule import MiB
from backends.torch_ddp.options import DDP_DOCSTRING, DDPOptions
from backends.torch_ddp.schedule import ddp_schedule
from backends.torch_tuning import TORCHTITAN, torch_tuned

# torchtitan's DDP bucket (torchtitan/distributed: apply_ddp(..., bucket_cap_mb=100)), for the models it
# trains; taken once it still cuts the gradients into this many buckets (see TorchDDP.tuned)
TORCHTITAN_BUCKET_MB = 100
TORCHTITAN_BUCKETS_AT_LEAST = 10


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
        """torchtitan's per-block compile before the wrapper and fused AdamW (torch_tuned); gradients as
        bucket views, which DDP's docstring recommends to save memory and copies (no change to the maths).

        Why per block, not nanoGPT's whole model (nor torch.compile of the DDP module): DDP all-reduces a
        bucket from autograd hooks as its gradients become ready, and a compiled backward is one opaque
        autograd node whose gradients are all ready when it ends (the torch.compile FAQ, "Do you support
        Distributed code?"). DDPOptimizer (torch/_dynamo/backends/distributed.py, on while
        torch._dynamo.config.optimize_ddp; it applies to a graph first traced inside DDP's forward, which a
        model compiled before the wrapper is too) splits the graph where DDP's buckets would end, counting
        each parameter at its last use in forward. The tied LM head's weight is also the token embedding,
        whose gradient DDP sees ready only after the embedding's backward: where that weight fills the
        first split (vocab x d_model x 4 bytes >= 1 MiB) the blocks stay one region, and traced at 2 ranks
        on CPU, with either order, every bucket was issued together after backward. Compiled block by
        block, each block's backward is its own node (DDPOptimizer still splits one larger than a bucket),
        DDP's hooks fire between blocks as in eager, and the first bucket is all-reduced while the blocks
        before it run their backward (tests/test_tuned_overlap.py).

        Buckets: DDP's own (25 MiB, the first closed at 1 MiB), with which nanoGPT trains GPT-2 124M, until
        torchtitan's 100 MiB still cuts the fp32 gradients into TORCHTITAN_BUCKETS_AT_LEAST buckets: the
        last bucket, which holds the embeddings, is all-reduced after backward, so a cap of a tenth of the
        gradients or less keeps most of them overlapped. A fixed 100 MiB put a small model's gradients in
        one bucket, issued after backward."""
        grad_mib = cfg.model.spec.n_params * 4 / MiB  # DDP's buckets hold the fp32 .grad tensors
        buckets = {}
        if grad_mib >= TORCHTITAN_BUCKET_MB * TORCHTITAN_BUCKETS_AT_LEAST:
            buckets["bucket_cap_mb"] = Tuned(
                TORCHTITAN_BUCKET_MB,
                f"pytorch/torchtitan torchtitan/distributed (apply_ddp: bucket_cap_mb=100), for "
                f"{grad_mib:.0f} MiB of fp32 gradients: at least {TORCHTITAN_BUCKETS_AT_LEAST} buckets, so "
                "the last, all-reduced after backward, holds a tenth of them or less",
            )
        return {
            **torch_tuned(
                f"{TORCHTITAN}: each TransformerBlock compiled before DDP(model), so DDP's hooks fire "
                "between blocks and its buckets overlap backward"
                + ("" if buckets else f" (DDP's own buckets kept for {grad_mib:.0f} MiB of gradients)")
            ),
            **buckets,
            "gradient_as_bucket_view": Tuned(True, f"{DDP_DOCSTRING} (gradient_as_bucket_view)"),
        }

    def schedule(self, cfg):
        """DDP's fp32 gradient buckets, all-reduced during backward: schedule.py."""
        return ddp_schedule(cfg)

    def timeouts(self, cfg):
        """torchrun's rendezvous and the process group: backends.base.torchrun_timeouts."""
        return torchrun_timeouts(cfg)

    def launch(self, cfg, run_dir, port, devices):
        return torchrun(self, cfg, run_dir, port, devices)
