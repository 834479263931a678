"""`harness slurm` and `harness k8s`: the job files that run a distbench run on a cluster's scheduler.

Both start one harness per node with the multi-node options of `harness run` (see harness.run.nodes), taken
from what the scheduler tells each node: Slurm's node list and SLURM_NODEID; the Kubeflow training
operator's MASTER_ADDR/RANK (PyTorchJob), TF_CONFIG (TFJob), hostfile (MPIJob) or replica index (PaddleJob).
Records land in --out on a filesystem every node shares (the submit directory on Slurm, a ReadWriteMany
volume on Kubernetes); node 0's harness writes the run record there.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import uuid
from pathlib import Path
from typing import Any

import yaml

from backends import all_backends, get_backend
from backends.base import network_settings
from core.process import REPO_ROOT
from harness.run import commands, sweep
from harness.run.nodes import LAYOUT_FLAGS, requested_world
from harness.run.options import build_config
from harness.usage import EXIT_OK, Parser, UsageError, positive

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


def command_parser() -> Parser:
    """The parsers of `harness run` and `harness sweep`, to check a job's command here."""
    parser = Parser(prog="harness")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    commands.register(sub)
    sweep.register(sub)
    return parser


def checked_command(command: str, harness_args: list[str], nodes: int, per_node: int):
    """Parse the harness command the job will run, with the layout the job adds, so bad input fails here
    and not on the cluster. Returns the parsed args."""
    given = [a.split("=", 1)[0] for a in harness_args]
    for flag in LAYOUT_FLAGS:
        if flag in given:
            raise UsageError(f"{flag} is set by the job from the scheduler's allocation: leave it out")
    if command == "sweep" and nodes > 1:
        raise UsageError(
            "a sweep runs within one node (--nodes 1): every run of a multi-node sweep would need "
            "its own agreed run id; submit one `harness slurm ... run` job per configuration instead"
        )
    layout = (
        [
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            str(per_node),
            "--node-rank",
            "0",
            "--master",
            "127.0.0.1:29500",
            "--hosts",  # the job gives every node's host (--hosts "$DISTBENCH_HOSTS" or the operator's)
            ",".join(f"node{i}" for i in range(nodes)),
            "--run-id",
            "check",
        ]
        if command == "run"
        else []
    )
    args = command_parser().parse_args([command, *harness_args, *layout])
    if command == "run":
        args.cfg = build_config(args, args.backend, requested_world(args), check_devices=False)
    elif max(args.gpus) > per_node:
        raise UsageError(f"the sweep's largest N ({max(args.gpus)}) exceeds --gpus-per-node {per_node}")
    return args


# Seconds a job needs beyond its runs' timeouts: starting the harness and the launchers, writing the
# record, and the early SIGTERM the script asks for (#SBATCH --signal=TERM@SIGTERM_LEAD_S).
SLURM_MARGIN_S = 120
SIGTERM_LEAD_S = 60
SLURM_TIME_FORMATS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def slurm_seconds(text: str) -> int:
    """A Slurm time limit (sbatch --time) in seconds."""
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    try:
        parts = [int(p) for p in rest.split(":")]
        day = int(days)
    except ValueError:
        raise UsageError(f"--time {text}: not a Slurm time limit; valid: {SLURM_TIME_FORMATS}") from None
    if "-" in text:  # D-HH[:MM[:SS]]
        if not 1 <= len(parts) <= 3:
            raise UsageError(f"--time {text}: not a Slurm time limit; valid: {SLURM_TIME_FORMATS}")
        h, m, s = (parts + [0, 0])[:3]
    elif len(parts) == 1:
        h, m, s = 0, parts[0], 0
    elif len(parts) == 2:
        h, m, s = 0, parts[0], parts[1]
    elif len(parts) == 3:
        h, m, s = parts
    else:
        raise UsageError(f"--time {text}: not a Slurm time limit; valid: {SLURM_TIME_FORMATS}")
    seconds = ((day * 24 + h) * 60 + m) * 60 + s
    if seconds <= 0 or min(parts) < 0 or day < 0:
        raise UsageError(f"--time {text}: must be a positive time limit ({SLURM_TIME_FORMATS})")
    return seconds


def clock_text(seconds: float) -> str:
    seconds = int(seconds + 0.999)
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def sweep_measures_isolated(args) -> bool:
    """Whether any run of the sweep launches the isolated counterfactual: some N > 1 and, for some swept
    backend, --compute-method isolated or auto resolving to it (torch-ddp's and Paddle's auto is no_sync)."""
    if max(args.gpus) < 2 or args.compute_method == "none":
        return False
    for name in sweep.selected_backends(args.backends):
        backend = get_backend(name)
        methods = backend.compute_methods_for(backend.Options.from_args(args))
        if (methods[0] if args.compute_method == "auto" else args.compute_method) == "isolated":
            return True
    return False


def fit_time_limit(args, run_args, harness_args: list[str]) -> list[str]:
    """Make the job's time limit and the run's --timeout agree, before anything is submitted: the run's
    launches (its own and the isolated counterfactual's, each up to --timeout) plus SLURM_MARGIN_S must fit
    in --time. A --timeout given explicitly that cannot fit is refused; the default one is lowered to fit
    (returned as the run's options). A sweep is checked for one run (it resumes with --resume)."""
    limit = slurm_seconds(args.time)
    given = any(a.split("=", 1)[0] == "--timeout" for a in harness_args)
    timeout = run_args.timeout
    if args.command == "run":
        cfg = run_args.cfg
        launches = 1 + (
            cfg.measurement.isolated_repeats
            if cfg.measurement.compute_method == "isolated" and cfg.topology.world_size > 1
            else 0
        )
    else:  # its runs at N > 1 add the isolated launches where a backend's method is (or resolves to) it
        launches = 1 + (run_args.isolated_repeats if sweep_measures_isolated(run_args) else 0)
    needed = launches * timeout + SLURM_MARGIN_S
    if needed <= limit:
        return harness_args
    what = f"{launches} launch(es) x --timeout {timeout:.0f} s + {SLURM_MARGIN_S} s"
    what += " to start and write the record"
    if given or args.command == "sweep":
        raise UsageError(
            f"--time {args.time} ({limit} s) cannot hold the run: {what} = {needed:.0f} s; give --time >= "
            f"{clock_text(needed)} or a smaller --timeout"
        )
    fitted = (limit - SLURM_MARGIN_S) / launches
    if fitted < 60:
        raise UsageError(
            f"--time {args.time} ({limit} s) leaves {fitted:.0f} s per launch after {SLURM_MARGIN_S} s of "
            f"margin ({launches} launch(es)); give --time >= {clock_text(launches * 60 + SLURM_MARGIN_S)}"
        )
    return [*harness_args, "--timeout", f"{fitted:.0f}"]


# ------------------------------------------------------------------------------------------------- Slurm
# The least of the CPUs the job holds on each of its nodes, at job time.
JOB_CPUS = (
    'export DISTBENCH_CPUS=$(tr , "\\n" <<<"$SLURM_JOB_CPUS_PER_NODE" | sed "s/(.*//" | sort -n | head -n 1)'
)


def network_exports(environ=None) -> list[str]:
    """The network-interface settings (backends.base.NETWORK_SETTINGS) set where the job file is written,
    as lines that export them in the job unless the job's own environment (sbatch passes the submitting
    shell's) already sets them."""
    settings = network_settings(os.environ if environ is None else environ)
    if not settings:
        return []
    return [
        "# The network interface NCCL and Gloo use, as set where this file was written",
        *(f"export {k}=${{{k}:-{shlex.quote(v)}}}" for k, v in settings.items()),
    ]


def sbatch_script(args, harness_args: list[str]) -> str:
    """One task per node; each runs the harness for its node (SLURM_NODEID) with the allocation's hosts, the
    first host as master on a port derived from the job id (two jobs sharing a node do not collide)."""
    harness = [*shlex.split(args.harness), args.command, *harness_args]
    head = [
        f"#SBATCH --job-name={args.job_name}",
        f"#SBATCH --nodes={args.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={args.time}",
        # SIGTERM a minute before the limit: the harness stops its ranks and writes the record (as it does on
        # the SIGTERM at the limit, with KillWait's grace before SIGKILL)
        f"#SBATCH --signal=TERM@{SIGTERM_LEAD_S}",
        "#SBATCH --output=distbench-%j.out",
    ]
    if args.gpus_per_node and not args.cpu:
        head.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    head += [
        f"#SBATCH --{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("partition", "account", "cpus_per_task")
        if getattr(args, k)
    ]
    if not args.cpus_per_task:  # whole nodes: every CPU of each node for its harness and its ranks
        head.append("#SBATCH --exclusive")
    lines = [
        "#!/bin/bash",
        f"# distbench {args.command} on {args.nodes} node(s), written by `harness slurm`. "
        "Submit with: sbatch <this file>",
        *head,
        "set -euo pipefail",
        f"cd {shlex.quote(str(args.workdir))}",
        *network_exports(),
        "# Each node's one task (its harness, which shares the CPUs out among its ranks) gets every CPU the",
        "# job holds on the node: srun gives a task one CPU unless told, and since Slurm 22.05 it no longer",
        "# inherits sbatch's --cpus-per-task. The least over the nodes (SLURM_JOB_CPUS_PER_NODE: 64(x2),32).",
        f"export DISTBENCH_CPUS={args.cpus_per_task}" if args.cpus_per_task else JOB_CPUS,
    ]
    if args.command == "sweep":
        lines += [
            "# A sweep runs its launches one after another on this node; resubmit with --resume added to",
            "# finish one that was cut short (runs recorded ok are not run again).",
            f'srun --nodes=1 --ntasks=1 --cpus-per-task="$DISTBENCH_CPUS" {shlex.join(harness)}',
        ]
        return "\n".join(lines) + "\n"
    node_cmd = (
        f"exec {shlex.join(harness)} --nodes {args.nodes} --gpus-per-node {args.gpus_per_node} "
        '--hosts "$DISTBENCH_HOSTS" --master "$DISTBENCH_MASTER" --node-rank "$SLURM_NODEID" '
        '--run-id "$DISTBENCH_RUN_ID"'
    )
    lines += [
        "# Every node gets the same layout and run id; node ranks follow the order of the node list.",
        'export DISTBENCH_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
        'export DISTBENCH_MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
        ":$((20000 + SLURM_JOB_ID % 20000))",
        'export DISTBENCH_RUN_ID="slurm-$SLURM_JOB_ID"',
        "# Node 0's harness writes the run record once every node's ranks have written theirs.",
        f'srun --nodes={args.nodes} --ntasks-per-node=1 --cpus-per-task="$DISTBENCH_CPUS" '
        f"--kill-on-bad-exit=0 bash -c {shlex.quote(node_cmd)}",
    ]
    return "\n".join(lines) + "\n"


def cmd_slurm(args) -> int:
    harness_args = strip_separator(args.harness_args)
    run_args = checked_command(args.command, harness_args, args.nodes, args.gpus_per_node)
    harness_args = fit_time_limit(args, run_args, harness_args)
    args.cpu = getattr(run_args, "device", "auto") == "cpu"
    write_output(args.output, sbatch_script(args, harness_args))
    return EXIT_OK


# --------------------------------------------------------------------------------------------- Kubernetes
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


# ------------------------------------------------------------------------------------------------ shared
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


def strip_separator(argv: list[str]) -> list[str]:
    return argv[1:] if argv[:1] == ["--"] else argv


def write_output(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
        return
    Path(path).write_text(text)
    print(f"wrote {path}", file=sys.stderr)


def register(subparsers) -> None:
    p = subparsers.add_parser("slurm", help="write an sbatch script for a run (one task per node) or a sweep")
    p.add_argument("--nodes", type=positive, default=1)
    p.add_argument("--gpus-per-node", type=positive, default=1, help="ranks per node (GPUs, or CPU workers)")
    p.add_argument(
        "--time",
        default="01:00:00",
        help="the job's time limit; it must hold the run's launches x --timeout plus 2 minutes (the "
        "default --timeout is lowered to fit; one given explicitly that does not fit is refused)",
    )
    p.add_argument("--job-name", default="distbench")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--cpus-per-task", type=positive, help="CPUs for each node's harness and its workers")
    p.add_argument(
        "--workdir", type=Path, default=REPO_ROOT, help="the repo on the cluster's shared filesystem"
    )
    p.add_argument(
        "--harness", default=".venv/bin/harness", help="the harness command there (from --workdir)"
    )
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    p.add_argument("command", choices=("run", "sweep"))
    p.add_argument(
        "harness_args", nargs=argparse.REMAINDER, help="the options of `harness run` or `harness sweep`"
    )
    p.set_defaults(func=cmd_slurm)

    p = subparsers.add_parser(
        "k8s",
        help="write a Kubeflow manifest for a run: training-operator (PaddleJob, PyTorchJob, TFJob) or "
        "mpi-operator v2 (MPIJob)",
    )
    p.add_argument("--nodes", type=positive, default=1, help="pods, one per node")
    p.add_argument("--gpus-per-node", type=positive, default=1, help="ranks per pod")
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
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    p.add_argument("command", choices=("run",))
    p.add_argument("harness_args", nargs=argparse.REMAINDER, help="the options of `harness run`")
    p.set_defaults(func=cmd_k8s)
