"""Worker-side code shared by the PyTorch-family backends (DDP, FSDP, DeepSpeed, Horovod)."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from backends.comm_trace import torch_collectives
from backends.loop import Trainer, cpu_name
from core.config import RunConfig
from workloads.torch_model import GPT

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tensor_bytes(t) -> int:
    """Bytes this rank holds for a tensor; a DTensor (FSDP2) counts only its local shard."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def rank_device(cfg: RunConfig, local_rank: int) -> tuple[torch.device, str]:
    """This rank's device and its name: cuda:<local rank> inside the launcher's mask (the device contract),
    made current; or the CPU."""
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        return device, torch.cuda.get_device_name(device)
    return torch.device("cpu"), cpu_name()


class TorchTrainer(Trainer):
    """Device, threads, process group, model construction, autocast/GradScaler, and the probes."""

    framework = "torch"

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        torch.set_num_threads(cfg.threads_per_worker)
        torch.manual_seed(cfg.seed)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device, self.device_name = rank_device(cfg, self.local_rank)
        self.amp_dtype = AMP_DTYPES.get(cfg.precision)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16" else None
        self.model = self.optimizer = None

    def init_process_group(self) -> None:
        """NCCL on GPU, gloo on CPU; with the run's collective timeout, so a dead or hung peer ends the
        run."""
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                timeout=timedelta(seconds=self.cfg.collective_timeout),
            )

    def build_model(self) -> GPT:
        model = GPT(self.cfg.spec, self.cfg.activation_checkpointing).load_spec_weights(self.cfg.seed)
        return model.to(self.device)

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()

    def inputs(self, x, y) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's numpy token arrays as tensors on this rank's device."""
        return (
            torch.from_numpy(x).to(self.device, non_blocking=True),
            torch.from_numpy(y).to(self.device, non_blocking=True),
        )

    def backward(self, model, x, y, n_micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch; the loss is scaled by 1/n_micro for accumulation."""
        x, y = self.inputs(x, y)
        with self.autocast():
            loss = model(x, y) / n_micro
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss.detach()

    def step(self, batches, sync_grads=True):
        """Accumulate gradients over the micro-batches, then one optimizer step: for wrappers that sync in
        their own hooks or in the optimizer. Those with a sync-off switch (DDP's no_sync) override this."""
        self.optimizer.zero_grad()
        loss = sum(self.backward(self.model, x, y, len(batches)) for x, y in batches)
        self.optimizer_step()
        return float(loss)

    def optimizer_step(self) -> None:
        def step():
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()

        self.timed_optimizer_step(step)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def trace_collectives(self, run_steps) -> dict:
        """torch's profiler (kineto) over the traced steps, CPU ops with input shapes and, on GPU, CUDA
        kernels: every collective the stack issues through torch.distributed (DDP's buckets, FSDP2's
        gathers and reduce-scatters, ZeRO's through deepspeed.comm) as c10d ops, timed by their gloo work or
        NCCL kernel (backends.comm_trace). Entered through torch.autograd.profiler.profile, the profiler
        torch.profiler.profile wraps: the wrapper's start imports torch._inductor (about 2 s per run on a
        CPU VM) to read a CUDA-graphs setting that does not concern this trace."""
        from torch.autograd import profiler

        with profiler.profile(
            use_cpu=True,
            use_device="cuda" if self.device.type == "cuda" else None,
            record_shapes=True,
            use_kineto=True,
        ) as prof:
            step_times = run_steps()
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        return {
            "method": "torch profiler (kineto)",
            "steps": len(step_times),
            "step_times": step_times,
            "collectives": torch_collectives(events, self.cfg.process_group_size),
        }

    def math_mode(self) -> dict:
        """Whether cuBLAS runs this worker's fp32 matmuls in TF32, as torch left it (not changed here).

        Read from torch.backends.cuda.matmul.fp32_precision (torch >= 2.9; "tf32" also after
        set_float32_matmul_precision("high"/"medium"), allow_tf32 = True or TORCH_ALLOW_TF32_CUBLAS_OVERRIDE),
        else the legacy allow_tf32, which torch 2.9+ refuses to read once the new API set the flag.
        TF32 needs compute capability 8.0+, and NVIDIA_TF32_OVERRIDE=0 turns it off in cuBLAS itself."""
        if self.device.type != "cuda":
            return {"tf32": None}
        matmul = torch.backends.cuda.matmul
        precision = getattr(matmul, "fp32_precision", None)
        if precision in ("tf32", "ieee", "bf16", "none"):
            setting = f"torch.backends.cuda.matmul.fp32_precision={precision}"
            switch = precision == "tf32"
        else:
            switch = bool(matmul.allow_tf32)
            setting = f"torch.backends.cuda.matmul.allow_tf32={switch}"
        capable = torch.cuda.get_device_capability(self.device) >= (8, 0)
        return {
            "tf32": switch and capable and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0",
            "tf32_setting": setting,
        }

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def memory(self) -> dict:
        """The caching allocator's peaks (allocated by tensors, reserved from the driver) since the reset
        after warm-up; empty on CPU. No NVML 'used' figure: one sample at the end of the run is not the peak,
        and it counts the CUDA context and every other process and allocator on the device."""
        if self.device.type != "cuda":
            return {}
        return {
            "allocated_peak": torch.cuda.max_memory_allocated(self.device),
            "reserved_peak": torch.cuda.max_memory_reserved(self.device),
        }

    def model_state_bytes(self) -> dict:
        params = list(self.model.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {
            "params": sum(tensor_bytes(p) for p in params),
            "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(tensor_bytes(v) for v in state),
        }

    def unwrapped(self):
        """The GPT module under the wrapper (DDP/FSDP/engine keep it as .module or in place)."""
        return getattr(self.model, "module", self.model)

    def final_weights(self) -> dict:
        """Neutral-name numpy weights (Linear weights transposed back to (in, out)); DTensors gathered."""
        torch_params = dict(self.unwrapped().named_parameters())
        out = {}
        for name in self.cfg.spec.parameter_shapes():
            p = torch_params[name + ".weight" if name.endswith("emb") else name].detach()
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            a = p.float().cpu().numpy()
            out[name] = a.T if (a.ndim == 2 and not name.endswith("emb")) else a
        return out

    def versions(self) -> dict:
        out = {"torch": torch.__version__}
        if self.device.type == "cuda":
            out["cuda"] = torch.version.cuda
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
