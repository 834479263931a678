"""Cluster settings for GPUs, tested as data on a machine without one: Horovod's GPU build environment
(backends/horovod_torch/build_env.py, used by scripts/install_horovod.sh), the /dev/shm volume of every
Kubernetes pod, Slurm's CPUs per task, the NCCL/Gloo network-interface settings that every launcher passes
to the workers, and `harness doctor`'s warning on a multi-homed node that names no interface."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import namedtuple
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from test_device_contract import node_configs
from test_schedulers import CRD_FILES, CRDS, closed

from backends import backend_names, get_backend
from backends.horovod_torch import build_env as hvd_build
from backends.horovod_torch.build_env import CPU_ENV, MissingPiece, build_env, compute_capabilities
from harness.cli import main
from harness.run.doctor import interface_check, ipv4_interfaces
from harness.run.kubeflow import job_kinds, manifest
from harness.run.runner import isolated_plans, node_plan

INSTALL_HOROVOD = REPO / "scripts" / "install_horovod.sh"


# ------------------------------------------------------------------------------- Horovod's GPU build (9)
def fake_cuda(root: Path) -> Path:
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    return nvcc


def fake_nccl_wheel(site: Path, headers: bool = True, library: bool = True) -> Path:
    """site-packages/nvidia/nccl as the nvidia-nccl-cu12 wheel lays it out: include/nccl.h and
    lib/libnccl.so.2 only (no unversioned libnccl.so)."""
    wheel = site / "nvidia" / "nccl"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    if headers:
        (wheel / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    if library:
        (wheel / "lib" / "libnccl.so.2").write_bytes(b"\x7fELF")
    return wheel


@pytest.mark.unit
def test_the_gpu_build_links_the_nccl_wheel_shared_for_this_device_s_capability(tmp_path):
    nvcc = fake_cuda(tmp_path / "cuda-12.8")
    wheel = fake_nccl_wheel(tmp_path / "site")
    plan = build_env("cuda", {}, nvcc, wheel, ["90"], link_dir=tmp_path / "link", torch_cuda="12.8")
    assert plan.env == {
        **CPU_ENV,
        "HOROVOD_GPU_OPERATIONS": "NCCL",
        "HOROVOD_CUDA_HOME": str(tmp_path / "cuda-12.8"),
        "HOROVOD_NCCL_HOME": str(wheel),
        "HOROVOD_NCCL_INCLUDE": str(wheel / "include"),
        "HOROVOD_NCCL_LIB": str(tmp_path / "link"),  # holds libnccl.so -> the wheel's libnccl.so.2
        "HOROVOD_NCCL_LINK": "SHARED",  # FindNCCL's default is libnccl_static.a, which the wheel lacks
        "HOROVOD_BUILD_CUDA_CC_LIST": "90",
    }
    assert plan.links == {tmp_path / "link" / "libnccl.so": wheel / "lib" / "libnccl.so.2"}
    assert plan.tag == "nccl-sm90"


@pytest.mark.unit
def test_the_helper_finds_nvcc_the_wheel_and_makes_the_link_from_the_venv(tmp_path, monkeypatch, capsys):
    """main() as install_horovod.sh runs it: nvcc from PATH, the wheel from the interpreter's import path,
    the capability from the device (nvidia-smi, here stood in for); the link is made, the env printed."""
    fake_cuda(tmp_path / "cuda")
    wheel = fake_nccl_wheel(tmp_path / "site")
    monkeypatch.setenv("PATH", f"{tmp_path / 'cuda' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for name in ("HOROVOD_CUDA_HOME", "HOROVOD_BUILD_CUDA_CC_LIST", *hvd_build.USER_NCCL):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "site")])
    monkeypatch.setattr(hvd_build, "device_capabilities", lambda python: compute_capabilities("9.0\n9.0\n"))
    link_dir = tmp_path / "work" / "nccl-lib"
    assert hvd_build.main(["--device", "cuda", "--torch-cuda", "12.8", "--link-dir", str(link_dir)]) == 0
    tag, *lines = capsys.readouterr().out.splitlines()
    env = dict(line.split("=", 1) for line in lines)
    assert tag == "nccl-sm90" and env["HOROVOD_CUDA_HOME"] == str(tmp_path / "cuda")
    assert env["HOROVOD_NCCL_LIB"] == str(link_dir) and env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert (link_dir / "libnccl.so").resolve() == (wheel / "lib" / "libnccl.so.2").resolve()


@pytest.mark.unit
@pytest.mark.parametrize(
    "missing, expected",
    [
        ("nvcc", "nvcc not found (looked in PATH, $CUDA_HOME/bin"),
        ("wheel", "NCCL not found: no nvidia/nccl folder (the nvidia-nccl-cu12 wheel)"),
        ("headers", "NCCL headers not found"),
        ("library", "NCCL library not found: no libnccl.so*"),
        ("torch", "this venv's torch is a CPU build"),
        ("capability", "no GPU compute capability"),
    ],
)
def test_a_gpu_build_missing_a_piece_names_it_and_how_to_get_it(missing, expected, tmp_path):
    nvcc = None if missing == "nvcc" else fake_cuda(tmp_path / "cuda")
    wheel = (
        None
        if missing == "wheel"
        else fake_nccl_wheel(tmp_path / "site", headers=missing != "headers", library=missing != "library")
    )
    with pytest.raises(MissingPiece) as err:
        build_env(
            "cuda",
            {},
            nvcc,
            wheel,
            [] if missing == "capability" else ["90"],
            tmp_path / "link",
            "" if missing == "torch" else "12.8",
        )
    message = str(err.value)
    assert message.startswith("horovod GPU build:") and expected in message and "\n" not in message
    if missing == "nvcc":
        assert "cuda-toolkit-12-8" in message and "HOROVOD_CUDA_HOME" in message
    if missing == "wheel":
        assert "pip install nvidia-nccl-cu12" in message


@pytest.mark.unit
def test_the_user_s_own_cuda_nccl_and_capabilities_win(tmp_path):
    nvcc = fake_cuda(tmp_path / "opt-cuda")
    user = {
        "HOROVOD_CUDA_HOME": str(tmp_path / "opt-cuda"),
        "HOROVOD_NCCL_HOME": "/opt/nccl",
        "HOROVOD_BUILD_CUDA_CC_LIST": "80,90",
    }
    assert hvd_build.find_nvcc(user, which=lambda name: "/elsewhere/nvcc") == nvcc
    plan = build_env("cuda", user, nvcc, None, [], tmp_path / "link", "12.8")
    assert not {k for k in plan.env if k.startswith("HOROVOD_NCCL")} and not plan.links
    assert "HOROVOD_BUILD_CUDA_CC_LIST" not in plan.env and plan.tag == "nccl-sm80-90"
    assert hvd_build.find_nvcc({"HOROVOD_CUDA_HOME": str(tmp_path / "none")}, which=lambda n: "/x") is None


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, caps", [("9.0\n9.0\n", ["90"]), ("8.6\n9.0", ["86", "90"]), ("12.0", ["120"])]
)
def test_compute_capabilities_are_spelled_as_horovod_s_cc_list(text, caps):
    assert compute_capabilities(text) == caps


def install_horovod(*args, path_dirs=(), **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    environ["PATH"] = os.pathsep.join([*map(str, path_dirs), environ["PATH"]])
    return subprocess.run(
        ["bash", str(INSTALL_HOROVOD), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **env},
    )


def test_the_cpu_build_gets_the_environment_and_cache_it_always_had(tmp_path):
    """What setup.sh builds here, read without building: the five switches of the CPU build, nothing of
    CUDA, and the wheel cached under the same name as before (a cached CPU wheel stays found)."""
    proc = install_horovod("--print-env", DISTBENCH_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    cache, *lines = proc.stdout.splitlines()
    assert lines == [  # the switches the script has always passed to the CPU build, in its order
        "HOROVOD_WITH_PYTORCH=1",
        "HOROVOD_WITH_GLOO=1",
        "HOROVOD_WITHOUT_MPI=1",
        "HOROVOD_WITHOUT_TENSORFLOW=1",
        "HOROVOD_WITHOUT_MXNET=1",
    ]
    assert cache.startswith(f"cache={tmp_path}/horovod-0.28.1-torch") and cache.endswith(
        f"-cp{sys.version_info[0]}{sys.version_info[1]}-cpu"
    )
    assert not list(tmp_path.iterdir()), "printing the environment must build and cache nothing"


def test_on_a_gpu_machine_the_script_stops_on_the_missing_piece_and_says_which(tmp_path):
    """nvidia-smi answers (a stand-in), but this venv's torch is the CPU build: the script stops before
    downloading anything, and its last line, which setup.sh shows as horovod's reason, names the cause."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = install_horovod(path_dirs=[bin_dir], DISTBENCH_CACHE=str(tmp_path / "cache"))
    assert proc.returncode != 0
    assert (
        proc.stderr.strip().splitlines()[-1].startswith("horovod GPU build: this venv's torch is a CPU build")
    )
    assert "building horovod" not in proc.stdout and not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------- Kubernetes pods' /dev/shm (11)
NETWORK = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1"}


def pods(job: dict) -> list[dict]:
    return [
        r["template"]["spec"]
        for key, rs in job["spec"].items()
        if key.endswith("ReplicaSpecs")
        for r in rs.values()
    ]


@pytest.mark.unit
@pytest.mark.parametrize("gpus", [True, False], ids=["gpu", "cpu"])
@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("backend", list(job_kinds()))
def test_every_pod_gets_a_memory_backed_dev_shm_and_the_network_settings(backend, nodes, gpus):
    """A container's /dev/shm is 64 MiB without a volume; NCCL's shared-memory transport needs more. Every pod
    of every kind mounts a memory-backed emptyDir there, gets the NCCL/Gloo interface settings given where
    the manifest was written, and still validates against its operator's real CRD schema."""
    import jsonschema

    job = yaml.safe_load(
        yaml.safe_dump(
            manifest(
                backend,
                "bench-1",
                "img:1",
                nodes,
                4,
                ["--workload", "tiny"],
                "res",
                gpus=gpus,
                network=NETWORK,
            )
        )
    )
    for pod in pods(job):
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
        for c in pod["containers"]:
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert {k: env.get(k) for k in NETWORK} == NETWORK
            if job_kinds()[backend] == "PaddleJob":  # its own entry (the node rank) is kept
                assert "NODE_RANK" in env
    schema = closed(json.loads((CRDS / CRD_FILES[job_kinds()[backend]]).read_text()))
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(job)]
    assert not errors, errors


@pytest.mark.unit
def test_harness_k8s_passes_the_interface_settings_of_its_environment_to_every_pod(monkeypatch, capsys):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    argv = ["k8s", "--nodes", "2", "--image", "img:1", "--name", "hvd", "run", "--backend", "horovod"]
    assert main([*argv, "--device", "cpu"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    containers = [c for pod in pods(job) for c in pod["containers"]]
    assert len(containers) == 2  # the MPIJob's launcher (whose horovodrun passes it on over ssh) and workers
    assert all({"name": "NCCL_SOCKET_IFNAME", "value": "ib0"} in c["env"] for c in containers)
    assert not any(e["name"] == "GLOO_SOCKET_IFNAME" for c in containers for e in c["env"])


# ------------------------------------------------------------------------------- Slurm's CPUs per task (11)
@pytest.mark.unit
def test_a_slurm_job_gives_each_node_s_harness_every_cpu_unless_told_how_many(capsys):
    """One task per node runs the harness and all its ranks: without --cpus-per-task it would get one CPU
    (srun's default; sbatch's --cpus-per-task is not inherited since Slurm 22.05)."""
    base = [
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "run",
        "--backend",
        "torch-ddp",
        "--device",
        "cuda",
    ]
    assert main(base) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --exclusive" in script and "#SBATCH --cpus-per-task" not in script
    assert 'srun --nodes=2 --ntasks-per-node=1 --cpus-per-task="$DISTBENCH_CPUS" ' in script
    assert "SLURM_JOB_CPUS_PER_NODE" in script
    assert main([*base[:5], "--cpus-per-task", "16", *base[5:]]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --cpus-per-task=16" in script and "export DISTBENCH_CPUS=16" in script
    assert "--exclusive" not in script and '--cpus-per-task="$DISTBENCH_CPUS"' in script


# Stand-ins for srun and scontrol that record what the job asked of them, and the environment srun passes on.
RECORDING_SRUN = """#!/bin/bash
echo "srun $*" >> "$JOB_LOG"
echo "NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-}" >> "$JOB_LOG"
"""
SCONTROL = "#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\n"


@pytest.mark.unit
@pytest.mark.subprocess  # bash runs the job script with stand-ins
def test_at_job_time_srun_gets_the_least_cpus_of_the_nodes_and_the_interface_settings(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert (
        main(
            [
                "slurm",
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "run",
                "--backend",
                "torch-ddp",
                "--device",
                "cuda",
            ]
        )
        == 0
    )
    script = tmp_path / "job.sbatch"
    script.write_text(capsys.readouterr().out)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", RECORDING_SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        JOB_LOG=str(log),
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_JOB_ID="7",
        SLURM_JOB_CPUS_PER_NODE="72,36",  # a heterogeneous allocation: the second node has fewer
        GLOO_SOCKET_IFNAME="eth1",  # set where the job is submitted: it wins over the file's
    )
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60)
    srun, seen = log.read_text().splitlines()
    assert srun.startswith("srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=36 ")
    assert seen == "NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=eth1"


# -------------------------------------------------------- the interface settings reach every launcher (11)
@pytest.mark.unit
@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("backend", backend_names())
def test_every_launch_plan_passes_the_interface_settings_to_its_workers(
    backend, device, tmp_path, monkeypatch
):
    """Every process of every launch (the run's and the isolated workers', every node's) is given the
    NCCL/Gloo interface settings of the harness's environment, so `harness plan` shows them too."""
    for k, v in NETWORK.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    adapter = get_backend(backend)
    for cfg in node_configs(backend, 2, device, "--compute-method", "isolated"):
        plans = [node_plan(adapter, cfg, tmp_path, 29500), *isolated_plans(adapter, cfg, tmp_path)]
        for proc in (p for plan in plans for p in plan.processes):
            assert {k: proc.env.get(k) for k in NETWORK} == NETWORK, proc.argv


# --------------------------------------------------------------- doctor: a multi-homed node (11)
Addr = namedtuple("Addr", "family address")


def fake_net(root: Path, interfaces: dict[str, tuple[int, str]]) -> Path:
    """/sys/class/net as Linux shows it: each interface's flags (hex) and operstate."""
    for name, (flags, state) in interfaces.items():
        (root / name).mkdir(parents=True)
        (root / name / "flags").write_text(f"{flags:#x}\n")
        (root / name / "operstate").write_text(state + "\n")
    return root


@pytest.mark.unit
def test_doctor_finds_the_interfaces_nccl_and_gloo_could_use(tmp_path):
    net = fake_net(
        tmp_path,
        {"lo": (0x9, "unknown"), "eth0": (0x1003, "up"), "ib0": (0x1003, "up"), "docker0": (0x1003, "down")},
    )
    addrs = {
        "lo": [Addr(socket.AF_INET, "127.0.0.1")],
        "eth0": [Addr(socket.AF_INET, "10.0.0.5"), Addr(socket.AF_INET6, "fe80::1")],
        "ib0": [Addr(socket.AF_INET, "192.168.10.5")],
        "docker0": [Addr(socket.AF_INET, "172.17.0.1")],  # a bridge with no container: down
        "ifb0": [Addr(socket.AF_INET6, "fe80::2")],  # no IPv4
    }
    assert ipv4_interfaces(net, addrs) == {"eth0": ["10.0.0.5"], "ib0": ["192.168.10.5"]}


@pytest.mark.unit
def test_doctor_warns_on_a_multi_homed_node_that_names_no_interface(tmp_path):
    two = {"eth0": ["10.0.0.5"], "ib0": ["192.168.10.5"]}
    warned = interface_check(two, {})
    assert warned.status == "warn" and "eth0 10.0.0.5, ib0 192.168.10.5" in warned.got
    assert "neither NCCL_SOCKET_IFNAME nor GLOO_SOCKET_IFNAME is set" in warned.got
    chosen = interface_check(two, {"NCCL_SOCKET_IFNAME": "ib0"})
    assert chosen.status == "ok" and chosen.got.endswith("NCCL_SOCKET_IFNAME=ib0")
    assert interface_check({"eth0": ["10.0.0.5"]}, {}) is None  # one interface: nothing to choose


@pytest.mark.unit
def test_harness_doctor_shows_the_warning(monkeypatch, capsys, tmp_path):
    """The check in `harness doctor`'s list (frameworks and collectives stood in for: no process here)."""
    import harness.run.doctor as doctor

    ok = doctor.Check("x", "-", "-", "-", "ok")
    monkeypatch.setattr(
        doctor, "import_check", lambda m, required, python=None: replace(ok, name=f"framework {m}")
    )
    monkeypatch.setattr(
        doctor, "collective_check", lambda backend, n=2, python=None: replace(ok, name="collective")
    )
    monkeypatch.setattr(doctor, "visible_gpus", lambda: [])
    monkeypatch.setattr(doctor, "ipv4_interfaces", lambda: {"eth0": ["10.0.0.5"], "ib0": ["192.168.10.5"]})
    for k in NETWORK:
        monkeypatch.delenv(k, raising=False)
    assert main(["doctor", "--backends", "torch-ddp", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[warn] network interfaces" in out and "neither NCCL_SOCKET_IFNAME nor GLOO_SOCKET_IFNAME" in out
