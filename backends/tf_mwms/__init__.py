"""tf-mwms adapter: tf.distribute.MultiWorkerMirroredStrategy, one process per worker.

TensorFlow has no launcher: the harness starts every worker itself, each with a TF_CONFIG naming all
workers of the job (every node's) and its own index, and with its rank in DISTBENCH_RANK.
"""
import json
import os
import sys

from backends.base import WORKER_SCRIPT, Backend, CommPattern, Process, free_port

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
    if cfg.world_size == 1:
        return []
    if cfg.nodes == 1:
        return [f"localhost:{p}" for p in local_ports(port, cfg.gpus)]
    if len(cfg.hosts) != cfg.nodes:
        raise ValueError(f"tf-mwms on {cfg.nodes} nodes needs the host of every node (got {cfg.hosts or 'none'}): "
                         "each worker's TF_CONFIG lists all workers")
    return [f"{host}:{port + n * cfg.procs_per_node + i}" for n, host in enumerate(cfg.hosts)
            for i in range(cfg.procs_per_node)]


class TFMultiWorkerMirrored(Backend):
    name = "tf-mwms"
    framework = "tensorflow"
    launcher = "TF_CONFIG per worker process"
    requires = ("tensorflow",)
    worker_module = "backends.tf_mwms.worker"
    compute_methods = ("isolated",)  # MWMS has no switch that turns the gradient all-reduce off

    def add_arguments(self, parser):
        group = parser.add_argument_group("tf-mwms")
        group.add_argument("--collective", choices=COLLECTIVES,
                           help="tf-mwms all-reduce implementation (CommunicationImplementation; default auto)")
        group.add_argument("--xla", action="store_true", default=None,
                           help="tf-mwms: compile forward + backward with XLA (jit_compile)")

    def options(self, args):
        return {"collective": args.collective or "auto", "xla": bool(args.xla)}

    def label(self, cfg):
        opts = cfg.backend_options
        collective = opts.get("collective", "auto")
        return self.name + ("" if collective == "auto" else f"-{collective}") + ("-xla" if opts.get("xla") else "")

    def comm_pattern(self, cfg):
        return CommPattern("allreduce", 4)  # gradients of the fp32 variables, also under a mixed policy

    def launch(self, cfg, run_dir, port):
        workers = worker_addresses(cfg, port)
        if cfg.isolated_index is not None:  # one worker alone, on the device of the rank it stands for
            first, local_devices = 0, [cfg.isolated_index % (cfg.gpus // cfg.nodes)]
        else:
            first, local_devices = cfg.node_rank * cfg.procs_per_node, range(cfg.procs_per_node)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        device_ids = visible.split(",") if visible else [str(d) for d in range(max(local_devices) + 1)]
        processes = []
        for i, device in enumerate(local_devices):
            index = first + i
            tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}} if workers else {}
            env = {**self.worker_env(cfg), "TF_CONFIG": json.dumps(tf_config), "DISTBENCH_RANK": str(index),
                   # one device per worker process, so MWMS has exactly one local replica
                   "CUDA_VISIBLE_DEVICES": device_ids[device] if cfg.device == "cuda" else ""}
            processes.append(Process([sys.executable, str(WORKER_SCRIPT), str(run_dir)], env))
        return processes
