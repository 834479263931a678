"""tf-mwms adapter: tf.distribute.MultiWorkerMirroredStrategy, one process per worker.

TensorFlow has no launcher: the harness starts every worker itself, each with a TF_CONFIG naming all
workers of the job (every node's) and its own index, and with its rank in DISTBENCH_RANK.

What the framework is told, decided here from the RunConfig (framework-free, so it is checked without a
GPU) and recorded in the run's settings: the all-reduce implementation (`communication`) and what its
attention costs (`attention_memory`).
"""

import json
from dataclasses import dataclass

from backends.attention import materialised_attention
from backends.base import (
    CUDA_MASK,
    WORKER_SCRIPT,
    Backend,
    LaunchPlan,
    Options,
    Tuned,
    option,
    worker_python,
)
from backends.tf_mwms.schedule import mwms_schedule
from core.config import InvalidConfig
from core.precision import LOW_PRECISIONS, autocast_numerics
from core.process import Process, free_port

COLLECTIVES = ("auto", "ring", "nccl")
# MWMS's own waits (TFMultiWorkerMirrored.timeouts), the last two CollectiveAllReduceExtended's attributes
TF_COLLECTIVES = "CommunicationOptions(timeout_seconds)"
TF_CLUSTER_WAIT = "CollectiveAllReduceExtended._check_health_initial_timeout"
TF_PEER_CHECK = "CollectiveAllReduceExtended._check_health_timeout"
TF_PEER_CHECK_TRIES = 3  # CollectiveAllReduceExtended._check_health_retry_limit, TensorFlow's, unchanged
# The C++ collective TensorFlow runs for an all-reduce, by the implementation MWMS is given, on a GPU: TF's
# CollectiveParamResolverLocal::AssignCollectiveType picks NcclReduce only for the "nccl" communication
# hint (or ConfigProto's collective_nccl, which MWMS sets only for NCCL and only outside eager), and
# RingReduce otherwise. All-gathers are RingGather whatever the hint (TF has no NCCL all-gather kernel).
GPU_ALL_REDUCE = {"AUTO": "RingReduce", "RING": "RingReduce", "NCCL": "NcclReduce"}


def communication(cfg) -> str:
    """The tf.distribute.experimental.CommunicationImplementation (its name) this run hands MWMS.

    On a GPU `auto` means NCCL: TensorFlow's own AUTO is no automatic choice there, it is the ring
    all-reduce (GPU_ALL_REDUCE), which reaches the other workers through gRPC and host memory, while every
    other stack of the suite all-reduces with NCCL; a GPU comparison would then measure TF's fallback
    transport, not its strategy. On CPU `auto` stays TensorFlow's AUTO, which is the ring there (NCCL has
    no CPU kernel)."""
    requested = TFOptions.from_dict(cfg.backend_options).collective
    if requested == "auto":
        return "NCCL" if cfg.topology.device == "cuda" else "AUTO"
    return requested.upper()


def all_reduce_kernel(cfg) -> str:
    """The collective TensorFlow's runtime resolves this run's all-reduce to (see GPU_ALL_REDUCE)."""
    return GPU_ALL_REDUCE[communication(cfg)] if cfg.topology.device == "cuda" else "RingReduce"


def communication_settings(cfg) -> dict:
    """The record's account of the collectives: asked for, handed to MWMS, and what TF's runtime runs."""
    requested, device = TFOptions.from_dict(cfg.backend_options).collective, cfg.topology.device
    implementation, kernel = communication(cfg), all_reduce_kernel(cfg)
    overridden = requested == "auto" and implementation != "AUTO"
    return {
        "requested": requested,
        "implementation": implementation,
        "all_reduce": kernel,
        "all_gather": "RingGather",
        "summary": (
            f"communication: {implementation} (--collective {requested} on {device}): all-reduce "
            f"{kernel}, all-gather RingGather"
            + ("; TF's own AUTO would all-reduce with RingReduce" if overridden else "")
        ),
    }


def variant(cfg) -> str:
    """The label's suffix: the implementation that runs, unless it is CPU's default (AUTO, the ring), so a
    GPU run asked for `auto` is labelled as the NCCL run it is."""
    implementation = communication(cfg)
    return "" if implementation == "AUTO" else f"-{implementation.lower()}"


def attention_memory(cfg) -> dict:
    """What the model's attention materialises (backends.attention), analytic.

    workloads/tf_model.py calls keras.ops.dot_product_attention, whose TensorFlow backend (Keras 3.15,
    keras/src/backend/tensorflow/nn.py) has no flash path: flash_attention=True raises, and it computes
    the (B, H, T, T) logits with einsum, in float32 at every precision (result_type(q.dtype, "float32")),
    then mask and softmax in float32. XLA does not rescue it under --xla: XLA's cuDNN fused-attention
    rewriter was removed (openxla/xla#22225), so it compiles the same materialised tensors. The torch and
    Paddle models call scaled_dot_product_attention, which on a GPU can run a flash kernel that never holds
    them, so at long sequences this memory is TF's, not the model's.
    Softmax's gradient reads the softmax output (tensorflow/python/ops/nn_grad.py), so every layer's is
    held from forward to backward."""
    return materialised_attention(cfg, "no flash attention in Keras's TF backend")


def local_ports(first: int, n: int) -> list[int]:
    """`first` (the harness's free port) and n - 1 more distinct free ports on this machine."""
    ports = [first]
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def worker_addresses(cfg, port: int) -> list[str]:
    """host:port of every worker of the job, in task-index order (empty for a 1-worker job, which needs
    no cluster). One node: free localhost ports. Several: the worker of global index k listens on
    port + k on its node's host, so every node's harness computes the same list from the agreed master
    port without talking to the others, and the addresses stay distinct even when nodes share a machine."""
    if cfg.process_group_size == 1:
        return []
    if cfg.topology.nodes == 1:
        return [f"localhost:{p}" for p in local_ports(port, cfg.topology.world_size)]
    return [
        f"{host}:{port + n * cfg.topology.gpus_per_node + i}"
        for n, host in enumerate(cfg.topology.hosts)
        for i in range(cfg.topology.gpus_per_node)
    ]


@dataclass(frozen=True)
class TFOptions(Options):
    collective: str = option(
        "auto",
        "--collective",
        choices=COLLECTIVES,
        help="the all-reduce implementation (CommunicationImplementation)",
    )
    xla: bool = option(False, "--xla", help="compile forward + backward with XLA (jit_compile)")

    def optimizer_kernel(self) -> str:
        """Keras' AdamW runs in a tf.function without jit_compile (--xla compiles the gradients only): its
        update_step and decoupled weight decay are separate elementwise ops over each variable, at least as
        many passes over memory as torch's foreach AdamW, which prices it."""
        return "foreach"


class TFMultiWorkerMirrored(Backend[TFOptions]):
    name = "tf-mwms"
    framework = "tensorflow"
    launcher = "TF_CONFIG per worker process"
    extra = "tf"
    collective_api = "tf.distribute replica context (MWMS)"
    compute_methods = ("isolated",)  # MWMS has no switch that turns the gradient all-reduce off
    times_optimizer = True  # a worker with no peer runs the update as a call of its own (anatomy steps)
    kubeflow_job = "TFJob"
    # TensorFlow's error classes (gRPC's DeadlineExceeded and Unavailable) and its collective executor's
    # abort, as its messages name them
    peer_timeout_texts = ("deadline exceeded", "deadlineexceeded")
    peer_lost_texts = ("unavailableerror", "collective ops is aborted")
    Options = TFOptions

    def validate(self, cfg):
        if cfg.topology.nodes > 1 and len(cfg.topology.hosts) != cfg.topology.nodes:
            raise InvalidConfig(
                f"tf-mwms on {cfg.topology.nodes} nodes needs the host of every node (--hosts or --hostfile; "
                f"got {','.join(cfg.topology.hosts) or 'none'}): each worker's TF_CONFIG lists all workers"
            )
        if cfg.topology.device != "cuda" and self.options(cfg).collective == "nccl":
            raise InvalidConfig(
                f"tf-mwms --collective nccl needs --device cuda (NCCL all-reduces GPU memory; on "
                f"{cfg.topology.device} TensorFlow would quietly run its ring instead); "
                "use --collective auto or ring"
            )

    def tuned(self, cfg):
        """XLA on the forward and backward (jit_compile), the compiled step TensorFlow's own benchmarks
        run (tensorflow/models official/core RuntimeConfig.enable_xla; tensorflow.org/xla). Only the
        per-replica gradients are compiled here, so the cross-worker all-reduce stays outside XLA, where
        MWMS's collectives have kernels (XLA has no CollectiveReduceV2 or NCCL all-reduce kernel:
        tensorflow/tensorflow#48502, #58961). The collective needs no setting: `auto` already runs NCCL
        on a GPU (communication()). Mixed precision is --precision, the same for every stack."""
        return {
            "xla": Tuned(
                True,
                "tensorflow.org/xla (tf.function jit_compile); tensorflow/models official/core "
                "config_definitions.py RuntimeConfig.enable_xla",
                numerics=True,
            )
        }

    def stack_label(self, cfg):
        return self.name + variant(cfg) + ("-xla" if self.options(cfg).xla else "")

    def settings(self, cfg):
        """What MWMS is handed and what it resolves it to (communication), and what the attention costs in
        memory (attention_memory; analytic): the two ways TF differs from the other stacks on a GPU."""
        return {"communication": communication_settings(cfg), "attention": attention_memory(cfg)}

    def timeouts(self, cfg):
        """MWMS's collectives (CommunicationOptions.timeout_seconds; none by default), and its health check
        of the cluster (CollectiveAllReduceExtended): the first check, a ring all-reduce that waits for every
        worker (for ever by default), and each later ping of a peer, which declares the peer down, and aborts
        every collective, after 3 unanswered tries of 10 s each by default: a peer starved of CPU on a busy
        node would end the run within 30 s. Each try waits a third of the run's collective timeout, so a peer
        is given up after the run's timeout, as a collective is."""
        t = cfg.collective_timeout
        return {TF_COLLECTIVES: t, TF_CLUSTER_WAIT: t, TF_PEER_CHECK: t / TF_PEER_CHECK_TRIES}

    def numerics(self, cfg):
        """Keras's mixed policy (mixed_bfloat16 / mixed_float16): fp32 variables, cast inside each layer
        as autocast casts them, but every layer's output is in the low precision, so the residual stream
        between blocks is too; the gradients of the fp32 variables are fp32 and all-reduced as they are."""
        if cfg.model.precision not in LOW_PRECISIONS:
            return autocast_numerics(cfg)
        policy = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}[cfg.model.precision]
        return autocast_numerics(
            cfg,
            f"Keras {policy} policy: fp32 variables, layer outputs in {cfg.model.precision}",
            activations=cfg.model.precision,
        )

    def schedule(self, cfg):
        """Gradients of the fp32 variables (also under a mixed policy), accumulated in local buffers and
        all-reduced once per step by apply_gradients: schedule.py."""
        return mwms_schedule(cfg)

    def commbench_label(self, cfg):
        return self.name + variant(cfg)

    def collective_ops(self, cfg):
        """The replica context's all_reduce and all_gather: TensorFlow's distribute API offers a training
        loop no reduce-scatter, broadcast or all-to-all."""
        return ("all_reduce", "all_gather")

    def launch(self, cfg, run_dir, port, devices):
        """One process per worker, each shown only its own GPU (devices[i]), so MWMS has exactly one
        local replica; an isolated worker is rank 0 of a job of its own."""
        workers = worker_addresses(cfg, port)
        first = 0 if cfg.role.isolated_index is not None else cfg.first_local_rank
        processes = []
        for i in range(cfg.local_procs):
            index = first + i
            tf_config = (
                {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
                if workers
                else {}
            )
            env = {
                **self.worker_env(cfg),
                "TF_CONFIG": json.dumps(tf_config),
                "DISTBENCH_RANK": str(index),
                CUDA_MASK: devices[i] if devices else "",
            }
            processes.append(Process([worker_python(cfg), str(WORKER_SCRIPT), str(run_dir)], env))
        return LaunchPlan(processes)
