"""deepspeed worker: the spec's GPT in a DeepSpeed engine (ZeRO stage from the run's options), trained with
the same torch AdamW as every PyTorch backend, passed to DeepSpeed as the client optimizer.

Model-state bytes are counted from the tensors this rank holds, each storage once (ZeRO's parameters and
gradient partitions are views into flat buffers):
  params     the module's parameters: at ZeRO-3 each one's partition (`ds_tensor`) plus any parameter
             still gathered (those under stage3_param_persistence_threshold stay whole on every rank);
  grads      what holds gradients at the end of the step's last backward, once reduced: parameters'
             .grad and ZeRO's reduced partitions. The engine frees most of them in step(), so they are
             sampled just before it (the full gradients ZeRO-1 has while it reduces them are transient);
  optimizer  the fp32 master partitions the inner AdamW updates (where they are not the module's own
             parameters) and AdamW's moments.
Buffers that only carry communication (bucket and prefetch buffers) are not model state and not counted.
"""

from datetime import timedelta

import deepspeed
import torch
from deepspeed import DeepSpeedEngine
from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
from deepspeed.utils import groups

from backends import get_backend
from backends.deepspeed_zero import DS_INIT_DISTRIBUTED, DS_WORLD_GROUP
from backends.deepspeed_zero.ds_config import DeepSpeedOptions, ds_config
from backends.torch_common import TorchTrainer, joined
from workloads.spec import OPTIMIZER
from workloads.torch_model import make_optimizer, optimizer_groups


def storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind `tensors` not already in `seen` (storage addresses), which it extends."""
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class DeepSpeedTrainer(TorchTrainer):
    # What deepspeed.initialize returns (the engine around the module, the ZeRO optimizer around the client
    # AdamW); DeepSpeed ships no type information, so the checker takes both as Any.
    model: DeepSpeedEngine
    optimizer: DeepSpeedOptimizer

    def __init__(self, cfg):
        super().__init__(cfg)
        self.ds_options = DeepSpeedOptions.from_dict(cfg.backend_options)
        self.scaler = None  # fp16 loss scaling is the engine's own
        timeouts = get_backend(cfg.backend).timeouts(cfg)
        deepspeed.init_distributed(
            dist_backend="nccl" if self.device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=timeouts[DS_INIT_DISTRIBUTED]),
        )
        # ZeRO's collectives run on DeepSpeed's clone of the world group, which it makes with
        # dist.new_group() and so torch's default timeout (30 min), not init_distributed's. Make that clone
        # here, with the run's collective timeout, so a hung peer ends the run on time.
        groups._WORLD_GROUP = torch.distributed.new_group(
            ranks=range(torch.distributed.get_world_size()),
            timeout=timedelta(seconds=timeouts[DS_WORLD_GROUP]),
        )
        model = self.build_model()
        # parameter groups built before ZeRO-3 partitions the parameters
        deepspeed_own = self.ds_options.optimizer == "deepspeed"
        optimizer = self.deepspeed_adamw(model) if deepspeed_own else make_optimizer(model)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config(cfg)
        )
        self.grad_bytes = 0

    def deepspeed_adamw(self, model) -> torch.optim.Optimizer:
        """DeepSpeed's own AdamW over the same parameter groups and hyperparameters (workloads.spec): its
        fused CUDA kernel on a GPU, its vectorised C++ one on a CPU (DeepSpeedCPUAdam, ZeRO-Offload's),
        each built as a torch extension on first use."""
        groups, opt = optimizer_groups(model), OPTIMIZER
        hyper = {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps}
        if self.device.type == "cuda":
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, adam_w_mode=True, **hyper)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **hyper)

    anatomy_methods = {
        "forward": "engine(x, y): forward and loss, ZeRO-3's parameter gathers included, per micro-batch",
        "backward": "engine.backward(loss), ZeRO's gradient hooks and reduction included, per micro-batch",
        "optimizer": "engine.step() at the accumulation boundary: the optimizer, its gradient norm and "
        "overflow checks, and ZeRO-1/2's gather of the updated partitions",
    }

    def step(self, batches, sync_grads=True):
        """One engine.backward + engine.step per micro-batch, as DeepSpeed prescribes: backward scales the
        loss by 1 / gradient_accumulation_steps and step() updates only at the accumulation boundary."""
        losses: list[torch.Tensor] = []
        for x, y in batches:
            loss = self.timed_part("forward", lambda x=x, y=y: self.model(*self.inputs(x, y)))
            self.timed_part("backward", lambda loss=loss: self.model.backward(loss))
            if len(losses) == len(batches) - 1:  # the boundary: the optimizer steps in this engine.step()
                self.grad_bytes = storage_bytes(self.held_gradients(), set())  # bytes only, not the tensors
                self.timed_optimizer_step(self.model.step)
            else:
                self.model.step()
            losses.append(loss.detach())
        return float(sum(losses)) / len(batches)

    def master_weights(self) -> list:
        """The fp32 partitions the inner torch AdamW updates (at stage 0 in fp32: the module's parameters).
        ZeRO-3 hands its sub-groups to the inner optimizer only for the step itself."""
        masters = [p for group in self.model.basic_optimizer.param_groups for p in group["params"]]
        return masters + list(getattr(self.optimizer, "fp32_partitioned_groups_flat", []))

    def held_gradients(self) -> list:
        """The module's .grad, ZeRO's reduced partitions (ZeRO-3 keeps them all in one flat buffer), and
        the fp32 masters' .grad where offloading puts them there."""
        grads = [
            p.grad for p in [*self.model.module.parameters(), *self.master_weights()] if p.grad is not None
        ]
        flat = getattr(self.optimizer, "grad_partitions_flat_buffer", None)
        grads += [flat] if flat is not None else []
        partitions = getattr(self.optimizer, "averaged_gradients", None) or {}
        for group in partitions.values() if isinstance(partitions, dict) else partitions:
            grads += [g for g in group or () if g is not None]
        return grads

    def reduced_gradient_dtype(self):
        """The dtype DeepSpeed reduces each gradient in: a ZeRO optimizer's per-parameter communication
        dtype (under torch_autocast a parameter's comm_dtype, else the engine's communication_data_type),
        the engine's communication_data_type at stage 0."""
        if self.world_size == 1:
            return None
        if not self.model.zero_optimization():
            return joined([self.model.communication_data_type])
        return joined(self.optimizer.get_param_comm_dtype(p) for p in self.model.module.parameters())

    def updated_weights_dtype(self):
        return joined(p.dtype for p in self.master_weights())

    def optimizer_state_dtype(self):
        state = self.model.basic_optimizer.state
        return joined(v.dtype for s in state.values() for k, v in s.items() if k.startswith("exp_avg"))

    def loss_scaling(self):
        """torch_autocast's GradScaler (fp16), which the ZeRO optimizer or, at stage 0, the engine holds;
        DeepSpeed's native fp16 loss scaler is not read (None: not observed)."""
        if self.model.fp16_enabled():
            return None
        scaler = getattr(self.optimizer, "torch_autocast_gradscaler", None)
        scaler = scaler or getattr(self.model, "torch_autocast_z0_gradscaler", None)
        return "dynamic" if scaler is not None else "none"

    def model_state_bytes(self) -> dict:
        module_params = list(self.model.module.parameters())
        params = [p.ds_tensor for p in module_params if hasattr(p, "ds_tensor")] + [
            p.data for p in module_params
        ]
        state = self.model.basic_optimizer.state
        moments = [v for s in state.values() for v in s.values() if torch.is_tensor(v)]
        seen: set[int] = set()
        return {
            "params": storage_bytes(params, seen),
            "grads": self.grad_bytes,
            "optimizer": storage_bytes(self.master_weights() + moments, seen),
        }

    def final_weights(self) -> dict:
        """Gathers ZeRO-3's partitioned parameters only: GatheredParameters releases what it gathered on
        exit, and a persistent tensor released there would be gathered again in the next forward, one
        gather the step would not otherwise make (the collective trace of the steps after saw it)."""
        partitioned = [p for p in self.model.module.parameters() if not getattr(p, "ds_persist", False)]
        with deepspeed.zero.GatheredParameters(partitioned):  # a no-op below ZeRO-3
            return super().final_weights()

    def versions(self) -> dict:
        return {**super().versions(), "deepspeed": deepspeed.__version__}


def make_trainer(cfg):
    return DeepSpeedTrainer(cfg)
