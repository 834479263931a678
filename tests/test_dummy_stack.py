"""A stack added from outside the repository: a package in a temporary folder, registered with one entry-point
line (backends/__init__.py), is listed, run, planned for Slurm and Kubeflow, predicted and reported by the
harness, with no edit to the harness or to backends/ (issue 27: each stack owns its knowledge).

The dummy stack is framework-free: a low-rank bigram model in numpy trained by SGD, one process per rank,
whose gradients rank 0 averages over multiprocessing.connection (a star all-reduce).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO

import backends
from backends import RegistryError, backend_names, get_backend
from core.records import run_config

ADAPTER = '''
"""The dummy stack's adapter: one worker process per rank, started by the harness itself."""

from backends.base import WORKER_SCRIPT, Backend, LaunchPlan, Options, worker_python
from backends.schedule import CommTerm, whole_tensors
from core.config import InvalidConfig
from core.process import Process

RANK_DIM = 8  # logits = embedding[token] @ output: embedding vocab x RANK_DIM, output RANK_DIM x vocab


class Dummy(Backend[Options]):
    name = "dummy"
    framework = "numpy"
    launcher = "one python process per rank"
    collective_api = "multiprocessing.connection"
    compute_methods = ("isolated",)
    kubeflow_job = "PyTorchJob"  # its ranks meet at a master address and port, as torchrun's do
    peer_lost_texts = ("eoferror",)  # what a rank's receive raises when rank 0 is gone
    Options = Options

    def validate(self, cfg):
        """Its numpy model is fp32; its ranks compute on the host whatever the device."""
        if cfg.model.precision != "fp32":
            raise InvalidConfig(f"--precision {cfg.model.precision}: dummy runs fp32 only")

    def schedule(self, cfg):
        """Its fp32 gradients (both matrices), all-reduced in one call after the last backward."""
        gradients = CommTerm("all_reduce", 2 * cfg.model.spec.vocab_size * RANK_DIM, 4, 1, "gradients")
        return whole_tensors(cfg, [gradients], "one all-reduce of the gradients through rank 0")

    def launch(self, cfg, run_dir, port, devices):
        first = 0 if cfg.role.isolated_index is not None else cfg.first_local_rank
        master = "127.0.0.1" if cfg.role.isolated_index is not None else cfg.topology.master_addr
        env = {**self.worker_env(cfg), "DUMMY_MASTER": f"{master}:{port}"}
        argv = [worker_python(cfg), str(WORKER_SCRIPT), str(run_dir)]
        ranks = [(str(first + i), str(i)) for i in range(cfg.local_procs)]  # (rank, index on this node)
        return LaunchPlan(
            [Process(argv, {**env, "DISTBENCH_RANK": r, "DUMMY_LOCAL_RANK": i}) for r, i in ranks]
        )
'''

WORKER = '''
"""The dummy stack's worker: the low-rank bigram model in numpy, SGD; rank 0 averages the gradients."""

import os
import time
from multiprocessing.connection import Client, Listener

import numpy as np

from backends.loop import Trainer
from dummy_stack import RANK_DIM

LEARNING_RATE = 30.0


def connect(address, deadline):
    """A connection to rank 0's listener, which may not be up yet."""
    while True:
        try:
            return Client(address, authkey=b"dummy")
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class DummyTrainer(Trainer):
    framework = "numpy"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.local_rank = int(os.environ["DUMMY_LOCAL_RANK"])
        rng = np.random.default_rng(cfg.model.seed)
        vocab = cfg.model.spec.vocab_size
        self.params = [
            rng.normal(0, 0.5, (vocab, RANK_DIM)).astype(np.float32),
            rng.normal(0, 0.5, (RANK_DIM, vocab)).astype(np.float32),
        ]
        self.peers = []
        if self.world_size > 1:
            host, port = os.environ["DUMMY_MASTER"].rsplit(":", 1)
            if self.rank == 0:
                with Listener((host, int(port)), authkey=b"dummy") as listener:
                    self.peers = [listener.accept() for _ in range(self.world_size - 1)]
            else:
                self.peers = [connect((host, int(port)), time.monotonic() + cfg.collective_timeout)]

    def gradients(self, inputs, targets):
        embedding, output = self.params
        hidden = embedding[inputs]
        logits = hidden @ output
        logits -= logits.max(-1, keepdims=True)
        probs = np.exp(logits)
        total = probs.sum(-1, keepdims=True)
        probs /= total
        targeted = targets[..., None]
        loss = float((np.log(total) - np.take_along_axis(logits, targeted, -1)).mean())
        n = targets.size
        np.put_along_axis(probs, targeted, np.take_along_axis(probs, targeted, -1) - 1, -1)
        probs /= n  # d loss / d logits
        d_output = hidden.reshape(n, RANK_DIM).T @ probs.reshape(n, -1)
        d_embedding = np.zeros_like(embedding)
        np.add.at(d_embedding, inputs.reshape(-1), (probs @ output.T).reshape(n, RANK_DIM))
        return loss, [d_embedding, d_output]

    def all_reduce_mean(self, grads):
        if self.rank == 0:
            for peer in self.peers:
                grads = [g + p for g, p in zip(grads, peer.recv())]
            grads = [g / self.world_size for g in grads]
            for peer in self.peers:
                peer.send(grads)
            return grads
        self.peers[0].send(grads)
        return self.peers[0].recv()

    def step(self, batches, sync_grads=True):
        losses, summed = [], None
        for inputs, targets in batches:
            loss, grads = self.gradients(inputs, targets)
            losses.append(loss)
            summed = grads if summed is None else [s + g for s, g in zip(summed, grads)]
        grads = [s / len(batches) for s in summed]
        if self.peers:
            grads = self.all_reduce_mean(grads)
        self.timed_optimizer_step(lambda: self.sgd(grads))
        return float(np.mean(losses))

    def sgd(self, grads):
        for p, g in zip(self.params, grads):
            p -= LEARNING_RATE * g

    def memory(self):
        return {}

    def model_state_bytes(self):
        held = sum(p.nbytes for p in self.params)
        return {"params": held, "grads": held, "optimizer": 0}

    def versions(self):
        return {"numpy": np.__version__}

    def close(self):
        for peer in self.peers:
            peer.close()


def make_trainer(cfg):
    return DummyTrainer(cfg)
'''

# The one registry line, in the entry-point file an installed package's metadata holds (what
# `pip install` writes from `[project.entry-points."distbench.backends"]` in its pyproject.toml)
REGISTRY_LINE = "dummy = dummy_stack:Dummy"
# A tiny model, few steps, no isolated counterfactual: the test is about the seams, not the numbers
OPTIONS = (
    "--device cpu --vocab 256 --seq-len 32 --steps 3 --warmup 1 --compute-method none "
    "--threads-per-worker 1 --timeout 60"
).split()
RUN = ["--backend", "dummy", "--gpus", "2", *OPTIONS]


def write_package(root: Path) -> Path:
    """The dummy stack as an installed package under `root`: its modules and its metadata."""
    package = root / "dummy_stack"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(ADAPTER).lstrip())
    (package / "worker.py").write_text(textwrap.dedent(WORKER).lstrip())
    meta = root / "dummy_stack-0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: dummy-stack\nVersion: 0\n")
    (meta / "entry_points.txt").write_text(f"[{backends.ENTRY_POINT_GROUP}]\n{REGISTRY_LINE}\n")
    return root


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    return write_package(tmp_path_factory.mktemp("plugin"))


def harness(plugin: Path, *args, timeout=180) -> subprocess.CompletedProcess:
    """`python -m harness ARGS` with the dummy stack installed (on PYTHONPATH, which the workers inherit)."""
    path = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "harness", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": path},
    )
    return proc


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


# ------------------------------------------------------------------------------------------- the registry
@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The dummy stack's package on this process's path, the registry read afresh (and again after)."""
    monkeypatch.syspath_prepend(str(write_package(tmp_path)))
    backends.registered.cache_clear()
    yield tmp_path
    backends.registered.cache_clear()
    for name in [m for m in sys.modules if m == "dummy_stack" or m.startswith("dummy_stack.")]:
        del sys.modules[name]


@pytest.mark.unit
def test_one_entry_point_line_registers_a_stack_after_the_shipped_ones(installed):
    assert backend_names() == [*backends.ADAPTERS, "dummy"]
    dummy = get_backend("dummy")
    assert dummy.name == "dummy" and dummy.kubeflow_job == "PyTorchJob"
    assert dummy.worker_module == "dummy_stack.worker"


@pytest.mark.unit
def test_a_registered_name_that_clashes_with_a_shipped_one_is_refused_naming_both(installed):
    (installed / "dummy_stack-0.dist-info" / "entry_points.txt").write_text(
        f"[{backends.ENTRY_POINT_GROUP}]\ntorch-ddp = dummy_stack:Dummy\n"
    )
    backends.registered.cache_clear()
    with pytest.raises(RegistryError, match="dummy-stack registers backend 'torch-ddp'.*another name"):
        backend_names()


@pytest.mark.unit
def test_an_adapter_that_does_not_load_is_refused_naming_it(installed):
    (installed / "dummy_stack-0.dist-info" / "entry_points.txt").write_text(
        f"[{backends.ENTRY_POINT_GROUP}]\ndummy = dummy_stack:Missing\n"
    )
    backends.registered.cache_clear()
    with pytest.raises(RegistryError, match="backend 'dummy': its adapter dummy_stack:Missing does not load"):
        get_backend("dummy")


@pytest.mark.unit
def test_its_words_for_a_lost_peer_tell_the_runner_which_rank_failed_on_its_own(installed, monkeypatch):
    """A rank whose receive raised EOFError failed because rank 0 went: the runner learns it from the
    registered adapter's peer_lost_texts, and without them takes it for the rank's own failure."""
    from harness.run import record as run_record

    dead_peer = {"status": "failed", "error": "EOFError: "}
    run_record.peer_failure_texts.cache_clear()
    try:
        assert run_record.failure_kind(dead_peer) == "lost"
        monkeypatch.setattr(type(get_backend("dummy")), "peer_lost_texts", ())
        run_record.peer_failure_texts.cache_clear()
        assert run_record.failure_kind(dead_peer) is None
    finally:
        run_record.peer_failure_texts.cache_clear()


# ------------------------------------------------------------------------------- the harness, end to end
def test_harness_list_shows_the_registered_stack(plugin):
    out = ok(harness(plugin, "list"))
    (row,) = [line for line in out.splitlines() if "dummy" in line]
    assert "numpy" in row and "yes" in row


@pytest.fixture(scope="module")
def record(plugin, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("results")
    ok(harness(plugin, "run", *RUN, "--out", out))
    (path,) = out.glob("*.json")
    return json.loads(path.read_text()), path


def test_a_two_rank_run_ends_with_an_ok_record_whose_loss_falls(record):
    rec, _ = record
    assert rec["status"] == "ok", rec.get("failure")
    assert rec["config"]["backend"] == "dummy" and len(rec["ranks"]) == 2
    (term,) = rec["backend_info"]["comm_pattern"]["terms"]  # the analytic volume: its own schedule's
    assert (term["op"], term["elements"], term["dtype_bytes"]) == ("all_reduce", 2 * 256 * 8, 4)
    for rank in rec["ranks"]:
        losses = rank["warmup_losses"] + rank["losses"]
        assert losses[-1] < losses[0], losses


def test_the_report_of_its_record_shows_it(plugin, record):
    _, path = record
    report = ok(harness(plugin, "report", path))
    assert "dummy" in report


def test_plan_slurm_and_kubeflow_plan_a_job_for_it(plugin, tmp_path):
    plan = ok(harness(plugin, "plan", *RUN))
    assert plan.count("backends/worker.py") == 2 and "DUMMY_MASTER=" in plan
    layout = ["--nodes", "2", "--gpus-per-node", "2"]
    sbatch = ok(harness(plugin, "slurm", *layout, "run", "--backend", "dummy", *OPTIONS))
    assert "--backend dummy" in sbatch and "#SBATCH --nodes=2" in sbatch
    manifest = tmp_path / "job.yaml"
    ok(
        harness(
            plugin, "k8s", *layout, "--image", "img:1", "-o", manifest, "run", "--backend", "dummy", *OPTIONS
        )
    )
    job = yaml.safe_load(manifest.read_text())
    assert job["kind"] == "PyTorchJob" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert job["metadata"]["labels"]["distbench/backend"] == "dummy"


def test_predict_prices_its_own_schedule(plugin, tmp_path):
    """The prediction replays the collectives the adapter declares (Backend.schedule): its records name the
    dummy's schedule, not the default one."""
    predictions = tmp_path / "predictions"
    predict = ["--gpus", "8,16", "--hardware", "h100-sxm", "--precision", "fp32", "--out", predictions]
    out = ok(harness(plugin, "predict", "--backend", "dummy", "--vocab", "256", "--seq-len", "32", *predict))
    assert "PREDICTED (not measured): dummy" in out
    records = [json.loads(p.read_text()) for p in sorted(predictions.glob("*.json"))]
    assert sorted(run_config(r).topology.world_size for r in records) == [8, 16]
    for r in records:
        assert r["kind"] == "prediction" and r["status"] == "ok"
        assert r["inputs"]["schedule"] == "one all-reduce of the gradients through rank 0"
