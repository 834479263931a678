"""`harness slurm` against a real Slurm: scripts/local_slurm.sh starts slurmctld and two slurmd on this
machine as two nodes (installing Debian's slurm-wlm and munge when missing); each backend's generated sbatch
script is submitted with the real `sbatch`, and the job must yield one ok record with world size 2, one rank
per node. Where Slurm cannot be had (not root, no apt), every test here skips with the script's reason.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from conftest import REPO, harness
from processes import leftovers

from core.records import load_record, run_config

pytestmark = pytest.mark.machine  # installs Slurm and munge, adds node names to /etc/hosts

SCRIPT = REPO / "scripts" / "local_slurm.sh"
RUN = "--device cpu --steps 3 --warmup 1 --threads-per-worker 1 --compute-method none --no-trace-comm".split()
# One stack per way a multi-node launch starts under srun: a launcher per node (torchrun; TF_CONFIG and
# Paddle's launcher start the same way and run on two nodes in tests/test_multinode.py), DeepSpeed's runner
# with a hostfile and no ssh, and horovodrun on node 0 alone while the other nodes wait for its ranks.
BACKENDS = ["torch-ddp", "deepspeed", "horovod"]


@pytest.fixture(scope="module")
def slurm_env():
    proc = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=900)
    if proc.returncode == 3:
        pytest.skip(f"no real Slurm here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    conf = proc.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    yield {**os.environ, "SLURM_CONF": conf}
    subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def wait_for_job(job: str, env: dict, timeout_s: float) -> str:
    """The job's final state (sacct is not configured: squeue until it is gone, then scontrol's memory)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, env=env)
        if not out.stdout.strip():
            shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env)
            state = [w for w in shown.stdout.split() if w.startswith("JobState=")]
            return state[0].split("=", 1)[1] if state else "GONE"
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} still queued or running after {timeout_s} s")


def submit(folder, run_args: list[str], env: dict) -> str:
    """`harness slurm` for 2 nodes x 1 rank (1 CPU each) running `harness run RUN_ARGS`, submitted with the
    real sbatch from `folder`; the job id."""
    script = folder / "job.sbatch"
    layout = ["--nodes", "2", "--gpus-per-node", "1", "--cpus-per-task", "1", "--time", "00:10:00"]
    proc = harness("slurm", *layout, "--workdir", REPO, "-o", script, "run", *run_args)
    assert proc.returncode == 0, proc.stderr
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={folder}", str(script)], capture_output=True, text=True, env=env
    )
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_generated_sbatch_job_runs_on_two_real_slurm_nodes_to_one_ok_record(backend, slurm_env, tmp_path):
    out = tmp_path / "results"
    job = submit(tmp_path, ["--backend", backend, *RUN, "--out", str(out)], slurm_env)
    state = wait_for_job(job, slurm_env, timeout_s=480)
    output = (tmp_path / f"distbench-{job}.out").read_text(errors="replace")
    record = load_record(out / f"slurm-{job}.json")
    assert state == "COMPLETED" and record["status"] == "ok", (state, record.get("error"), output[-3000:])
    assert run_config(record).topology.world_size == 2 and run_config(record).topology.nodes == 2
    assert sorted(r["rank"] for r in record["ranks"]) == [0, 1]
    # The allocation's CPUs, not the host's: Slurm bound each task to one CPU (task/affinity), so each
    # worker got one thread although this machine has more.
    assert (
        record["environment"]["cpus_available"] == 1 and run_config(record).topology.threads_per_worker == 1
    )
    assert not leftovers(out, wait_s=10)


@pytest.mark.slow
def test_a_job_cancelled_by_slurm_still_writes_its_record_naming_slurm(slurm_env, tmp_path):
    """scancel, as the time limit does: SIGTERM to the job's tasks, SIGKILL after KillWait (30 s here). Node
    0's harness stops its ranks and writes a timeout record saying Slurm stopped it, within KillWait."""
    out = tmp_path / "results"
    long_run = [*RUN, "--steps", "400", "--step-delay", "0.05"]
    job = submit(tmp_path, ["--backend", "torch-ddp", *long_run, "--out", str(out)], slurm_env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
        '"event": "step"' in p.read_text() for p in out.glob("logs/*/rank0.events.jsonl")
    ):
        time.sleep(0.5)
    cancelled = time.monotonic()
    subprocess.run(["scancel", job], env=slurm_env, check=True)
    wait_for_job(job, slurm_env, timeout_s=120)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out / f"slurm-{job}.json").exists():
        time.sleep(0.5)
    record = load_record(out / f"slurm-{job}.json")
    assert record["status"] == "timeout" and f"SIGTERM from Slurm (job {job}" in record["error"]["message"]
    assert time.monotonic() - cancelled < 30  # within KillWait: before Slurm's SIGKILL
    assert not leftovers(out, wait_s=10)
