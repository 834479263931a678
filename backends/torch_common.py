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

from backends import get_backend
from backends.base import TORCH_PROCESS_GROUP
from backends.loop import Trainer
from backends.process_stats import cpu_name
from backends.torch_trace import torch_collectives
from backends.torch_tuning import TorchTuning
from core.config import RunConfig
from core.precision import checked, dtype_name, master_weights, tf32_switches
from workloads.torch_model import GPT, Block, make_optimizer

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def tensor_bytes(t) -> int:
    """Bytes this rank holds for a tensor; a DTensor (FSDP2) counts only its local shard."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def torch_switch(name: str) -> tuple[object, str]:
    """The object and attribute of a switch named as core.precision names it
    ("torch.backends.cuda.matmul.fp32_precision"): a name torch does not have fails here, loudly."""
    *path, attr = name.split(".")
    obj = torch
    for part in path[1:]:
        obj = getattr(obj, part)
    return obj, attr


def apply_tf32_rule(cfg: RunConfig) -> dict[str, str]:
    """Set torch's TF32 switches as core.precision decides for this run (on a CPU too, where they change
    nothing), and return them as torch reads them back."""
    for name, value in tf32_switches("torch", cfg).items():
        setattr(*torch_switch(name), value)
    return {name: getattr(*torch_switch(name)) for name in tf32_switches("torch", cfg)}


def joined(dtypes) -> str | None:
    """A set of dtypes as one fact ("fp32", or "bf16/fp32" when a stack mixes them); None if empty."""
    names = sorted({dtype_name(d) for d in dtypes})
    return "/".join(names) or None


def rank_device(cfg: RunConfig, local_rank: int) -> tuple[torch.device, str]:
    """This rank's device and its name: cuda:<local rank> inside the launcher's mask (the device contract),
    made current; or the CPU."""
    if cfg.topology.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        return device, torch.cuda.get_device_name(device)
    return torch.device("cpu"), cpu_name()


class Seen:
    """What watch_numerics' hooks saw, as attributes (named as core.precision's observed numerics)."""

    forward_params: str
    compute: str
    activations: str


class TorchTrainer(Trainer):
    """Device, threads, process group, model construction, autocast/GradScaler, and the probes."""

    framework = "torch"

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        torch.set_num_threads(cfg.topology.threads_per_worker)
        torch.manual_seed(cfg.model.seed)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device, self.device_name = rank_device(cfg, self.local_rank)
        self.amp_dtype = AMP_DTYPES.get(cfg.model.precision)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.model.precision == "fp16" else None
        # Set by each stack's __init__: the model as the stack wraps it, and the optimizer it steps.
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.tf32_settings = apply_tf32_rule(cfg)
        self.seen = Seen()  # dtypes the first forward showed (watch_numerics)

    def init_process_group(self) -> None:
        """NCCL on GPU, gloo on CPU; with the run's collective timeout (the adapter's timeouts()), so a dead
        or hung peer ends the run, and a busy node's slow peer is waited for as long as the run allows."""
        if not dist.is_initialized():
            timeout = get_backend(self.cfg.backend).timeouts(self.cfg)[TORCH_PROCESS_GROUP]
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout)
            )

    def build_model(self) -> GPT:
        model = GPT(self.cfg.model.spec, self.cfg.model.activation_checkpointing).load_spec_weights(
            self.cfg.model.seed
        )
        self.watch_numerics(model)
        return model.to(self.device)

    def tuning(self) -> TorchTuning:
        """This run's torch.compile and AdamW settings (backends.torch_tuning), for stacks that take them."""
        return TorchTuning.from_dict(self.cfg.backend_options)

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.AdamW:
        """The run's AdamW over `model`'s parameters, in the implementation its options name."""
        return make_optimizer(model, implementation=self.tuning().adamw)

    def compile_blocks(self, model: GPT) -> None:
        """torch.compile each transformer block, as torchtitan's apply_compile does before fully_shard: the
        compiled wrapper takes the block's place, so the wrapper FSDP then hooks runs the compiled block
        (its parameters' names gain `_orig_mod.`, which final_weights drops); a no-op unless --compile."""
        if self.tuning().compile:
            for i, block in enumerate(model.blocks):
                compiled = torch.compile(block)  # a Module given, a Module back (OptimizedModule)
                assert isinstance(compiled, torch.nn.Module)
                model.blocks[i] = compiled

    def watch_numerics(self, model: GPT) -> None:
        """Hooks that note, in the first forward only (each removes itself), the dtypes forward really uses:
        the first block's first MLP weight as the matmul holds it and that matmul's output, and the
        block's output (the residual stream). Registered before any wrapper, which keeps them: FSDP2
        swaps in the gathered parameter before the module runs, DeepSpeed casts the module in place.

        Under torch.compile, TorchDynamo traces a hook into the graph. Removing a handle made outside the
        traced frame is a graph break, which inside GPT.forward's loop over the blocks makes dynamo skip
        GPT.forward (the embeddings and the head run eagerly, each block compiled alone), and a dict
        updated in a hook is guarded on, so the next call would compile everything again. A compiled hook
        therefore stays registered and only sets attributes (Seen), which dynamo replays after each call
        without a guard."""
        block = model.blocks[0]
        assert isinstance(block, Block)  # a ModuleList's items are typed as any Module
        fc = block.mlp.fc

        def on_fc(module, args, output):
            self.seen.forward_params = dtype_name(module.weight.dtype)
            self.seen.compute = dtype_name(output.dtype)
            if not torch.compiler.is_compiling():
                handles[0].remove()

        def on_block(module, args, output):
            self.seen.activations = dtype_name(output.dtype)
            if not torch.compiler.is_compiling():
                handles[1].remove()

        handles = [fc.register_forward_hook(on_fc), block.register_forward_hook(on_block)]

    def reduced_gradient_dtype(self) -> str | None:
        """The dtype gradients are reduced in: DDP's buckets and Horovod's all-reduces take the .grad
        tensors as they are. None where nothing is reduced (one rank)."""
        if self.world_size == 1:
            return None
        return joined(p.grad.dtype for p in self.unwrapped().parameters() if p.grad is not None)

    def updated_weights_dtype(self) -> str | None:
        """The dtype of the tensors the optimizer updates."""
        return joined(p.dtype for group in self.optimizer.param_groups for p in group["params"])

    def optimizer_state_dtype(self) -> str | None:
        return joined(
            v.dtype for s in self.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")
        )

    def loss_scaling(self) -> str | None:
        return "dynamic" if self.scaler else "none"

    def observed_numerics(self) -> dict:
        """What this worker saw of its numerics, for core.precision.checked (None: not observable)."""
        updated = self.updated_weights_dtype()
        return {
            **vars(self.seen),
            "grad_reduce": self.reduced_gradient_dtype(),
            "master_weights": updated and master_weights(self.cfg.model.precision, updated),
            "optimizer_state": self.optimizer_state_dtype(),
            "loss_scaling": self.loss_scaling(),
            "tf32": self.cublas_tf32(self.tf32_settings["torch.backends.cuda.matmul.fp32_precision"]),
        }

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()

    def inputs(self, x, y) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch's numpy token arrays as tensors on this rank's device."""
        return (
            torch.from_numpy(x).to(self.device, non_blocking=True),
            torch.from_numpy(y).to(self.device, non_blocking=True),
        )

    anatomy_methods = {
        "forward": "model(x, y): forward and loss, per micro-batch",
        "backward": "loss.backward(), per micro-batch",
        "optimizer": "optimizer.step() (GradScaler's step and update under fp16)",
    }

    def backward(self, model, x, y, n_micro: int) -> torch.Tensor:
        """Forward and backward of one micro-batch, each a part of the step (Trainer.timed_part); the loss
        is scaled by 1/n_micro for accumulation."""
        x, y = self.inputs(x, y)

        def forward() -> torch.Tensor:
            with self.autocast():
                return model(x, y) / n_micro

        loss = self.timed_part("forward", forward)
        self.timed_part("backward", (self.scaler.scale(loss) if self.scaler else loss).backward)
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
        NCCL kernel (backends.torch_trace). Entered through torch.autograd.profiler.profile, the profiler
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
        """Whether cuBLAS runs this worker's fp32 matmuls in TF32, under the rule this worker applied
        (apply_tf32_rule: IEEE unless an fp32 run asked for --tf32), read back from torch's switches
        (the legacy matmul / cudnn allow_tf32 flags and the cuda.matmul / cudnn.conv / cudnn.rnn
        fp32_precision ones, set alike: core.precision.TF32_SWITCHES). TF32 needs
        compute capability 8.0+, and NVIDIA_TF32_OVERRIDE=0 turns it off in cuBLAS itself; on a CPU it does
        not apply (None). With the numerics the adapter states, checked against what this worker saw."""
        settings = {name: getattr(*torch_switch(name)) for name in self.tf32_settings}
        matmul = settings["torch.backends.cuda.matmul.fp32_precision"]
        mode: dict[str, object] = {
            "tf32": None,
            "tf32_setting": ", ".join(f"{k}={v}" for k, v in settings.items()),
        }
        if self.device.type == "cuda":
            capable = torch.cuda.get_device_capability(self.device) >= (8, 0)
            capable = capable and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0"
            mode["tf32"] = self.cublas_tf32(matmul) and capable
        stated = get_backend(self.cfg.backend).numerics(self.cfg).record(self.cfg)
        mode["numerics"] = checked(stated, self.observed_numerics(), f"{self.cfg.backend} rank {self.rank}")
        return mode

    def cublas_tf32(self, matmul_precision: str) -> bool:
        """Whether cuBLAS may run fp32 matmuls as TF32: the switch, or on a GPU torch's environment override
        TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, which turns TF32 on whatever the switch reads (ATen's
        Context::allowTF32CuBLAS), so an IEEE run under it is refused by the numerics check."""
        override = self.device.type == "cuda" and os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
        return matmul_precision == "tf32" or override

    def hold_transient(self, nbytes: int) -> str:
        """On a GPU in the caching allocator, whose peak the record reports (backends.loop.Trainer)."""
        if self.device.type != "cuda":
            return super().hold_transient(nbytes)
        held = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        del held
        return "device"

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
        torch_params = {
            name.replace("._orig_mod", ""): p for name, p in self.unwrapped().named_parameters()
        }  # a block torch.compile wrapped (compile_blocks) holds its module as _orig_mod
        out = {}
        for name in self.cfg.model.spec.parameter_shapes():
            p = torch_params[name + ".weight" if name.endswith("emb") else name].detach()
            p = p.full_tensor() if hasattr(p, "full_tensor") else p
            a = p.float().cpu().numpy()
            out[name] = a.T if (a.ndim == 2 and not name.endswith("emb")) else a
        return out

    def versions(self) -> dict:
        out: dict[str, str | None] = {"torch": torch.__version__}
        if self.device.type == "cuda":
            out["cuda"] = torch.version.cuda
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
