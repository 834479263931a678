"""tf-mwms on a GPU, checked without one: what MultiWorkerMirroredStrategy is told to all-reduce with, and
what its attention costs in memory, as the run record's settings and `harness plan` say them.

TensorFlow runs NCCL only for the "nccl" communication hint (CollectiveParamResolverLocal::
AssignCollectiveType), so its own AUTO is the ring all-reduce on a GPU too; the suite's `--collective auto`
means NCCL on cuda and stays TF's AUTO (the ring) on CPU. Keras's TensorFlow backend has no flash attention:
the (B, H, T, T) fp32 logits are materialised, and the record says how large they are (analytic).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

import harness.run.commands as commands
from backends import get_backend
from harness.arguments import requested_world
from harness.cli import main, make_parser
from harness.run.options import build_config
from harness.usage import UsageError
from workloads.spec import PRESETS

TF = get_backend("tf-mwms")
GIB = 2**30


def config(*argv: str):
    """The RunConfig `harness run --backend tf-mwms ARGV` builds (devices not checked: no GPU here)."""
    args = make_parser().parse_args(["run", "--backend", "tf-mwms", "--gpus", "2", *argv])
    return build_config(args, "tf-mwms", requested_world(args), check_devices=False, node_rank=0)


# (device, --collective) -> (implementation handed to MWMS, the all-reduce TF's runtime runs, label)
CHOICES = {
    ("cuda", "auto"): ("NCCL", "NcclReduce", "tf-mwms-nccl"),
    ("cuda", "nccl"): ("NCCL", "NcclReduce", "tf-mwms-nccl"),
    ("cuda", "ring"): ("RING", "RingReduce", "tf-mwms-ring"),
    ("cpu", "auto"): ("AUTO", "RingReduce", "tf-mwms"),
    ("cpu", "ring"): ("RING", "RingReduce", "tf-mwms-ring"),
}


@pytest.mark.unit
@pytest.mark.parametrize("device, collective", list(CHOICES))
def test_auto_is_nccl_on_cuda_and_the_ring_on_cpu(device, collective):
    from backends.tf_mwms import communication

    implementation, kernel, label = CHOICES[device, collective]
    cfg = config("--device", device, "--collective", collective)
    assert communication(cfg) == implementation
    settings = TF.settings(cfg)["communication"]
    assert (settings["requested"], settings["implementation"], settings["all_reduce"]) == (
        collective,
        implementation,
        kernel,
    )
    assert TF.label(cfg) == label and TF.commbench_label(cfg) == label
    assert TF.label(config("--device", device, "--collective", collective, "--xla")) == label + "-xla"
    json.dumps(TF.settings(cfg))  # the record is JSON


@pytest.mark.unit
@pytest.mark.parametrize("command", ["run", "plan", "commbench"])
def test_nccl_on_cpu_is_refused_before_launch_in_one_line(command, tmp_path, monkeypatch, capsys):
    """TensorFlow would not fail: on CPU it runs its ring under an `nccl` label (tensorflow-cpu has no
    NcclReduce kernel), so a record labelled tf-mwms-nccl would hold ring timings."""

    def refuse(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(commands, "execute", refuse)
    monkeypatch.setattr(commands, "run_node", refuse)
    argv = [command, "--backend", "tf-mwms", "--gpus", "2", "--device", "cpu", "--collective", "nccl"]
    assert main([*argv, "--out", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--collective nccl needs --device cuda" in err[0], err
    assert "auto or ring" in err[0]
    assert not (tmp_path / "results").exists()
    with pytest.raises(UsageError):
        config("--device", "cpu", "--collective", "nccl")


def attention_bytes(spec, micro_batch: int) -> int:
    """One (B, H, T, T) float32 tensor: B sequences, H heads, T queries by T keys, 4 bytes each."""
    return micro_batch * spec.n_heads * spec.seq_len * spec.seq_len * 4


@pytest.mark.unit
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_record_says_attention_is_materialised_and_what_it_costs(checkpointing):
    spec = PRESETS["1b"]
    extra = ["--activation-checkpointing"] if checkpointing else []
    cfg = config("--device", "cuda", "--workload", "1b", "--micro-batch", "8", *extra)
    attention = TF.settings(cfg)["attention"]
    per_layer = attention_bytes(spec, 8)
    held = 1 if checkpointing else spec.n_layers  # recompute_grad re-runs one block's forward at a time
    assert attention["implementation"] == "materialised (B,H,T,T) logits" and attention["flash"] is False
    assert attention["basis"] == "analytic"
    assert attention["bytes_per_layer"] == per_layer == 2 * GIB  # the figure the README quotes for 1b
    assert attention["bytes_held_for_backward"] == held * per_layer


@pytest.mark.unit
def test_plan_shows_tf_mwms_attention_memory_and_its_collective(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv = ["plan", "--backend", "tf-mwms", "--workload", "1b", "--micro-batch", "8", "--gpus", "8"]
    assert main([*argv, "--device", "cuda", "--out", str(tmp_path / "results")]) == 0
    out = capsys.readouterr().out
    spec, per_layer = PRESETS["1b"], attention_bytes(PRESETS["1b"], 8)
    shape = f"8x{spec.n_heads}x{spec.seq_len}x{spec.seq_len}x4 B"
    line = next((x for x in out.splitlines() if "attention: materialised (B,H,T,T) fp32 logits" in x), None)
    assert line is not None, out
    assert f"{shape} = {per_layer / GIB:.2f} GiB per layer" in line
    assert f"{spec.n_layers} layer(s) = {spec.n_layers * per_layer / GIB:.2f} GiB (analytic" in line
    assert "communication: NCCL (--collective auto on cuda): all-reduce NcclReduce" in out
    assert "plan: tf-mwms-nccl" in out


def test_the_worker_and_commbench_hand_tensorflow_the_adapters_choice():
    """The worker's MWMS options, built by TensorFlow itself (in a process of its own: the test process
    imports no framework), for a cuda config: NCCL for auto, as the record says."""
    cfgs = {c: config("--device", "cuda", "--collective", c).to_dict() for c in ("auto", "ring", "nccl")}
    code = (
        "import json, sys\n"
        "from core.config import RunConfig\n"
        "from backends.tf_mwms.worker import communication_options\n"
        "import backends.tf_mwms.collectives as c\n"
        "assert c.communication_options is communication_options\n"
        "cfgs = json.loads(sys.argv[1])\n"
        "print(json.dumps({k: communication_options(RunConfig.from_dict(v)).implementation.name "
        "for k, v in cfgs.items()}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfgs)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "auto": "NCCL",
        "ring": "RING",
        "nccl": "NCCL",
    }
