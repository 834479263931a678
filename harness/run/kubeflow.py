"""`harness k8s`: the Kubeflow job manifest that runs a distbench run on Kubernetes, one pod per node.

Each pod starts its node's harness with the multi-node options of `harness run` (see harness.run.nodes),
its node rank taken from what the Kubeflow operator sets: MASTER_ADDR/RANK (PyTorchJob), TF_CONFIG (TFJob),
hostfile (MPIJob) or replica index (PaddleJob). Records land in --out on a ReadWriteMany volume every pod
mounts; node 0's harness writes the run record there. What only Kubernetes has is here: the job kinds, the
pods and their volumes, the DNS rules for names; checking the job's command is harness.run.jobfile's,
shared with `harness slurm`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import uuid
from typing import Any

import yaml

from backends import all_backends, get_backend
from backends.base import network_settings
from harness.arguments import add_job_arguments
from harness.run.jobfile import checked_command, strip_separator, write_output
from harness.usage import EXIT_OK, UsageError

# The Kubeflow job kinds a backend's adapter may name (Backend.kubeflow_job), by how their pods learn their
# node rank: the training-operator (v1.9) serves PyTorchJob, TFJob and PaddleJob (kubeflow.org/v1); MPIJob
# v2beta1 is served by the standalone mpi-operator v2 (the training-operator's MPIJob is v1: no
# sshAuthMountPath).
KUBEFLOW_JOB_KINDS = ("PyTorchJob", "TFJob", "PaddleJob", "MPIJob")
KUBEFLOW_V1 = "kubeflow.org/v1"
MPI_API = "kubeflow.org/v2beta1"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
RESULTS_MOUNT = "/results"
# A container's /dev/shm is 64 MiB unless a volume replaces it; NCCL's shared-memory transport between the
# ranks of a pod (and DeepSpeed's and PyTorch's shared-memory buffers) need far more, and fail or fall back
# to slower paths without it. A memory-backed emptyDir is tmpfs, counted against the pod's memory.
SHM_VOLUME: dict[str, Any] = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
SHM_MOUNT = {"name": "dshm", "mountPath": "/dev/shm"}


def container(
    name: str,
    image: str,
    command: str,
    gpus: int,
    workdir: str,
    env: list | None = None,
    ports: list | None = None,
) -> dict:
    c: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": workdir,
        "command": ["bash", "-c", command],
        "volumeMounts": [{"name": "results", "mountPath": RESULTS_MOUNT}, dict(SHM_MOUNT)],
    }
    if gpus:
        c["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    if env:
        c["env"] = env
    if ports:
        c["ports"] = [dict(port) for port in ports]  # each pod template its own copy (no YAML anchors)
    return c


def replica(replicas: int, c: dict, pvc: str) -> dict:
    return {
        "replicas": replicas,
        "restartPolicy": "Never",
        "template": {
            "spec": {
                "containers": [c],
                "volumes": [
                    {"name": "results", "persistentVolumeClaim": {"claimName": pvc}},
                    {**SHM_VOLUME, "emptyDir": dict(SHM_VOLUME["emptyDir"])},
                ],
            }
        },
    }


# Kubeflow's operators accept a job name only as a DNS-1035 label, and the pods' host names
# (<job>-<role>-<index>) are DNS labels too: lowercase letters, digits and '-', starting with a letter,
# ending with a letter or digit, at most 63 characters.
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_LABEL_MAX = 63


def replica_hosts(kind: str, job: str, nodes: int) -> list[str]:
    """The host names of a job's pods as its operator names them (the longest decides whether they fit)."""
    if kind == "PyTorchJob":
        return [f"{job}-master-0", *(f"{job}-worker-{i}" for i in range(nodes - 1))]
    if kind == "MPIJob":
        return [f"{job}-launcher", *(f"{job}-worker-{i}" for i in range(nodes))]
    return [f"{job}-worker-{i}" for i in range(nodes)]


def check_job_name(name: str, kind: str, nodes: int) -> None:
    """Refuse, before writing anything, a name the operator or the pods' DNS would refuse later."""
    rule = "lowercase letters, digits and '-', starting with a letter and ending with a letter or digit"
    if not DNS_1035.fullmatch(name) or len(name) > DNS_LABEL_MAX:
        raise UsageError(
            f"job name '{name}' is not a DNS-1035 label: {rule}, at most {DNS_LABEL_MAX} characters"
        )
    longest = max(reversed(replica_hosts(kind, name, nodes)), key=len)  # of equals, a worker's
    if len(longest) > DNS_LABEL_MAX:
        raise UsageError(
            f"job name '{name}' is too long for its pods' host names: '{longest}' has {len(longest)} "
            f"characters (at most {DNS_LABEL_MAX}); use at most {DNS_LABEL_MAX - (len(longest) - len(name))}"
        )


def service_names(job: str, role: str, n: int) -> str:
    """The host names the training operator gives a job's pods (one headless service per replica)."""
    return ",".join(f"{job}-{role}-{i}" for i in range(n))


def manifest(
    backend: str,
    name: str,
    image: str,
    nodes: int,
    per_node: int,
    harness_args: list[str],
    pvc: str,
    namespace: str = "default",
    workdir: str = "/distbench",
    gpus: bool = True,
    network: dict[str, str] | None = None,
) -> dict:
    """The Kubeflow job that runs `harness run --backend BACKEND HARNESS_ARGS` on `nodes` pods of
    `per_node` ranks. Each pod's command finds its node rank in what the operator sets, removes the
    operator's rank variables (our launchers set their own), and runs the harness for its node. Every pod
    gets a memory-backed /dev/shm (SHM_VOLUME) and, in its environment, `network` (the NCCL/Gloo
    interface settings given where the manifest is written)."""
    kind = job_kind(backend)
    run = shlex.join(
        [
            "harness",
            "run",
            "--backend",
            backend,
            *harness_args,
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            str(per_node),
            "--run-id",
            name,
            "--out",
            RESULTS_MOUNT,
        ]
    )
    pod_gpus = per_node if gpus else 0
    meta = {
        "name": name,
        "namespace": namespace,
        "labels": {"app": "distbench", "distbench/backend": backend},
    }
    policy = {"backoffLimit": 0, "cleanPodPolicy": "None"}
    spec: dict[str, Any]  # the job's spec: its replicas, by the operator's names
    if kind == "PyTorchJob":  # RANK: 0 for the master pod, 1.. for the workers
        cmd = (
            f'NODE_RANK=$RANK; unset RANK WORLD_SIZE; exec {run} --node-rank "$NODE_RANK" '
            '--master "$MASTER_ADDR:$MASTER_PORT"'
        )
        ports = [{"name": "pytorchjob-port", "containerPort": 23456}]
        specs = {"Master": replica(1, container("pytorch", image, cmd, pod_gpus, workdir, ports=ports), pvc)}
        if nodes > 1:
            specs["Worker"] = replica(
                nodes - 1, container("pytorch", image, cmd, pod_gpus, workdir, ports=ports), pvc
            )
        spec = {"runPolicy": policy, "pytorchReplicaSpecs": specs}
    elif kind == "TFJob":  # TF_CONFIG's task index; our launcher writes every worker's own TF_CONFIG
        index = 'python3 -c \'import json, os; print(json.loads(os.environ["TF_CONFIG"])["task"]["index"])\''
        cmd = (
            f'NODE_RANK=$({index}); unset TF_CONFIG; exec {run} --node-rank "$NODE_RANK" '
            f"--hosts {service_names(name, 'worker', nodes)} --master {name}-worker-0:2222"
        )
        ports = [{"name": "tfjob-port", "containerPort": 2222}]
        spec = {
            "runPolicy": policy,
            "tfReplicaSpecs": {
                "Worker": replica(
                    nodes, container("tensorflow", image, cmd, pod_gpus, workdir, ports=ports), pvc
                )
            },
        }
    elif kind == "PaddleJob":  # the pod's replica index, through the downward API
        env = [
            {
                "name": "NODE_RANK",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{REPLICA_INDEX_LABEL}']"}},
            }
        ]
        cmd = (
            f'MASTER=$PADDLE_MASTER; unset PADDLE_MASTER PADDLE_NNODES; exec {run} --node-rank "$NODE_RANK" '
            f'--hosts {service_names(name, "worker", nodes)} --master "$MASTER"'
        )
        ports = [{"name": "master", "containerPort": 37777}]
        spec = {
            "runPolicy": policy,
            "paddleReplicaSpecs": {
                "Worker": replica(nodes, container("paddle", image, cmd, pod_gpus, workdir, env, ports), pvc)
            },
        }
    else:  # MPIJob: the launcher pod runs node 0's harness, whose horovodrun reaches the workers over ssh;
        # the pod has no GPU, so it names the workers' device and runs no rank (nor isolated worker) itself
        device = "cuda" if gpus else "cpu"
        cmd = (
            f"exec {run} --node-rank 0 --hostfile /etc/mpi/hostfile --launcher-only --device {device} "
            "--compute-method none"
        )
        spec = {
            "slotsPerWorker": per_node,
            "runPolicy": policy,
            "sshAuthMountPath": "/root/.ssh",
            "mpiReplicaSpecs": {
                "Launcher": replica(1, container("launcher", image, cmd, 0, workdir), pvc),
                "Worker": replica(
                    nodes, container("worker", image, "exec /usr/sbin/sshd -De", pod_gpus, workdir), pvc
                ),
            },
        }
    replicas = [r for key, rs in spec.items() if key.endswith("ReplicaSpecs") for r in rs.values()]
    for c in (c for r in replicas for c in r["template"]["spec"]["containers"]):
        if network:
            c["env"] = [*c.get("env", []), *({"name": k, "value": v} for k, v in network.items())]
    return {
        "apiVersion": MPI_API if kind == "MPIJob" else KUBEFLOW_V1,
        "kind": kind,
        "metadata": meta,
        "spec": spec,
    }


def job_kinds() -> dict[str, str]:
    """Backend -> the Kubeflow job kind its adapter names (Backend.kubeflow_job), for those that name one."""
    return {b.name: b.kubeflow_job for b in all_backends() if b.kubeflow_job in KUBEFLOW_JOB_KINDS}


def job_kind(backend: str) -> str:
    """The Kubeflow job kind of `backend`; a usage error where its adapter names none (or one this file
    cannot write)."""
    kind = get_backend(backend).kubeflow_job
    if kind not in KUBEFLOW_JOB_KINDS:
        raise UsageError(
            f"no Kubeflow job kind for backend '{backend}'"
            + (f" (its adapter names '{kind}', not one of {', '.join(KUBEFLOW_JOB_KINDS)})" if kind else "")
            + f"; backends with one: {', '.join(job_kinds())}"
        )
    return kind


def cmd_k8s(args) -> int:
    harness_args = strip_separator(args.harness_args)
    run_args = checked_command("run", harness_args, args.nodes, args.gpus_per_node)
    backend = run_args.backend
    kind = job_kind(backend)
    if kind == "MPIJob" and run_args.compute_method not in ("auto", "none"):
        raise UsageError(
            f"--compute-method {run_args.compute_method}: an MPIJob's launcher pod runs no rank, so no "
            "isolated counterfactual either; the job runs with --compute-method none (no exposed ratio)"
        )
    name = args.name or f"distbench-{backend}-{uuid.uuid4().hex[:6]}"
    check_job_name(name, kind, args.nodes)
    job = manifest(
        backend,
        name,
        args.image,
        args.nodes,
        args.gpus_per_node,
        without_backend(harness_args),
        args.pvc,
        args.namespace,
        args.workdir,
        gpus=run_args.device != "cpu",
        network=network_settings(),
    )
    write_output(
        args.output,
        f"# distbench run on {args.nodes} pod(s), written by `harness k8s`: kubectl apply -f <this file>\n"
        + yaml.safe_dump(job, sort_keys=False),
    )
    return EXIT_OK


def without_backend(harness_args: list[str]) -> list[str]:
    """The run options but --backend (the manifest puts it first)."""
    out, skip = [], False
    for a in harness_args:
        if skip:
            skip = False
        elif a == "--backend":
            skip = True
        elif not a.startswith("--backend="):
            out.append(a)
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "k8s",
        help="write a Kubeflow manifest for a run: training-operator (PaddleJob, PyTorchJob, TFJob) or "
        "mpi-operator v2 (MPIJob)",
    )
    add_job_arguments(p)  # a node is a pod
    p.add_argument("--image", required=True, help="an image holding the repo (at --workdir) and its venv")
    p.add_argument(
        "--pvc",
        default="distbench-results",
        help=f"ReadWriteMany claim mounted at {RESULTS_MOUNT} in every pod: the run dir and the record",
    )
    p.add_argument(
        "--name",
        help="job name, also the run id (default: distbench-<backend>-<random>): a DNS-1035 label "
        "whose pods' host names fit in 63 characters",
    )
    p.add_argument("--namespace", default="default")
    p.add_argument("--workdir", default="/distbench", help="the repo inside the image")
    p.add_argument("command", choices=("run",))
    p.add_argument("harness_args", nargs=argparse.REMAINDER, help="the options of `harness run`")
    p.set_defaults(func=cmd_k8s)
