"""Multi-node: the layout options, `harness plan`, and two "nodes" on one machine (two harnesses on loopback
with distinct node ranks, each starting its own launcher) for every registered backend, whose record must
equal a one-node 2-process run's in world size, ranks, hosts and losses. Without a shared filesystem,
`harness collect` completes the record.

The runs are ISSUE_SHAPE's of tests/test_equivalence.py (a three-block GPT, 10 steps), and the one-node run
they must equal is that shape's torch-ddp reference, which the suite launches once for every module that
compares against it."""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, harness
from processes import leftovers
from test_equivalence import ISSUE_SHAPE, ddp_reference

from backends import backend_names, get_backend
from core.events import events_path
from core.process import free_port
from core.records import run_config, write_json_atomic
from harness.arguments import read_hosts, requested_world
from harness.cli import make_parser
from harness.run import nodes
from harness.run.nodes import check_run_id
from harness.run.options import build_config
from harness.usage import UsageError

# Each node one rank of ISSUE_SHAPE's 2-rank layout, as its torch-ddp reference runs it (untimed: no
# counterfactual)
SHAPE = [*map(str, ISSUE_SHAPE.args(gpus=2)), "--compute-method", "none"]


def run_args(*argv) -> argparse.Namespace:
    return make_parser().parse_args(["run", "--backend", "torch-ddp", *argv])


def config(*argv):
    args = run_args(*argv)
    return build_config(args, args.backend, requested_world(args))


# --------------------------------------------------------------------------------------------- the layout
@pytest.mark.unit
def test_layout_from_hosts_and_gpus_per_node():
    cfg = config(
        "--nodes", "2", "--gpus-per-node", "4", "--hosts", "a,b", "--node-rank", "1", "--device", "cpu"
    )
    assert (
        cfg.topology.world_size,
        cfg.topology.nodes,
        cfg.topology.node_rank,
        cfg.topology.gpus_per_node,
    ) == (8, 2, 1, 4)
    assert (cfg.topology.hosts, cfg.topology.master_addr, cfg.topology.master_port) == (
        ["a", "b"],
        "a",
        29500,
    )
    cfg = config(
        "--gpus", "4", "--nodes", "2", "--master", "10.0.0.1:1234", "--node-rank", "0", "--device", "cpu"
    )
    assert (
        cfg.topology.gpus_per_node,
        cfg.topology.master_addr,
        cfg.topology.master_port,
        cfg.topology.hosts,
    ) == (2, "10.0.0.1", 1234, [])
    one = config("--gpus", "2", "--device", "cpu")  # one node: a free port is picked per run
    assert (one.topology.nodes, one.topology.node_rank, one.topology.master_port) == (1, 0, None)


@pytest.mark.unit
def test_hostfile_in_deepspeed_and_mpi_styles(tmp_path):
    (tmp_path / "ds").write_text("# nodes\nnode-a slots=8\nnode-b slots=8\n")
    (tmp_path / "mpi").write_text("node-a:4\nnode-b:4\n")
    (tmp_path / "plain").write_text("node-a\n\nnode-b\n")
    assert read_hosts(run_args("--hostfile", str(tmp_path / "ds"))) == (["node-a", "node-b"], 8)
    assert read_hosts(run_args("--hostfile", str(tmp_path / "mpi"))) == (["node-a", "node-b"], 4)
    assert read_hosts(run_args("--hostfile", str(tmp_path / "plain"))) == (["node-a", "node-b"], None)
    cfg = config("--hostfile", str(tmp_path / "ds"), "--node-rank", "1", "--device", "cpu")
    assert (cfg.topology.nodes, cfg.topology.world_size, cfg.topology.gpus_per_node) == (2, 16, 8)


@pytest.mark.unit
def test_node_rank_is_found_from_this_hosts_place():
    me = socket.gethostname()
    assert config("--hosts", f"elsewhere,{me}", "--device", "cpu").topology.node_rank == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "2", "--hosts", "a,b,c", "--node-rank", "0"], "3 host"),
        (["--gpus", "3", "--nodes", "2", "--hosts", "a,b", "--node-rank", "0"], "do not split evenly"),
        (
            ["--gpus", "4", "--nodes", "2", "--gpus-per-node", "4", "--hosts", "a,b", "--node-rank", "0"],
            "2 node(s) x 4",
        ),
        (["--nodes", "2", "--hosts", "a,b", "--node-rank", "2"], "expected 0..1"),
        (["--nodes", "2", "--node-rank", "0"], "give --master"),
        (["--nodes", "2", "--hosts", "a,b"], "give --node-rank"),
        (["--master", "a:99999"], "port in 1..65535"),
    ],
)
@pytest.mark.unit
def test_bad_layouts_name_the_problem(argv, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(*argv, "--device", "cpu")


@pytest.mark.unit
def test_single_node_adapters_refuse_several_nodes(monkeypatch):
    """Every adapter here is multi-node; an adapter that declares otherwise must be refused up front."""
    monkeypatch.setattr(type(get_backend("torch-ddp")), "multi_node", False)
    with pytest.raises(UsageError, match="backend torch-ddp runs on one node only"):
        config(
            "--backend", "torch-ddp", "--nodes", "2", "--hosts", "a,b", "--node-rank", "0", "--device", "cpu"
        )


@pytest.fixture
def sigterm(monkeypatch):
    """The harness's stop flag, set as its SIGTERM handler sets it, and cleared after the test."""
    import threading

    from harness.run import launch

    monkeypatch.setattr(launch, "STOP", threading.Event())
    monkeypatch.setattr(launch, "stop_reason", [])
    return lambda: launch.request_stop("SIGTERM from Slurm (job 7: its time limit, or scancel)")


@pytest.mark.unit
@pytest.mark.timing
def test_after_a_sigterm_node_0_waits_a_grace_for_the_other_nodes_markers(tmp_path, sigterm, monkeypatch):
    """Slurm signals every node: node 1 writes its marker a second after node 0 is told to stop, and the
    record gets it; a node that never writes one holds node 0 no longer than the grace."""
    import threading
    import time

    from core.config import RunConfig
    from workloads.spec import PRESETS

    monkeypatch.setattr(nodes, "STOP_GRACE_S", 3.0)
    cfg = RunConfig.build(
        "torch-ddp",
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=2,
        device="cpu",
        nodes=2,
        compute_method="none",
        isolated_repeats=0,
        timeout_s=600.0,
    )

    def marker(k, **extra):
        done = {"finished": True, "returncodes": [-15], "timed_out": False, "elapsed_s": 1.0}
        write_json_atomic(nodes.marker_path(tmp_path, k), {"node_rank": k, **done, **extra})

    marker(0)
    write_json_atomic(nodes.marker_path(tmp_path, 1), {"node_rank": 1})  # started, not finished
    sigterm()
    late = threading.Timer(1.0, marker, args=(1,))
    late.start()
    started = time.monotonic()
    markers = nodes.wait_for_nodes(tmp_path, cfg)
    late.join()
    assert markers[1].get("finished") and time.monotonic() - started < 3.0
    write_json_atomic(nodes.marker_path(tmp_path, 1), {"node_rank": 1})
    started = time.monotonic()
    assert not nodes.wait_for_nodes(tmp_path, cfg)[1].get("finished")
    assert 2.5 < time.monotonic() - started < 6.0


@pytest.mark.unit
@pytest.mark.timing
def test_a_node_waiting_for_another_node_s_launcher_stops_on_sigterm(tmp_path, sigterm):
    """A Horovod node > 0 waits for node 0's launcher to finish its ranks; told to stop, it does not wait
    out the run's timeout."""
    import time

    from harness.run.nodes import wait_for_ranks

    sigterm()
    started = time.monotonic()
    assert wait_for_ranks(tmp_path, 0, timeout_s=600.0).startswith("stopped by SIGTERM from Slurm")
    assert time.monotonic() - started < 2.0


@pytest.mark.unit
@pytest.mark.parametrize(("tracing", "launches"), [("--trace-comm", 2), ("--no-trace-comm", 1)])
def test_a_horovod_node_waits_for_node_0s_measuring_and_traced_launches(
    tracing, launches, tmp_path, monkeypatch
):
    """Horovod's node 0 starts every rank, then traces in a launch of its own: node 1 gives both, each up
    to --timeout, before its isolated counterfactual (with one --timeout it gave up on a slow run)."""
    from harness.run import runner
    from harness.run.launch import LaunchResult

    args = make_parser().parse_args(
        ["run", "--backend", "horovod", "--nodes", "2", "--hosts", "a,b", "--node-rank", "1", "--device",
         "cpu", "--timeout", "100", "--compute-method", "isolated", tracing]
    )  # fmt: skip
    cfg = build_config(args, args.backend, requested_world(args))
    waited = []
    monkeypatch.setattr(runner, "launch_node", lambda *a, **k: LaunchResult([0], False, 1.0))
    monkeypatch.setattr(
        runner, "wait_for_ranks", lambda _dir, _node, timeout_s: waited.append(timeout_s) or "-"
    )
    runner.run_node(get_backend("horovod"), cfg, tmp_path, [])
    assert waited == [launches * 100.0]


def test_run_ids_are_required_across_nodes_and_never_reused(tmp_path):
    two = config("--nodes", "2", "--hosts", "a,b", "--node-rank", "0", "--device", "cpu")
    with pytest.raises(UsageError, match="give --run-id"):
        check_run_id(None, two, tmp_path)
    with pytest.raises(UsageError, match="letters, digits"):
        check_run_id("../x", two, tmp_path)
    check_run_id("job-17", two, tmp_path)
    (tmp_path / "job-17.json").write_text("{}")
    with pytest.raises(UsageError, match="used before"):
        check_run_id("job-17", two, tmp_path)
    # Node 1 may start first: its marker and its ranks' events in the shared run dir are no sign of reuse
    # to node 0; each node's own marker (and node 0's rank 0 events) are.
    one = config("--nodes", "2", "--hosts", "a,b", "--node-rank", "1", "--device", "cpu")
    run_dir = tmp_path / "logs" / "job-18"
    write_json_atomic(nodes.marker_path(run_dir, 1), {"node_rank": 1})
    events_path(run_dir, 1).write_text("")
    check_run_id("job-18", two, tmp_path)
    with pytest.raises(UsageError, match="used before"):
        check_run_id("job-18", one, tmp_path)
    events_path(run_dir, 0).write_text("")
    with pytest.raises(UsageError, match="used before"):
        check_run_id("job-18", two, tmp_path)
    events_path(run_dir, 0).unlink()
    write_json_atomic(nodes.marker_path(run_dir, 0), {"node_rank": 0})
    with pytest.raises(UsageError, match="used before"):
        check_run_id("job-18", two, tmp_path)
    proc = harness(
        "run",
        "--backend",
        "torch-ddp",
        "--nodes",
        "2",
        "--hosts",
        "a,b",
        "--node-rank",
        "1",
        "--device",
        "cpu",
        "--out",
        tmp_path,
    )
    assert proc.returncode == 2 and "give --run-id" in proc.stderr


# ---------------------------------------------------------------------------------------------- plan
def test_plan_prints_what_each_node_runs_from_the_adapters_launch(tmp_path):
    argv = [
        "--backend",
        "torch-ddp",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--hosts",
        "host-a,host-b",
        "--master",
        "host-a:29400",
        "--device",
        "cpu",
        "--run-id",
        "plan-1",
        "--out",
        str(tmp_path),
    ]
    proc = harness("plan", *argv)
    assert proc.returncode == 0, proc.stderr
    backend = get_backend("torch-ddp")
    for r in range(2):
        cfg = build_config(run_args(*argv[2:], "--node-rank", str(r)), "torch-ddp", 4)
        for p in backend.launch(cfg, (tmp_path / "logs" / "plan-1").resolve(), 29400, []).processes:
            assert shlex.join(p.argv) in proc.stdout  # the very command the real run starts
        assert f"--node-rank {r} --run-id plan-1" in proc.stdout
    assert "--nnodes=2" in proc.stdout and "--master-addr=host-a" in proc.stdout
    assert not (tmp_path / "logs").exists()  # a dry run writes nothing


# ------------------------------------------------------------------------------- two nodes on loopback
def free_ports_from(count: int) -> int:
    """A port that is free with the `count - 1` after it: TensorFlow's worker k of a multi-node job listens
    on the master port + k (backends/tf_mwms), and the port after a free one may be a neighbour's."""
    while True:
        port = free_port()
        try:
            for k in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
            return port
        except OSError:
            continue


def two_nodes(out0, out1, backend, run_id, extra=()):
    """Node 1's harness in the background, node 0's in the foreground, as on two machines (named apart,
    as launchers such as DeepSpeed's refuse one host listed twice)."""
    port = free_ports_from(2)
    common = [
        "--backend",
        backend,
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--hosts",
        "127.0.0.1,localhost",
        "--master",
        f"127.0.0.1:{port}",
        "--run-id",
        run_id,
        *SHAPE,
        *extra,
    ]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", *common, "--node-rank", "1", "--out", str(out1)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    node0 = harness("run", *common, "--node-rank", "0", "--out", out0, timeout=240)
    log1, _ = node1.communicate(timeout=240)
    return node0, node1.returncode, log1


def comparable(record: dict) -> dict:
    return {
        "world_size": record["environment"]["world_size"],
        "hosts": record["environment"]["hostnames"],
        "ranks": [(r["rank"], r["host"], r["status"]) for r in record["ranks"]],
        "status": record["status"],
    }


# One stack per multi-node launch path: torchrun's static rendezvous (torch-ddp's nodes, each writing to its
# own folder: test_nodes_without_a_shared_filesystem_are_completed_by_collect; torch-fsdp starts the same
# way), DeepSpeed's runner with a hostfile, horovodrun, TF_CONFIG per process, Paddle's launcher.
MULTI_NODE_PATHS = [name for name in backend_names() if name not in ("torch-ddp", "torch-fsdp")]
# Every stack trains torch-ddp's model with torch-ddp's update (tests/test_equivalence.py); the stacks on
# other frameworks within the cross-framework bound stated there.
SAME_FRAMEWORK_RTOL, CROSS_FRAMEWORK_ATOL = 1e-6, 3e-5


@pytest.fixture(scope="module")
def one_node_ddp(tmp_path_factory) -> dict:
    """torch-ddp with two ranks on one node: what every stack's two one-rank nodes must reproduce."""
    return ddp_reference(ISSUE_SHAPE, tmp_path_factory)


def assert_equals_one_node(multi: dict, one_node_ddp: dict) -> None:
    """The two-node record is the one-node run's: world size, hosts, ranks and their losses, step by step
    (the stacks on other frameworks within the cross-framework bound)."""
    assert comparable(multi) == comparable(one_node_ddp) and multi["status"] == "ok"
    assert (run_config(multi).topology.nodes, run_config(multi).topology.node_rank) == (2, 0)
    assert [m["node_rank"] for m in multi["launch"]["nodes"]] == [0, 1]
    framework = get_backend(multi["config"]["backend"]).framework
    for a, b in zip(one_node_ddp["ranks"], multi["ranks"]):
        assert len(b["losses"]) == len(a["losses"]), (b["losses"], a["losses"])
        if framework == "torch":
            np.testing.assert_allclose(b["losses"], a["losses"], rtol=SAME_FRAMEWORK_RTOL)
        else:
            np.testing.assert_allclose(b["losses"], a["losses"], rtol=0, atol=CROSS_FRAMEWORK_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("backend", MULTI_NODE_PATHS)
def test_two_nodes_on_loopback_equal_one_node_with_two_ranks(tmp_path, backend, one_node_ddp):
    adapter = get_backend(backend)
    ok, reason = adapter.availability()
    if not ok:
        pytest.skip(f"{backend} unavailable: {reason}")
    if not adapter.multi_node:
        pytest.skip(f"{backend} declares itself single-node (multi_node = False)")
    out = tmp_path / "results"
    node0, rc1, log1 = two_nodes(out, out, backend, f"loop-{backend}")
    assert node0.returncode == 0 and rc1 == 0, (
        f"{node0.stdout[-3000:]}\n{node0.stderr}\nnode 1:\n{log1[-3000:]}"
    )
    assert_equals_one_node(json.loads((out / f"loop-{backend}.json").read_text()), one_node_ddp)
    assert len(list(out.glob("*.json"))) == 1  # node 1 wrote no record
    assert not leftovers(out)


@pytest.mark.slow
def test_nodes_without_a_shared_filesystem_are_completed_by_collect(tmp_path, one_node_ddp):
    """torch-ddp's two nodes (torchrun's static rendezvous), each writing to its own folder: node 0's record
    names the rank it lacks, `harness collect` completes it, and the whole equals the one-node run."""
    node0, rc1, log1 = two_nodes(tmp_path / "node0", tmp_path / "node1", "torch-ddp", "apart")
    assert rc1 == 0, log1
    assert not list((tmp_path / "node1").glob("*.json"))  # node 1 wrote no record
    partial = json.loads((tmp_path / "node0" / "apart.json").read_text())
    assert partial["status"] == "crashed" and [r["rank"] for r in partial["ranks"]] == [0]
    assert "harness collect" in partial["error"]["message"]
    proc = harness("collect", tmp_path / "node0" / "logs" / "apart", tmp_path / "node1" / "logs" / "apart")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "node0" / "apart.json").read_text())
    assert record["status"] == "ok" and [r["rank"] for r in record["ranks"]] == [0, 1]
    assert_equals_one_node(record, one_node_ddp)
    assert not leftovers(tmp_path)
