"""tf-mwms adapter: tf.distribute.MultiWorkerMirroredStrategy, one process per worker.

TensorFlow has no launcher: the harness starts every worker itself, each with a TF_CONFIG naming all
workers of the job (every node's) and its own index, and with its rank in DISTBENCH_RANK.
"""

import json
import sys
from dataclasses import dataclass

from backends.base import CUDA_MASK, WORKER_SCRIPT, Backend, LaunchPlan, Options, gradient_allreduce, option
from core.config import InvalidConfig
from core.process import Process, free_port

COLLECTIVES = ("auto", "ring", "nccl")


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
    if cfg.nodes == 1:
        return [f"localhost:{p}" for p in local_ports(port, cfg.world_size)]
    return [
        f"{host}:{port + n * cfg.gpus_per_node + i}"
        for n, host in enumerate(cfg.hosts)
        for i in range(cfg.gpus_per_node)
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


class TFMultiWorkerMirrored(Backend):
    name = "tf-mwms"
    framework = "tensorflow"
    launcher = "TF_CONFIG per worker process"
    collective_api = "tf.distribute replica context (MWMS)"
    compute_methods = ("isolated",)  # MWMS has no switch that turns the gradient all-reduce off
    times_optimizer = False  # the gradient all-reduce and the update are one traced function
    Options = TFOptions

    def validate(self, cfg):
        if cfg.nodes > 1 and len(cfg.hosts) != cfg.nodes:
            raise InvalidConfig(
                f"tf-mwms on {cfg.nodes} nodes needs the host of every node (--hosts or --hostfile; "
                f"got {','.join(cfg.hosts) or 'none'}): each worker's TF_CONFIG lists all workers"
            )

    def label(self, cfg):
        opts = self.options(cfg)
        return (
            self.name
            + ("" if opts.collective == "auto" else f"-{opts.collective}")
            + ("-xla" if opts.xla else "")
        )

    def comm_pattern(self, cfg):
        """Gradients of the fp32 variables (also under a mixed policy), accumulated in local buffers and
        all-reduced once per step by apply_gradients."""
        return gradient_allreduce(cfg, 4)

    def commbench_label(self, cfg):
        collective = self.options(cfg).collective
        return self.name + ("" if collective == "auto" else f"-{collective}")

    def collective_ops(self, cfg):
        """The replica context's all_reduce and all_gather: TensorFlow's distribute API offers a training
        loop no reduce-scatter, broadcast or all-to-all."""
        return ("all_reduce", "all_gather")

    def launch(self, cfg, run_dir, port, devices):
        """One process per worker, each shown only its own GPU (devices[i]), so MWMS has exactly one
        local replica; an isolated worker is rank 0 of a job of its own."""
        workers = worker_addresses(cfg, port)
        first = 0 if cfg.isolated_index is not None else cfg.first_local_rank
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
            processes.append(Process([sys.executable, str(WORKER_SCRIPT), str(run_dir)], env))
        return LaunchPlan(processes)
