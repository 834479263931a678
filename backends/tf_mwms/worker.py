"""tf-mwms worker: a custom training loop under MultiWorkerMirroredStrategy, one replica per worker.

Each worker feeds its own micro-batch to its single local replica. The replica's loss is divided by the
number of micro-batches and by num_replicas_in_sync, so the gradients MWMS all-reduces (a SUM) come out as
the mean over the global batch, as DDP's averaged gradients do. With gradient accumulation, the non-final
micro-batches add their gradients to per-replica (sync-on-read) buffers and only the final one applies
them, so the all-reduce runs once per step.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.distribute import collective_all_reduce_strategy  # noqa: E402
from tensorflow.python.eager import context as tf_context  # noqa: E402

from backends import get_backend  # noqa: E402
from backends.loop import Trainer  # noqa: E402
from backends.process_stats import cpu_name  # noqa: E402
from backends.tf_mwms import (  # noqa: E402
    TF_CLUSTER_WAIT,
    TF_COLLECTIVES,
    TF_PEER_CHECK,
    TF_PEER_CHECK_TRIES,
    TFOptions,
    communication,
)
from backends.tf_mwms.trace import TF_OPS, tf_collectives  # noqa: E402
from core.config import RunConfig  # noqa: E402
from core.precision import checked, dtype_name, master_weights, tf32_switches  # noqa: E402
from workloads.tf_model import GPT, make_optimizer  # noqa: E402

# The profiler's host tracer at level 1 (critical events, the collective kernels among them) and no Python or
# device tracer: the trace reads the host planes only, and at the default level 2 stopping the profiler under
# MWMS kills a worker far more often (README) and slows the traced collectives more.
PROFILER_OPTIONS = tf.profiler.experimental.ProfilerOptions(
    host_tracer_level=1, python_tracer_level=0, device_tracer_level=0
)

# The last step's collective kernel can return to the step before its thread closes its profiler event, and a
# profiler stopped at once then loses that event (README). Waited after the traced steps' times are taken.
PROFILER_GRACE_S = 0.1

POLICIES = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def communication_options(cfg: RunConfig):
    """MWMS's communication options: the implementation the adapter chose for this device (on a GPU, `auto`
    is NCCL: backends.tf_mwms.communication says why) and the run's collective timeout."""
    return tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation[communication(cfg)],
        timeout_seconds=get_backend(cfg.backend).timeouts(cfg)[TF_COLLECTIVES],
    )


def set_health_check_timeouts(cfg: RunConfig) -> None:
    """MWMS's health check waits as the adapter's timeouts() say (why: there). They are class attributes of
    CollectiveAllReduceExtended, read when the strategy starts its check thread, so set before it is made;
    TensorFlow's own multi-worker tests set them the same way."""
    timeouts = get_backend(cfg.backend).timeouts(cfg)
    extended = collective_all_reduce_strategy.CollectiveAllReduceExtended
    extended._check_health_initial_timeout = timeouts[TF_CLUSTER_WAIT]
    extended._check_health_timeout = math.ceil(timeouts[TF_PEER_CHECK])  # TensorFlow multiplies it to ms
    if extended._check_health_retry_limit != TF_PEER_CHECK_TRIES:
        raise RuntimeError(
            f"TensorFlow {tf.__version__} tries a peer {extended._check_health_retry_limit} times, not "
            f"{TF_PEER_CHECK_TRIES}: backends/tf_mwms TF_PEER_CHECK_TRIES is out of date"
        )


def sync_worker_devices(strategy) -> None:
    """Block until this worker's devices are idle (see MWMSTrainer.synchronize for why this way)."""
    for device in strategy.extended.worker_devices:
        with tf.device(device):
            tf.raw_ops.SyncDevice()
    if not tf.config.experimental.get_synchronous_execution():
        tf_context.async_wait()


def tf_switch(name: str):
    """The function a switch is named by in core.precision ("tf.config.experimental....")."""
    obj = tf
    for part in name.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def apply_tf32_rule(cfg: RunConfig) -> dict[str, bool]:
    """Set TensorFlow's TF32 switch (cuBLAS and cuDNN; on by default) as core.precision decides for this
    run, on a CPU too, where it changes nothing; returns it as TensorFlow reads it back."""
    switches = tf32_switches("tensorflow", cfg)
    for name, value in switches.items():
        tf_switch(name)(value)
    return {name: bool(tf.config.experimental.tensor_float_32_execution_enabled()) for name in switches}


def joined(dtypes) -> str | None:
    names = sorted({dtype_name(d) for d in dtypes})
    return "/".join(names) or None


def nbytes(variable) -> int:
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


class MWMSTrainer(Trainer):
    framework = "tensorflow"

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        # Thread pools are fixed when the runtime starts, i.e. by the strategy below: set them first.
        tf.config.threading.set_intra_op_parallelism_threads(cfg.topology.threads_per_worker)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        if cfg.model.precision in POLICIES:  # fp32 variables, bf16/fp16 compute; the loss is computed in fp32
            keras.mixed_precision.set_global_policy(POLICIES[cfg.model.precision])
        self.tf32 = any(apply_tf32_rule(cfg).values())
        opts = TFOptions.from_dict(cfg.backend_options)
        set_health_check_timeouts(cfg)
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=communication_options(cfg)
        )
        if len(self.strategy.extended.worker_devices) != 1:
            raise RuntimeError(f"expected one device per worker, got {self.strategy.extended.worker_devices}")
        gpus = tf.config.list_physical_devices("GPU")
        self.device_name = (
            tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
            if gpus
            else cpu_name()
        )
        with self.strategy.scope():
            self.model = GPT(cfg.model.spec, cfg.model.activation_checkpointing).load_spec_weights(
                cfg.model.seed
            )
            self.optimizer = make_optimizer(self.model)
            if cfg.model.precision == "fp16":
                self.optimizer = keras.optimizers.LossScaleOptimizer(self.optimizer)
                self.optimizer.build(self.model.trainable_variables)
            self.grad_buffers = (
                [
                    tf.Variable(
                        tf.zeros(v.shape, v.dtype),
                        trainable=False,
                        synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM,
                    )
                    for v in self.model.trainable_variables
                ]
                if cfg.batch.grad_accum > 1
                else []
            )
        self.loss_scale = self.optimizer.scale_loss if cfg.model.precision == "fp16" else (lambda loss: loss)
        self.gradients = tf.function(self.replica_gradients, jit_compile=opts.xla)
        self.accumulate = tf.function(lambda x, y: self.strategy.run(self.replica_accumulate, args=(x, y)))
        self.apply = tf.function(lambda x, y: self.strategy.run(self.replica_apply, args=(x, y)))
        # The anatomy steps' own functions (anatomy_step): apply split into its gradients and its update,
        # and the forward alone. Only a worker with no peer runs them, so no collective waits on another.
        self.forward_loss = tf.function(self.replica_forward, jit_compile=opts.xla)
        self.forward_only = tf.function(lambda x, y: self.strategy.run(self.forward_loss, args=(x, y)))
        self.split_gradients = tf.function(lambda x, y: self.strategy.run(self.gradients, args=(x, y)))
        self.update = tf.function(lambda grads: self.strategy.run(self.replica_given_update, args=(grads,)))
        self.anatomy_calls: dict = {}  # their concrete functions, once prepare_anatomy has run them

    # -------------------------------------------------------------- per-replica functions (replica context)
    def replica_gradients(self, x, y):
        """This replica's loss and gradients of its share of the global mean loss (scaled for fp16).

        Dense gradients, as DDP all-reduces: the position embedding's gradient is IndexedSlices, which
        MWMS "all-reduces" by gathering every replica's slices, and Keras's AdamW squares those slices
        one by one for its second moment: g0^2 + g1^2 instead of (g0 + g1)^2 for a row both replicas hold."""
        share = self.cfg.batch.grad_accum * self.strategy.num_replicas_in_sync
        with tf.GradientTape() as tape:
            loss = self.model(x, y)
            scaled = self.loss_scale(loss / share)
        return loss, [tf.convert_to_tensor(g) for g in tape.gradient(scaled, self.model.trainable_variables)]

    def replica_accumulate(self, x, y):
        loss, grads = self.gradients(x, y)
        for buffer, grad in zip(self.grad_buffers, grads):
            buffer.assign_add(grad)
        return loss

    def replica_apply(self, x, y):
        loss, grads = self.gradients(x, y)
        self.replica_update(grads)
        return loss

    def replica_update(self, grads):
        """The step's update from the last micro-batch's gradients: the accumulated ones added, the
        all-reduce (SUM) inside apply_gradients, the buffers cleared."""
        if self.grad_buffers:
            grads = [buffer.read_value() + grad for buffer, grad in zip(self.grad_buffers, grads)]
        if self.cfg.model.precision == "fp16":
            grads = self.agree_on_overflow(grads)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))  # all-reduce (SUM) inside
        for buffer in self.grad_buffers:
            buffer.assign(tf.zeros_like(buffer))

    def replica_given_update(self, grads):
        """replica_update of gradients handed in from an earlier call: each placed on this replica's
        device first (tf.identity), since the all-reduce inside apply_gradients sends its result to where
        its input is, and a function's input has no device."""
        self.replica_update([tf.identity(g) for g in grads])

    def replica_forward(self, x, y):
        """This replica's loss alone: the forward of replica_gradients, without its tape."""
        return self.model(x, y)

    def agree_on_overflow(self, grads):
        """Keras's LossScaleOptimizer decides to skip a step from this replica's gradients before they are
        all-reduced, so one worker could skip while another applies. Poisoning every replica's gradients
        when any replica overflowed makes all of them take the same branch (one scalar all-reduce)."""
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        overflows = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, 1.0 - tf.cast(finite, tf.float32)
        )
        return tf.cond(overflows == 0, lambda: grads, lambda: [g + np.float32("nan") for g in grads])

    # ---------------------------------------------------------------------------------- Trainer interface
    anatomy_methods = {
        "forward": "forward_only(x, y): the model's loss without a tape, a traced function of its own, per "
        "micro-batch",
        "backward": "the gradients' traced function (split_gradients(x, y); accumulate(x, y), which also "
        "adds them into the buffers, before the last micro-batch) less forward_only(x, y) of the same "
        "micro-batch, whose forward it runs again, per micro-batch",
        "optimizer": "update(grads): the accumulated gradients added, apply_gradients (AdamW, its all-reduce "
        "with no peer) and the buffers cleared, the tail of the measured steps' apply(x, y)",
    }

    def step(self, batches, sync_grads=True):
        """accumulate(x, y) per micro-batch but the last, apply(x, y) for the last: forward and backward
        in each, the optimizer too in apply, so a test's delay of a part is slept in the call that holds
        it (Trainer.timed_part). The anatomy steps run anatomy_step instead."""
        if self.time_parts:
            return self.anatomy_step(batches)
        losses = []
        for i, (x, y) in enumerate(batches):
            x, y = tf.constant(x), tf.constant(y)
            if i == len(batches) - 1:
                run = functools.partial(self.apply, x, y)
                per_replica = self.timed_part("optimizer", run, includes=("forward", "backward", "optimizer"))
            else:
                run = functools.partial(self.accumulate, x, y)
                per_replica = self.timed_part("backward", run, includes=("forward", "backward"))
            losses.append(self.strategy.experimental_local_results(per_replica)[0])
        return float(tf.add_n(losses)) / len(batches)

    def anatomy_step(self, batches) -> float:
        """The step with each part a call of its own (anatomy_methods), for a worker with no peer
        (backends.loop.anatomy_steps: MWMS has no sync-off switch, so only a peerless worker runs these):
        per micro-batch forward_only, then its gradients (accumulate before the last micro-batch,
        split_gradients for the last), then update with the last gradients, the work apply does. The
        gradients' call runs the forward again, so forward_only's own time is taken off it: the backward
        part is the backward, and forward and backward add up to the gradients' call. Where noise makes
        forward_only outlast the whole gradients' call (a model whose backward takes less than a
        scheduler's hiccup), the forward in that call is taken as the call, its bound, and the backward
        as nothing but its test delay, never a negative time. A test's delay is slept once per part, as
        the measured step sleeps it, the forward's in forward_only's part alone, so it moves no other part.

        Each is called as its concrete function (prepare_anatomy): the generic call binds every one of
        update's tensors anew, on a small model about as long as the update itself, by which the parts
        added up to more than the step. Not one traced function split by a tape (the forward under an
        eager tf.GradientTape, then tape.gradient) either: on a small model its extra eager work costs
        more than the gradients' whole call."""
        if not self.anatomy_calls:
            self.prepare_anatomy(*batches[-1])
        calls = self.anatomy_calls
        losses = []
        grads = None
        for i, (x, y) in enumerate(batches):
            x, y = tf.constant(x), tf.constant(y)
            _, forward_s = self.timed_part_seconds("forward", functools.partial(calls["forward"], x, y))
            last = i == len(batches) - 1
            gradients = calls["gradients"] if last else calls["accumulate"]
            out, gradients_s = self.timed_part_seconds("backward", functools.partial(gradients, x, y))
            self.part_times["backward"] -= min(forward_s, gradients_s)
            if last:
                loss, grads = out
            else:
                loss = out
            losses.append(self.strategy.experimental_local_results(loss)[0])
        self.timed_optimizer_step(functools.partial(calls["update"], grads))
        return float(tf.add_n(losses)) / len(batches)

    def prepare_anatomy(self, x, y) -> None:
        """Before the first anatomy step's parts are timed: one untimed run of its forward_only,
        split_gradients and update on a micro-batch, since a tf.function's first call traces and builds it
        (seconds, against milliseconds for a part), which the warm-up steps keep out of the measured steps;
        then their concrete functions (and accumulate's, where it runs), which the anatomy steps call. It
        steps the model once more; nothing reads the model after the anatomy steps (the record's final
        weights are the measured steps')."""
        x, y = tf.constant(x), tf.constant(y)
        self.forward_only(x, y)
        _, grads = self.split_gradients(x, y)
        self.update(grads)
        self.synchronize()
        self.anatomy_calls = {
            "forward": self.forward_only.get_concrete_function(x, y),
            "gradients": self.split_gradients.get_concrete_function(x, y),
            "update": self.update.get_concrete_function(grads),
            **({"accumulate": self.accumulate.get_concrete_function(x, y)} if self.grad_buffers else {}),
        }

    def synchronize(self) -> None:
        """Wait until this worker's device has finished all queued work: the last step's all-reduce,
        optimizer apply and buffer resets (on GPU, apply() returns once its ops are enqueued, and the loss
        read-back is only bound to wait for the loss). A SyncDevice op on this worker's own device blocks
        until its GPU stream is idle (a no-op kernel on CPU, where ops finish before the call returns), then
        any async-eager queue is drained. Not tf.test.experimental.sync_devices(): it syncs every logical
        device, and under MWMS those include the other workers' devices, which this eager context cannot run
        ops on ("Haven't set up remote eager worker")."""
        sync_worker_devices(self.strategy)

    def trace_collectives(self, run_steps) -> dict:
        """TensorFlow's profiler (tf.profiler.experimental) over the traced steps: each collective kernel
        (the gradients' CollectiveReduceV2 inside apply_gradients) with its time on its rank. The profile
        holds no tensor sizes, so each collective node's input shape and dtype are read from the graphs of
        the step's traced functions (the same tf.function calls, no retracing) and joined by node name.
        Stopping TensorFlow 2.21's profiler under MultiWorkerMirroredStrategy now and then kills the worker
        (a double free while "collecting data"); the run keeps its measurements and records the incident
        (harness.run.record.measured_before_failure)."""
        from tensorflow.tsl.profiler.protobuf import xplane_pb2

        with tempfile.TemporaryDirectory() as folder:
            tf.profiler.experimental.start(folder, options=PROFILER_OPTIONS)
            step_times = run_steps()
            time.sleep(PROFILER_GRACE_S)
            tf.profiler.experimental.stop()
            spans = []
            for path in Path(folder).rglob("*.xplane.pb"):
                space = xplane_pb2.XSpace()
                space.ParseFromString(path.read_bytes())
                for plane in (p for p in space.planes if p.name.startswith("/host")):
                    names = {k: v.name for k, v in plane.event_metadata.items()}
                    for line in plane.lines:
                        spans += [
                            {
                                "name": names.get(e.metadata_id, ""),
                                "line": line.name,
                                "start_s": line.timestamp_ns / 1e9 + e.offset_ps / 1e12,
                                "time_s": e.duration_ps / 1e12,
                            }
                            for e in line.events
                        ]
        # The step functions as the steps traced them: every micro-batch is (micro_batch, seq_len) int64
        # inputs and targets (Trainer.step's contract), so these specs find those graphs, no new trace.
        batch = tf.TensorSpec((self.cfg.batch.micro_batch, self.cfg.model.spec.seq_len), tf.int64)
        inputs = {}
        for fn in (self.apply, self.accumulate) if self.cfg.batch.grad_accum > 1 else (self.apply,):
            for op in fn.get_concrete_function(batch, batch).graph.get_operations():
                if op.type in TF_OPS and op.inputs:
                    tensor = op.inputs[0]
                    inputs[op.name] = (int(np.prod(tensor.shape)), tensor.dtype.name)
        return {
            "method": "tf.profiler (host_tracer_level 1)",
            "steps": len(step_times),
            "step_times": step_times,
            "collectives": tf_collectives(spans, inputs, self.cfg.process_group_size),
        }

    def math_mode(self) -> dict:
        """Whether fp32 matmuls run in TF32: TensorFlow's switch (on by default), as this worker set it by
        the rule (apply_tf32_rule: off unless an fp32 run asked for --tf32), on a GPU of compute capability
        8.0+, unless NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS itself; None on a CPU. With the
        numerics the adapter states, checked against what this worker saw."""
        switch = tf.config.experimental.tensor_float_32_execution_enabled()
        setting = f"tf.config.experimental.tensor_float_32_execution_enabled()={switch}"
        mode: dict[str, object] = {"tf32": None, "tf32_setting": setting}
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability", (0, 0))
            capable = tuple(capability) >= (8, 0) and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0"
            mode["tf32"] = switch and capable
        stated = get_backend(self.cfg.backend).numerics(self.cfg).record(self.cfg)
        mode["numerics"] = checked(stated, self.observed_numerics(), f"{self.cfg.backend} rank {self.rank}")
        return mode

    def observed_numerics(self) -> dict:
        """What this worker sees of its numerics (None: not observable): the first block and its first MLP
        matmul called once on zeros (after the measured steps) give the matmul's and the residual stream's
        dtypes under the mixed policy; the variables' dtype is what forward holds before Keras casts it
        inside each layer; the step's traced graph gives the dtype its collectives reduce."""
        d = self.cfg.model.spec.d_model
        block = self.model.blocks[0]
        compute = block.mlp.fc(tf.zeros((1, d))).dtype
        activations = block(tf.zeros((1, 1, d))).dtype
        batch = tf.TensorSpec((self.cfg.batch.micro_batch, self.cfg.model.spec.seq_len), tf.int64)
        graph = self.apply.get_concrete_function(batch, batch).graph
        reduced = [op.inputs[0].dtype for op in graph.get_operations() if op.type in TF_OPS and op.inputs]
        inner = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        moments = [v for v in inner.variables if any(k in v.path for k in ("momentum", "velocity"))]
        updated = joined(v.dtype for v in self.model.trainable_variables)
        return {
            "compute": dtype_name(compute),
            "forward_params": dtype_name(block.mlp.fc.kernel.dtype),
            "activations": dtype_name(activations),
            "grad_reduce": joined(reduced) if self.world_size > 1 else None,
            "master_weights": updated and master_weights(self.cfg.model.precision, updated),
            "optimizer_state": joined(v.dtype for v in moments),
            "loss_scaling": "dynamic" if inner is not self.optimizer else "none",  # LossScaleOptimizer
            "tf32": self.tf32,
        }

    def reset_peak_memory(self) -> None:
        if tf.config.list_physical_devices("GPU"):
            tf.config.experimental.reset_memory_stats("GPU:0")

    def memory(self) -> dict:
        """The GPU allocator's peak since the reset after warm-up; empty on CPU."""
        if not tf.config.list_physical_devices("GPU"):
            return {}
        return {"allocated_peak": tf.config.experimental.get_memory_info("GPU:0")["peak"]}

    def model_state_bytes(self) -> dict:
        """Counted from the variables: model and optimizer variables (moments, step counter, learning rate,
        loss scale). Gradients are not variables: the accumulation buffers when accumulating, else the
        transient gradients of one step, sized as the trainable variables they are gradients of."""
        trainable = self.model.trainable_variables
        return {
            "params": sum(nbytes(v) for v in self.model.variables),
            "grads": sum(nbytes(v) for v in (self.grad_buffers or trainable)),
            "optimizer": sum(nbytes(v) for v in self.optimizer.variables),
        }

    def final_weights(self) -> dict:
        return {name: np.asarray(v.numpy(), np.float32) for name, v in self.model.spec_variables().items()}

    def versions(self) -> dict:
        out = {"tensorflow": tf.__version__, "keras": keras.__version__}
        build = tf.sysconfig.get_build_info()
        if tf.config.list_physical_devices("GPU"):
            out.update({"cuda": build.get("cuda_version"), "cudnn": build.get("cudnn_version")})
        return out


def make_trainer(cfg):
    return MWMSTrainer(cfg)
