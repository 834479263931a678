"""horovod worker: the spec's GPT with horovod.torch's DistributedOptimizer around the same AdamW.

Gradient accumulation: backward_passes_per_step = grad_accum, so the all-reduce is submitted on the last
micro-batch's backward only. Weights and optimizer state are broadcast from rank 0 before training.
"""

import os
import tempfile
from pathlib import Path
from typing import Any

import horovod
import horovod.torch as hvd
import torch

from backends.horovod_torch import local_rank
from backends.horovod_torch.options import HorovodOptions
from backends.horovod_torch.trace import horovod_collectives, timeline_events
from backends.torch_common import TorchTrainer, joined


def init_adamw_state(optimizer) -> None:
    """Create the state torch's AdamW creates on its first step (step 0, zero moments).

    hvd.broadcast_optimizer_state fills an empty state by taking one optimizer step with zero gradients,
    which for AdamW applies weight decay and advances the step count, so training would start from a
    different model than every other backend's. With the state in place the broadcast only copies it.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


class HorovodTrainer(TorchTrainer):
    # hvd.DistributedOptimizer's result, AdamW's class mixed with Horovod's own (synchronize,
    # skip_synchronize); Horovod ships no type information.
    optimizer: Any

    def __init__(self, cfg):
        os.environ["LOCAL_RANK"] = local_rank(os.environ)  # picks the GPU (TorchTrainer reads it)
        super().__init__(cfg)
        hvd.init()
        model = self.build_model()
        self.compile_blocks(model)  # before Horovod's gradient hooks, which then fire between blocks
        compression = (
            hvd.Compression.fp16
            if HorovodOptions.from_dict(cfg.backend_options).compression == "fp16"
            else hvd.Compression.none
        )
        self.optimizer = hvd.DistributedOptimizer(
            self.make_optimizer(model),
            named_parameters=model.named_parameters(),
            compression=compression,
            backward_passes_per_step=cfg.batch.grad_accum,
        )
        init_adamw_state(self.optimizer)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)
        self.model = model

    def reduced_gradient_dtype(self):
        """Horovod all-reduces each .grad as its compressor hands it over (Compression.fp16: cast to fp16):
        the dtype of the first gradient passed through this optimizer's own compressor."""
        if self.world_size == 1:
            return None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None][:1]
        return joined(self.optimizer._compression.compress(g)[0].dtype for g in grads)

    def optimizer_step(self):
        """Wait for the gradient all-reduces before the step reads (or GradScaler unscales) the gradients,
        as Horovod's mixed-precision recipe does."""
        self.optimizer.synchronize()
        with self.optimizer.skip_synchronize():
            super().optimizer_step()

    def trace_collectives(self, run_steps):
        """Horovod's own timeline over the traced steps (hvd.start_timeline / stop_timeline): every
        allreduce DistributedOptimizer submits, fused calls as one, timed by their Gloo/NCCL transfer."""
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "timeline.json"
            hvd.start_timeline(str(path), mark_cycles=False)
            step_times = run_steps()
            hvd.stop_timeline()
            text = path.read_text() if path.exists() else None
        trace = {"method": "horovod timeline", "steps": len(step_times), "step_times": step_times}
        if text is None:  # Horovod's coordinator (rank 0) writes the timeline; the others write nothing
            return {**trace, "collectives": None, "reason": "Horovod writes its timeline on rank 0 only"}
        return {
            **trace,
            "collectives": horovod_collectives(timeline_events(text), self.cfg.process_group_size),
        }

    def versions(self):
        return {**super().versions(), "horovod": horovod.__version__}

    def close(self):
        hvd.shutdown()


def make_trainer(cfg):
    return HorovodTrainer(cfg)
