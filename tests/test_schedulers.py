"""`harness slurm` and `harness k8s`: the sbatch script is valid bash and, run under stand-ins for srun and
scontrol that start one task per "node" on this machine, produces one record from two nodes; every Kubeflow
manifest has the fields its kind requires and a pod command that is valid bash."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, harness
from processes import leftovers

import backends
from backends import all_backends, get_backend
from backends.torch_ddp import TorchDDP
from core.records import run_config
from harness.cli import main
from harness.run.kubeflow import job_kinds, manifest

RUN = (
    "--backend torch-ddp --steps 3 --warmup 1 --compute-method none "
    "--threads-per-worker 1 --device cpu --timeout 150"
).split()

# Stand-ins with Slurm's semantics: scontrol expands the node list (one name per line); srun starts one task
# per node at once, each with its SLURM_NODEID, and waits for all.
SCONTROL = "#!/bin/bash\nprintf '127.0.0.1\\nlocalhost\\n'\n"
SRUN = """#!/bin/bash
nodes=1
while [[ $1 == --* ]]; do [[ $1 == --nodes=* ]] && nodes=${1#--nodes=}; shift; done
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i "$@" & done
wait
"""


def bash_syntax_ok(script: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_sbatch_script_runs_one_harness_per_node_and_node_0_writes_the_record(tmp_path):
    out = tmp_path / "results"
    proc = harness(
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--partition",
        "cpu",
        "--workdir",
        REPO,
        "--harness",
        f"{sys.executable} -m harness",
        "run",
        *RUN,
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    bash_syntax_ok(script)
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=cpu",
        'scontrol show hostnames "$SLURM_JOB_NODELIST"',
        "srun --nodes=2 --ntasks-per-node=1",
        '--node-rank "$SLURM_NODEID"',
    ):
        assert line in script
    assert "--gpus-per-node=" not in script  # a CPU run asks Slurm for no GPUs

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    (tmp_path / "job.sbatch").write_text(script)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_CPUS_PER_NODE": "1(x2)",  # as sbatch sets it: each node's harness gets that one CPU
    }
    job = subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=300
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    record = json.loads((out / "slurm-4242.json").read_text())
    assert record["status"] == "ok" and run_config(record).topology.nodes == 2
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    assert run_config(record).topology.hosts == ["127.0.0.1", "localhost"]
    assert len(list(out.glob("*.json"))) == 1
    assert not leftovers(out, wait_s=5)


def test_sbatch_script_for_a_sweep_on_one_node():
    proc = harness(
        "slurm",
        "--gpus-per-node",
        "8",
        "--time",
        "04:00:00",
        "sweep",
        "--gpus",
        "1,2,4,8",
        "--repeats",
        "3",
        "--device",
        "cuda",
    )
    assert proc.returncode == 0, proc.stderr
    bash_syntax_ok(proc.stdout)
    assert "#SBATCH --gpus-per-node=8" in proc.stdout and "#SBATCH --time=04:00:00" in proc.stdout
    assert (
        'srun --nodes=1 --ntasks=1 --cpus-per-task="$DISTBENCH_CPUS" .venv/bin/harness sweep --gpus 1,2,4,8 '
        "--repeats 3" in proc.stdout
    )


class NoKubeflowJob(TorchDDP):
    """A registered stack whose adapter names no Kubeflow job kind."""

    name = "no-kubeflow-x"
    kubeflow_job = ""


@pytest.mark.unit
def test_the_job_kind_is_the_adapter_s_and_one_it_lacks_is_one_usage_line(monkeypatch, capsys):
    assert job_kinds() == {b.name: b.kubeflow_job for b in all_backends()}  # every shipped stack names one
    monkeypatch.setitem(backends.ADAPTERS, NoKubeflowJob.name, "test_schedulers:NoKubeflowJob")
    assert NoKubeflowJob.name not in job_kinds()
    code = main(["k8s", "--image", "img", "run", "--backend", NoKubeflowJob.name, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"no Kubeflow job kind for backend '{NoKubeflowJob.name}'; backends with one: torch-ddp" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["slurm", "--nodes", "2", "sweep", "--gpus", "1,2"], "a sweep runs within one node"),
        (
            ["slurm", "--nodes", "2", "run", "--backend", "torch-ddp", "--node-rank", "1"],
            "--node-rank is set by the job",
        ),
        (["slurm", "--gpus-per-node", "4", "sweep", "--gpus", "1,8"], "exceeds --gpus-per-node 4"),
        (["slurm", "run", "--backend", "nope"], "unknown backend 'nope'"),
        (
            ["k8s", "--image", "img", "run", "--backend", "torch-ddp", "--master", "a:1"],
            "--master is set by the job",
        ),
        (["k8s", "run", "--backend", "torch-ddp"], "--image"),
    ],
)
@pytest.mark.unit
def test_bad_scheduler_input_is_one_line_and_exit_2(argv, message, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


# The fields each training-operator kind requires, and the container name its operator looks for.
REPLICAS = {
    "PyTorchJob": ("pytorchReplicaSpecs", {"Master": 1, "Worker": 2}, "pytorch"),
    "TFJob": ("tfReplicaSpecs", {"Worker": 3}, "tensorflow"),
    "PaddleJob": ("paddleReplicaSpecs", {"Worker": 3}, "paddle"),
    "MPIJob": ("mpiReplicaSpecs", {"Launcher": 1, "Worker": 3}, None),
}
NODE_RANK_SOURCE = {
    "PyTorchJob": "NODE_RANK=$RANK",
    "TFJob": "TF_CONFIG",
    "PaddleJob": '"$NODE_RANK"',
    "MPIJob": "--hostfile /etc/mpi/hostfile",
}


@pytest.mark.parametrize("backend", list(job_kinds()))
def test_kubeflow_manifest_has_the_required_fields_of_its_kind(backend):
    kind = job_kinds()[backend]
    job = yaml.safe_load(
        yaml.safe_dump(
            manifest(backend, "bench-1", "reg/distbench:1", 3, 8, ["--workload", "small"], "shared-results")
        )
    )
    assert job["apiVersion"] == ("kubeflow.org/v2beta1" if kind == "MPIJob" else "kubeflow.org/v1")
    assert job["kind"] == kind and job["metadata"]["name"] == "bench-1"
    key, replicas, container_name = REPLICAS[kind]
    specs = job["spec"][key]
    assert {t: s["replicas"] for t, s in specs.items()} == replicas
    commands = []
    for rtype, spec in specs.items():
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        assert c["image"] == "reg/distbench:1" and c["command"][:2] == ["bash", "-c"]
        if container_name:
            assert c["name"] == container_name
        assert {"name": "results", "persistentVolumeClaim": {"claimName": "shared-results"}} in pod["volumes"]
        assert c["volumeMounts"] == [
            {"name": "results", "mountPath": "/results"},
            {"name": "dshm", "mountPath": "/dev/shm"},  # memory-backed: tests/test_cluster_settings.py
        ]
        if rtype != "Launcher":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        bash_syntax_ok(c["command"][2])
        commands.append(c["command"][2])
    run = next(cmd for cmd in commands if "harness run" in cmd)
    for part in (
        f"--backend {backend}",
        "--workload small",
        "--nodes 3",
        "--gpus-per-node 8",
        "--run-id bench-1",
        "--out /results",
        NODE_RANK_SOURCE[kind],
    ):
        assert part in run
    if kind == "MPIJob":
        assert job["spec"]["slotsPerWorker"] == 8 and "sshd" in commands[1]
    if kind == "PaddleJob":
        env = specs["Worker"]["template"]["spec"]["containers"][0]["env"]
        assert (
            env[0]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['training.kubeflow.org/replica-index']"
        )


def test_k8s_command_writes_the_manifest_for_a_registered_backend(tmp_path):
    proc = harness(
        "k8s",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--image",
        "img:1",
        "--name",
        "ddp-2x4",
        "-o",
        tmp_path / "job.yaml",
        "run",
        "--backend",
        "torch-ddp",
        "--workload",
        "small",
        "--device",
        "cuda",
    )
    assert proc.returncode == 0, proc.stderr
    job = yaml.safe_load((tmp_path / "job.yaml").read_text())
    assert job["kind"] == "PyTorchJob" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,backend,nodes,expected",
    [
        ("My_Run.1", "torch-ddp", 2, "not a DNS-1035 label"),
        ("9lives", "torch-ddp", 2, "not a DNS-1035 label"),
        ("a" * 70, "torch-ddp", 2, "not a DNS-1035 label"),
        ("trailing-", "paddle-fleet", 2, "not a DNS-1035 label"),
        # 55 + len("-worker-0") = 64 characters: the worker pods' host names would not fit
        (
            "h" * 55,
            "horovod",
            2,
            "'" + "h" * 55 + "-worker-1' has 64 characters (at most 63); use at most 54",
        ),
        ("p" * 55, "torch-ddp", 2, "-worker-0' has 64 characters"),
    ],
)
def test_job_names_the_operators_would_refuse_are_refused_with_the_rule(
    name, backend, nodes, expected, capsys
):
    code = main(
        [
            "k8s",
            "--nodes",
            str(nodes),
            "--image",
            "img:1",
            "--name",
            name,
            "-o",
            "-",
            "run",
            "--backend",
            backend,
        ]
        + ["--device", "cpu"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err


@pytest.mark.unit
def test_the_longest_job_name_whose_pods_fit_is_accepted(capsys):
    assert (
        main(
            ["k8s", "--nodes", "2", "--image", "img:1", "--name", "h" * 54, "-o", "-", "run"]
            + ["--backend", "horovod", "--device", "cpu"]
        )
        == 0
    )
    assert f"name: {'h' * 54}" in capsys.readouterr().out


# The real CRD schemas (openAPIV3Schema of the served version, unedited; sources in
# tests/data/crds/SOURCES.md): the training-operator v1.9.0's PyTorchJob, TFJob and PaddleJob
# (kubeflow.org/v1) and mpi-operator v0.6.0's MPIJob (kubeflow.org/v2beta1).
CRDS = REPO / "tests" / "data" / "crds"
CRD_FILES = {
    "PyTorchJob": "pytorchjob-v1.json",
    "TFJob": "tfjob-v1.json",
    "PaddleJob": "paddlejob-v1.json",
    "MPIJob": "mpijob-v2beta1.json",
}


@pytest.mark.unit
@pytest.mark.parametrize("gpus", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("backend", list(job_kinds()))
def test_every_manifest_validates_against_its_operator_s_real_crd_schema(backend, nodes, gpus):
    """What the API server checks on `kubectl apply`: the manifest, as written (YAML), against the CRD's
    structural schema; unknown fields fail too, as the server prunes or rejects them."""
    import jsonschema

    kind = job_kinds()[backend]
    schema = json.loads((CRDS / CRD_FILES[kind]).read_text())
    job = yaml.safe_load(
        yaml.safe_dump(
            manifest(
                backend, "bench-1", "reg/distbench:1", nodes, 4, ["--workload", "tiny"], "results", gpus=gpus
            )
        )
    )
    validator = jsonschema.Draft7Validator(closed(schema))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(job)]
    assert not errors, errors


def closed(schema):
    """The schema with every object that lists its properties closed to others (structural schemas are
    pruned by the API server: an unknown field would silently vanish), unless it preserves unknown fields."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if "properties" in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, seconds",
    [("5", 300), ("2:30", 150), ("01:00:00", 3600), ("1-0", 86400), ("1-2:30", 95400), ("0-0:0:45", 45)],
)
def test_slurm_time_limits_are_read_as_sbatch_reads_them(text, seconds):
    from harness.run.slurm import slurm_seconds

    assert slurm_seconds(text) == seconds


@pytest.mark.unit
@pytest.mark.parametrize(
    "time_limit, run, message",
    [
        (
            "00:10:00",
            ["--timeout", "900"],
            "--time 00:10:00 (600 s) cannot hold the run: 1 launch(es) x "
            "--timeout 900 s + 120 s to start and write the record = 1020 s; give --time >= 00:17:00",
        ),
        ("00:01:00", [], "leaves -60 s per launch after 120 s of margin"),
        ("soon", [], "not a Slurm time limit; valid: MM, MM:SS, HH:MM:SS"),
    ],
)
def test_a_time_limit_that_cannot_hold_the_run_is_refused(time_limit, run, message, capsys):
    """Slurm ends a job at its limit (SIGTERM, then SIGKILL): a run whose --timeout is longer would end
    without its own timeout ever firing. Refused before anything is written or submitted."""
    argv = ["slurm", "--time", time_limit, "run", "--backend", "torch-ddp", "--device", "cpu", *run]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.unit
def test_a_sweep_without_isolated_launches_needs_time_for_one_launch_a_run(capsys):
    """Each run is one launch unless a swept backend traces in a launch of its own or measures t_compute
    by the isolated counterfactual:
    600 s + 120 s of margin fits 12 minutes for torch-ddp (its auto method is no_sync) or with
    --compute-method none; tf-mwms's auto method is isolated, two more launches a run (32 minutes)."""
    sweep = ["sweep", "--gpus", "1,2", "--device", "cpu", "--timeout", "600"]
    slurm = ["slurm", "--gpus-per-node", "2", "--time", "00:12:00"]
    assert main([*slurm, *sweep, "--backends", "torch-ddp"]) == 0
    assert main([*slurm, *sweep, "--backends", "tf-mwms", "--compute-method", "none"]) == 0
    capsys.readouterr()
    assert main([*slurm, *sweep, "--backends", "torch-ddp,tf-mwms"]) == 2
    assert "3 launch(es) x --timeout 600 s" in capsys.readouterr().err
    # horovod traces in a launch of its own: one more a run, unless tracing is off
    assert main([*slurm, *sweep, "--backends", "horovod", "--compute-method", "none"]) == 2
    assert "2 launch(es) x --timeout 600 s" in capsys.readouterr().err
    assert main([*slurm, *sweep, "--backends", "horovod", "--compute-method", "none", "--no-trace-comm"]) == 0


@pytest.mark.unit
@pytest.mark.subprocess  # bash -n
def test_the_default_timeout_is_lowered_to_fit_the_time_limit_and_sigterm_comes_early(capsys):
    """horovod on 2 nodes: the run, its traced launch (horovod traces apart) and two isolated launches;
    20 minutes less 2 of margin = 270 s each."""
    argv = ["slurm", "--nodes", "2", "--time", "00:20:00", "run", "--backend", "horovod", "--device", "cpu"]
    assert main(argv) == 0
    script = capsys.readouterr().out
    assert "--timeout 270 " in script and "#SBATCH --signal=TERM@60" in script
    bash_syntax_ok(script)


@pytest.mark.unit
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_mpijob_launcher_pod_runs_the_workers_gpu_run_without_a_gpu_of_its_own(
    nodes, tmp_path, monkeypatch
):
    """The launcher pod has no GPU: its `harness run` names the workers' device (--device cuda) and runs
    no rank itself (--launcher-only), so it is accepted on a machine without GPUs, and horovodrun starts
    every rank on the hostfile's workers, even on one node. Before, it ran with --device auto (cpu there)."""
    from harness.run.jobfile import command_parser
    from harness.run.options import build_config
    from harness.run.runner import node_plan

    monkeypatch.setattr("harness.run.devices.visible_gpus", lambda: [])  # the launcher pod
    job = manifest("horovod", "hvd-1", "img:1", nodes, 4, ["--workload", "tiny"], "results", gpus=True)
    command = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]["command"][2]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"hvd-1-worker-{i} slots=4\n" for i in range(nodes)))
    argv = shlex.split(command.removeprefix("exec ").replace("/etc/mpi/hostfile", str(hostfile)))
    assert argv[:2] == ["harness", "run"] and "--launcher-only" in argv
    args = command_parser().parse_args(argv[1:])
    cfg = build_config(args, args.backend, nodes * 4)
    assert (
        cfg.topology.device == "cuda"
        and cfg.topology.launcher_only
        and cfg.measurement.compute_method == "none"
    )
    (proc,) = node_plan(get_backend("horovod"), cfg, tmp_path, 29500).processes
    hosts = proc.argv[proc.argv.index("-H") + 1]
    assert hosts == ",".join(f"hvd-1-worker-{i}:4" for i in range(nodes)) and "localhost" not in hosts


@pytest.mark.unit
def test_launcher_only_is_refused_where_it_cannot_hold(capsys):
    base = ["run", "--hosts", "a,b", "--node-rank", "0", "--launcher-only"]
    assert main([*base, "--backend", "torch-ddp", "--device", "cuda", "--compute-method", "none"]) == 2
    assert (
        "torch-ddp's launcher does not start the other hosts' ranks; valid: horovod"
        in capsys.readouterr().err
    )
    assert main([*base, "--backend", "horovod", "--compute-method", "none"]) == 2
    assert "--launcher-only needs --device cuda or cpu" in capsys.readouterr().err
    assert main([*base, "--backend", "horovod", "--device", "cuda"]) == 2
    assert "add --compute-method none" in capsys.readouterr().err
