"""paddle-fleet worker: Fleet data parallel or sharding over the spec's GPT, with paddle.amp O1/O2.

Gradient accumulation: the micro-batch losses are divided by their number and their gradients add up in
.grad; under DataParallel every micro-step but the last runs in no_sync(), so the all-reduce runs once per
step (the sharded optimizers reduce inside their step anyway).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager, nullcontext
from typing import Literal

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from backends import get_backend
from backends.comm_trace import tcp_counters, wire_bytes
from backends.loop import Trainer
from backends.paddle_fleet import PADDLE_GLOO_GROUP_STORE, PaddleOptions
from backends.paddle_fleet.groups import gloo_groups_with_own_stores
from backends.paddle_fleet.trace import (
    captured_stderr,
    glog_levels,
    paddle_reducer_collectives,
    paddle_reducer_groups,
)
from backends.process_stats import cpu_name
from core.config import RunConfig
from core.precision import checked, dtype_name, master_weights, tf32_switches
from workloads.paddle_model import GPT, make_optimizer

# Typed as the literals Paddle's annotations accept, so the checker holds each call to them.
AMP_DTYPES: dict[str, Literal["bfloat16", "float16"]] = {"bf16": "bfloat16", "fp16": "float16"}
GROUP_SHARDED_LEVELS: dict[int, Literal["os_g", "p_g_os"]] = {2: "os_g", 3: "p_g_os"}
# Paddle's own verbose log (glog VLOG) of the C++ files that say when DataParallel's fused all-reduces run
REDUCER_LOG = {"reducer": 3, "accumulation_node": 3}


def tensor_bytes(t) -> int:
    return math.prod(t.shape) * t.element_size()


@contextmanager
def reducer_log():
    """Turns on Paddle's VLOG 3 of its reducer and gradient-hook files and captures what they write to
    stderr; back to their levels from the environment on exit (glog_levels: Paddle's own vlog_guard
    resets them to 0, which would hold them below a user's GLOG_v)."""
    with captured_stderr() as captured:
        paddle.base.core.set_vlog_level(REDUCER_LOG)
        try:
            yield captured
        finally:
            paddle.base.core.set_vlog_level(glog_levels(REDUCER_LOG, os.environ))


def clear_gradients(optimizer, stage: int) -> None:
    """Release the step's gradients before the next one accumulates. group_sharded_parallel (stages 2
    and 3) replaces the optimizer's clear_grad with its own `_opt_clear(self)`, which takes no argument
    and clears the sharded gradient buffers itself (GroupShardedStage2/3._redefine_opt_clear); Paddle's
    own optimizers take set_to_zero, and False frees the gradients instead of zero-filling them."""
    if stage >= 2:
        optimizer.clear_grad()
    else:
        optimizer.clear_grad(set_to_zero=False)


def paddle_switch(name: str):
    """The function a switch is named by in core.precision ("paddle.base.core.set_cublas_switch")."""
    obj = paddle
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def apply_tf32_rule(cfg: RunConfig) -> dict[str, bool]:
    """Set Paddle's cuBLAS and cuDNN TF32 switches as core.precision decides for this run (on a CPU too,
    where they change nothing; both are on by default in CUDA builds), and return them as Paddle reads
    them back (get_cublas_switch / get_cudnn_switch)."""
    switches = tf32_switches("paddle", cfg)
    for name, value in switches.items():
        paddle_switch(name)(value)
    return {name: bool(paddle_switch(name.replace(".set_", ".get_"))()) for name in switches}


def joined(dtypes) -> str | None:
    names = sorted({dtype_name(d) for d in dtypes})
    return "/".join(names) or None


def use_rank_device(cfg: RunConfig) -> str:
    """Make this rank's device Paddle's current one and return its name: the GPU the launcher selected
    for it (FLAGS_selected_gpus, the device contract), or the CPU."""
    if cfg.topology.device == "cuda":
        paddle.set_device(f"gpu:{os.environ.get('FLAGS_selected_gpus', '0')}")
        return paddle.device.cuda.get_device_name()
    paddle.set_device("cpu")
    return cpu_name()


class FleetTrainer(Trainer):
    framework = "paddle"
    sync_off_switch = "paddle.DataParallel.no_sync()"
    anatomy_methods = {
        "forward": "model(x, y): forward and loss under auto_cast, per micro-batch",
        "backward": "loss.backward(), per micro-batch",
        "optimizer": "optimizer.step() (GradScaler's step and update under fp16)",
    }

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        options = PaddleOptions.from_dict(cfg.backend_options)
        self.stage = options.sharding_stage
        if self.stage >= 2 and cfg.topology.device != "cuda":
            raise RuntimeError(
                f"paddle-fleet sharding stage {self.stage} is unavailable on CPU: Paddle "
                f"{paddle.__version__}'s group_sharded_parallel supports only GPU/XPU devices"
            )
        if cfg.model.precision in AMP_DTYPES and cfg.topology.device != "cuda":
            raise RuntimeError(
                f"paddle-fleet {cfg.model.precision} is unavailable on CPU: paddle.amp casts only on "
                f"GPU/XPU/custom devices in Paddle {paddle.__version__} (on CPU its autocast "
                "'makes no effect'), so the run would silently train in fp32"
            )
        self.device_name = use_rank_device(cfg)
        self.tf32_settings = apply_tf32_rule(cfg)
        strategy = fleet.DistributedStrategy()
        if self.stage == 1:
            strategy.hybrid_configs = {"dp_degree": 1, "sharding_degree": cfg.process_group_size}
        # Fleet's topology groups, each over a store of its own: groups.py says why
        gloo_groups_with_own_stores(get_backend(cfg.backend).timeouts(cfg)[PADDLE_GLOO_GROUP_STORE])
        fleet.init(is_collective=True, strategy=strategy)

        model = GPT(cfg.model.spec, cfg.model.activation_checkpointing).load_spec_weights(cfg.model.seed)
        self.seen: dict[str, str] = {}
        self.watch_numerics(model)
        optimizer = make_optimizer(model)
        self.amp_dtype = AMP_DTYPES.get(cfg.model.precision)
        self.amp_level = options.amp_level if self.amp_dtype else None
        if self.amp_dtype and self.amp_level == "O2":  # bf16/fp16 parameters and gradients, fp32 masters
            # Paddle's annotation returns the optimizer as its _OptimizerLike protocol; it is the same AdamW.
            model, optimizer = paddle.amp.decorate(  # type: ignore[assignment]
                models=model, optimizers=optimizer, level="O2", dtype=self.amp_dtype, master_weight=True
            )
        if options.to_static:  # converts the layer's forward in place: parameter names stay
            model = paddle.jit.to_static(model)
        self.gpt, self.adamw = model, optimizer  # unwrapped: for weights and state counting
        scaler = paddle.amp.GradScaler(init_loss_scaling=2.0**15) if cfg.model.precision == "fp16" else None
        if self.stage >= 2:
            from paddle.distributed.sharding import group_sharded_parallel

            model, optimizer, scaler = group_sharded_parallel(
                model, optimizer, GROUP_SHARDED_LEVELS[self.stage], scaler=scaler
            )
        else:
            # Paddle 3.3.1 wraps a 1-process model in NoPipelineParallel, which accepts only a PipelineLayer:
            # alone (world 1, the isolated counterfactual) the model runs unwrapped, with nothing to sync.
            if cfg.process_group_size > 1:
                traced = (
                    cfg.measurement.trace_comm
                    and cfg.measurement.trace_steps
                    and cfg.topology.device == "cpu"
                    and not self.stage
                )
                with reducer_log() if traced else nullcontext({"text": ""}) as construction:
                    model = fleet.distributed_model(model)  # its log names its gradient groups
                self.reducer_groups = paddle_reducer_groups(construction["text"])
            optimizer, scaler = (
                fleet.distributed_optimizer(optimizer),
                scaler and fleet.distributed_scaler(scaler),
            )
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        # DataParallel's no_sync skips the all-reduce and nothing else: a true compute-only step.
        self.can_skip_grad_sync = isinstance(model, paddle.DataParallel)

    def watch_numerics(self, model) -> None:
        """Hooks that note, in the first forward only (each removes itself), the dtypes forward really uses:
        the first block's first MLP weight and that matmul's output, and the block's output (the residual
        stream). paddle.amp.decorate (O2) casts the parameters in place, so the hooks see its dtype."""
        fc, block = model.blocks[0].mlp.fc, model.blocks[0]

        def on_fc(layer, inputs, output):
            self.seen.update(forward_params=dtype_name(layer.weight.dtype), compute=dtype_name(output.dtype))
            handles[0].remove()

        def on_block(layer, inputs, output):
            self.seen["activations"] = dtype_name(output.dtype)
            handles[1].remove()

        handles = [fc.register_forward_post_hook(on_fc), block.register_forward_post_hook(on_block)]

    def observed_numerics(self) -> dict:
        """What this worker saw (None: not observable): DataParallel and the sharded optimizers reduce the
        .grad tensors as they are; the optimizer updates the fp32 master weights of O2 (multi_precision),
        else the parameters themselves."""
        params = self.gpt.parameters()
        masters = getattr(self.adamw, "_master_weights", None) or {}
        state = self.adamw.state_dict()
        updated = joined(t.dtype for t in masters.values()) or joined(p.dtype for p in params)
        return {
            **self.seen,
            "grad_reduce": None
            if self.world_size == 1
            else joined(p.grad.dtype for p in params if p.grad is not None),
            "master_weights": updated and master_weights(self.cfg.model.precision, updated),
            "optimizer_state": joined(
                t.dtype for k, t in state.items() if "moment" in k and isinstance(t, paddle.Tensor)
            ),
            "loss_scaling": "dynamic" if self.scaler else "none",
            "tf32": self.tf32_settings["paddle.base.core.set_cublas_switch"],
        }

    def autocast(self):
        if not (self.amp_dtype and self.amp_level):  # both or neither
            return nullcontext()
        return paddle.amp.auto_cast(enable=True, level=self.amp_level, dtype=self.amp_dtype)

    def step(self, batches, sync_grads=True):
        clear_gradients(self.optimizer, self.stage)
        losses = []
        for i, (x, y) in enumerate(batches):
            sync_now = sync_grads and i == len(batches) - 1
            with nullcontext() if sync_now or not self.can_skip_grad_sync else self.model.no_sync():

                def forward(x=x, y=y):
                    with self.autocast():
                        return self.model(paddle.to_tensor(x), paddle.to_tensor(y)) / len(batches)

                loss = self.timed_part("forward", forward)
                self.timed_part("backward", (self.scaler.scale(loss) if self.scaler else loss).backward)
            losses.append(loss.detach())

        def optimizer_step():
            if self.scaler:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()

        self.timed_optimizer_step(optimizer_step)
        return float(paddle.add_n(losses))

    def trace_collectives(self, run_steps) -> dict:
        """paddle.profiler (CPU target) records no event for DataParallel's gloo all-reduce (a traced tiny
        step held 1,422 events, none of them communication). So on CPU Paddle's own reducer log (VLOG 3)
        times each fused all-reduce (backends.paddle_fleet.trace.paddle_reducer_collectives), and the
        kernel's TCP counters of this rank's connections, read before and after the traced steps, give the
        bytes gloo sent (nothing else talks during steps). Sharding stage 1 reduces and broadcasts outside
        the reducer, and a Paddle whose log reads otherwise gives no call of a known size: bytes on the wire
        only, with neither op nor time. On GPU NCCL does not use those sockets
        inside a node, and the profiler's NCCL path is not built: no trace."""
        if self.cfg.topology.device != "cpu":
            return {
                "method": None,
                "reason": "no trace for paddle-fleet on GPU: its NCCL kernels in paddle.profiler are not "
                "read yet",
            }
        data_parallel = isinstance(self.model, paddle.DataParallel)  # else sharding: no reducer to log
        before = tcp_counters()
        with reducer_log() if data_parallel else nullcontext({"text": ""}) as log:
            step_times = run_steps()
        wire = wire_bytes(before, tcp_counters())
        trace = {"steps": len(step_times), "step_times": step_times, "wire": wire}
        calls = (
            paddle_reducer_collectives(log["text"], self.reducer_groups, self.cfg.process_group_size)
            if data_parallel
            else []
        )
        if calls and all(c["size_bytes"] for c in calls):
            method = "paddle reducer log (VLOG 3) + kernel TCP counters"
            return {**trace, "method": method, "collectives": calls}
        why = (
            f"Paddle {paddle.__version__}'s reducer log held no fused all-reduce of a known group"
            if data_parallel
            else "sharding stage 1 reduces outside DataParallel's logged reducer"
        )
        return {
            **trace,
            "method": "kernel TCP counters",
            "collectives": None,
            "reason": f"paddle.profiler records no event for gloo collectives on CPU, and {why}: the bytes "
            "this rank's TCP connections carried, not each collective",
        }

    def synchronize(self) -> None:
        """On GPU, a device-wide sync of this worker's GPU (paddle.device.synchronize of the current
        place: cudaDeviceSynchronize, so also the communication streams); CPU ops finish as they run."""
        if self.cfg.topology.device == "cuda":
            paddle.device.synchronize()

    def math_mode(self) -> dict:
        """Whether cuBLAS runs fp32 matmuls in TF32: Paddle's cuBLAS TF32 switch (phi's allow_tf32_cublas,
        on by default in CUDA builds; paddle.base.core.set/get_cublas_switch, no FLAGS_ entry), as this
        worker set it by the rule (apply_tf32_rule: off unless an fp32 run asked for --tf32), on a GPU of
        compute capability 8.0+, unless NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS; None on a CPU. With
        the numerics the adapter states, checked against what this worker saw."""
        settings = {n: bool(paddle_switch(n.replace(".set_", ".get_"))()) for n in self.tf32_settings}
        mode: dict[str, object] = {
            "tf32": None,
            "tf32_setting": ", ".join(f"{k.replace('.set_', '.get_')}()={v}" for k, v in settings.items()),
        }
        if self.cfg.topology.device == "cuda":
            capable = tuple(paddle.device.cuda.get_device_capability()) >= (8, 0)
            switch = settings["paddle.base.core.set_cublas_switch"]
            mode["tf32"] = switch and capable and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0"
        stated = get_backend(self.cfg.backend).numerics(self.cfg).record(self.cfg)
        mode["numerics"] = checked(stated, self.observed_numerics(), f"{self.cfg.backend} rank {self.rank}")
        return mode

    def reset_peak_memory(self) -> None:
        if self.cfg.topology.device == "cuda":
            paddle.device.cuda.reset_max_memory_allocated()
            paddle.device.cuda.reset_max_memory_reserved()

    def memory(self) -> dict:
        """The GPU allocator's peaks since the reset after warm-up; empty on CPU."""
        if self.cfg.topology.device != "cuda":
            return {}
        return {
            "allocated_peak": paddle.device.cuda.max_memory_allocated(),
            "reserved_peak": paddle.device.cuda.max_memory_reserved(),
        }

    def model_state_bytes(self) -> dict:
        """Counted from this rank's tensors: parameters and their .grad, and the optimizer's state_dict
        (AdamW moments and beta-power accumulators of the parameters this rank updates, plus the fp32
        master weights under O2)."""
        params = self.gpt.parameters()

        def state_tensors(state):
            for value in state.values():
                if isinstance(value, dict):
                    yield from state_tensors(value)
                elif isinstance(value, paddle.Tensor):
                    yield value

        return {
            "params": sum(tensor_bytes(p) for p in params),
            "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(tensor_bytes(t) for t in state_tensors(self.adamw.state_dict())),
        }

    def final_weights(self) -> dict:
        params = dict(self.gpt.named_parameters())
        return {
            name: params[name + ".weight" if name.endswith("emb") else name].astype("float32").numpy()
            for name in self.cfg.model.spec.parameter_shapes()
        }

    def versions(self) -> dict:
        out = {"paddle": paddle.__version__}
        if self.cfg.topology.device == "cuda":
            out.update({"cuda": paddle.version.cuda(), "cudnn": paddle.version.cudnn()})
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def make_trainer(cfg):
    return FleetTrainer(cfg)
