"""The device contract, checked through each launcher's own rules: for every backend, on one node and on two,
with and without the user's CUDA_VISIBLE_DEVICES, every rank and every isolated-counterfactual worker must
land on the physical GPU the runner chose for it (harness/run/devices.py).

Nothing is launched: the runner's launch plans are read by a small model of each launcher (how it turns its
flags and environment into a worker's device), written from the launchers' sources. The isolated worker k
must share rank k's device, or the counterfactual measures a different machine than the run it explains.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

import harness.run.nodes as nodes
import harness.run.runner as runner
from backends import backend_names, get_backend
from backends.base import CUDA_MASK, LaunchPlan
from harness.arguments import requested_world
from harness.cli import make_parser
from harness.run.launch import LaunchResult
from harness.run.options import build_config
from harness.run.runner import isolated_plans, node_plan, run_node

pytestmark = pytest.mark.unit

MACHINE_GPUS = [str(i) for i in range(8)]  # what a launcher sees on a node without a mask
HOSTS = ["host-a", "host-b"]
MASTER_PORT = 29500
PER_NODE = 2
FRAMEWORKS = ("torch", "tensorflow", "paddle", "deepspeed", "horovod")


# ------------------------------------------------------------------------------------ the launchers' rules
def flags(argv: list[str]) -> dict[str, str]:
    """--name=value options of a command line."""
    return dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def launch_env(proc) -> dict[str, str]:
    """The environment the process starts with (as harness.run.launch.run_processes builds it)."""
    return {**os.environ, **proc.env}


def visible(env: dict[str, str]) -> list[str]:
    """The physical GPUs a process sees, in its cuda:i order."""
    if CUDA_MASK not in env:
        return list(MACHINE_GPUS)
    return [d.strip() for d in env[CUDA_MASK].split(",") if d.strip()]


def gpu(env: dict[str, str], i: int) -> str | None:
    """The physical GPU behind cuda:i for a process with this environment (None: no such device)."""
    seen = visible(env)
    return seen[i] if i < len(seen) else None


def only(plan: LaunchPlan):
    assert len(plan.processes) == 1, f"expected one launcher process, got {plan.processes}"
    return plan.processes[0]


def torchrun(plan: LaunchPlan) -> dict[int, str | None]:
    """torchrun: the launcher's environment goes to every worker; local rank i uses cuda:i."""
    proc = only(plan)
    f = flags(proc.argv)
    n, node = int(f["--nproc-per-node"]), int(f["--node-rank"])
    env = launch_env(proc)
    return {node * n + i: gpu(env, i) for i in range(n)}


def horovodrun(plan: LaunchPlan) -> dict[int, str | None]:
    """horovodrun: ranks fill -H's hosts in order; its environment goes to every worker on every host;
    local rank i uses cuda:i."""
    if not plan.processes:
        return {}
    proc = only(plan)
    argv = proc.argv
    np_, hosts = int(argv[argv.index("-np") + 1]), argv[argv.index("-H") + 1]
    env = launch_env(proc)
    ranks, k = {}, 0
    for spec in hosts.split(","):
        _, slots = spec.rsplit(":", 1)
        for i in range(int(slots)):
            if k < np_:
                ranks[k] = gpu(env, i)
                k += 1
    assert k == np_, f"-np {np_} but -H {hosts}"
    return ranks


def deepspeed_runner(plan: LaunchPlan) -> dict[int, str | None]:
    """deepspeed.launcher.runner (+ launch): the resources are the hostfile's slots, else this machine's
    GPUs; without a hostfile a CUDA_VISIBLE_DEVICES is dropped when --include/--num_gpus is given (and turned
    into --include=localhost:<mask> otherwise); --include picks slots (each must exist), --num_gpus the
    first n; the node's workers are then masked to its host's slots, local rank i on cuda:i."""
    proc = only(plan)
    f = flags(proc.argv)
    env = launch_env(proc)
    include, num_gpus = f.get("--include", ""), int(f.get("--num_gpus", -1))
    if include and num_gpus >= 0:
        raise ValueError("Cannot specify num_nodes/gpus with include/exclude")
    if "--hostfile" in f:
        content = plan.files[Path(f["--hostfile"])]  # written by the runner before the launch
        pool = {h: int(s) for h, s in re.findall(r"^(\S+)\s+slots=(\d+)\s*$", content, re.M)}
    else:
        if env.get(CUDA_MASK):
            if not include and num_gpus < 0:
                include = f"localhost:{env[CUDA_MASK]}"
            del env[CUDA_MASK]
        pool = {"localhost": len(visible(env))}
    active = {h: list(range(s)) for h, s in pool.items()}
    if include:
        chosen = {}
        for spec in include.split("@"):
            host, _, slots = spec.partition(":")
            if host not in active:
                raise ValueError(f"Hostname '{host}' not found in hostfile")
            ids = [int(s) for s in slots.split(",")] if slots else active[host]
            for s in ids:
                if s not in active[host]:
                    raise ValueError(f"No slot '{s}' specified on host '{host}'")
            chosen[host] = ids
        active = {h: chosen[h] for h in active if h in chosen}
    if num_gpus > 0:
        active = {h: list(range(num_gpus)) for h in active}
    node = int(f.get("--node_rank", 0))
    host = list(active)[node]
    first = sum(len(active[h]) for h in list(active)[:node])
    return {first + i: str(slot) for i, slot in enumerate(active[host])}


def tf_workers(plan: LaunchPlan) -> dict[int, str | None]:
    """No launcher: each worker process is started with its own mask and its rank in DISTBENCH_RANK."""
    ranks = {}
    for proc in plan.processes:
        env = launch_env(proc)
        rank = int(env["DISTBENCH_RANK"])
        assert rank not in ranks, f"two workers of rank {rank}"
        ranks[rank] = gpu(env, 0)
    return ranks


def paddle_launch(plan: LaunchPlan) -> dict[int, str | None]:
    """paddle.distributed.launch: --devices are labels looked up in CUDA_VISIBLE_DEVICES (or the machine's
    GPUs); local rank i gets FLAGS_selected_gpus = the index of devices[i] there, and uses that index inside
    the mask."""
    proc = only(plan)
    f = flags(proc.argv)
    env = launch_env(proc)
    labels = visible(env)
    n, node = int(f["--nproc_per_node"]), int(f.get("--rank", 0))
    # list.index raises ValueError for a device that is not in the mask, as the launcher does
    selected = (
        [labels.index(d.strip()) for d in f["--devices"].split(",")]
        if "--devices" in f
        else list(range(len(labels)))
    )
    assert len(selected) >= n, f"{n} workers but devices {selected}"
    return {node * n + i: gpu(env, selected[i]) for i in range(n)}


LAUNCHERS = {
    "torch-ddp": torchrun,
    "torch-fsdp": torchrun,
    "horovod": horovodrun,
    "deepspeed": deepspeed_runner,
    "tf-mwms": tf_workers,
    "paddle-fleet": paddle_launch,
}


def launcher_model(backend: str):
    assert backend in LAUNCHERS, f"no launcher model for backend {backend}: add one to {__file__}"
    return LAUNCHERS[backend]


# ------------------------------------------------------------------------------------------- the configs
def node_configs(backend: str, n_nodes: int, device: str, *extra: str) -> list:
    """The RunConfig every node's harness builds, as `harness run` on that node would."""
    layout = (
        ["--nodes", "2", "--hosts", ",".join(HOSTS), "--master", f"{HOSTS[0]}:{MASTER_PORT}"]
        if n_nodes > 1
        else []
    )
    args = make_parser().parse_args(
        ["run", "--backend", backend, "--gpus-per-node", str(PER_NODE), *layout, "--device", device, *extra]
    )
    return [
        build_config(args, backend, requested_world(args), check_devices=False, node_rank=r)
        for r in range(n_nodes)
    ]


@pytest.fixture(params=[None, "4,6"], ids=["no-mask", "mask-4,6"])
def mask(request, monkeypatch) -> list[str] | None:
    if request.param is None:
        monkeypatch.delenv(CUDA_MASK, raising=False)
        return None
    monkeypatch.setenv(CUDA_MASK, request.param)
    return request.param.split(",")


def expected_device(mask: list[str] | None, rank: int) -> str:
    """Rank k's physical GPU: the (k mod per-node)-th of the user's mask, or of the machine's GPUs."""
    return mask[rank % PER_NODE] if mask else str(rank % PER_NODE)


# --------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("n_nodes", [1, 2])
@pytest.mark.parametrize("backend", backend_names())
def test_every_rank_runs_on_its_physical_gpu(backend, n_nodes, mask, tmp_path):
    model, adapter, run_dir = launcher_model(backend), get_backend(backend), tmp_path / "logs" / "run"
    cfgs = node_configs(backend, n_nodes, "cuda")
    started: dict[int, str | None] = {}
    for cfg in cfgs:
        plan = node_plan(adapter, cfg, run_dir, cfg.topology.master_port or MASTER_PORT)
        if adapter.starts_remote_ranks and cfg.topology.node_rank > 0:
            assert plan.processes == [], (
                f"node {cfg.topology.node_rank} must leave its ranks to node 0's launcher"
            )
        ranks = model(plan)
        twice = set(ranks) & set(started)
        assert not twice, f"{backend}: ranks {sorted(twice)} started by two nodes"
        started.update(ranks)
    world = PER_NODE * n_nodes
    assert started == {k: expected_device(mask, k) for k in range(world)}
    assert not run_dir.exists(), "launch plans must not write anything"


@pytest.mark.parametrize("n_nodes", [1, 2])
@pytest.mark.parametrize("backend", backend_names())
def test_isolated_worker_k_runs_on_rank_ks_gpu(backend, n_nodes, mask, tmp_path):
    model, adapter, run_dir = launcher_model(backend), get_backend(backend), tmp_path / "logs" / "run"
    seen = []
    for cfg in node_configs(backend, n_nodes, "cuda"):
        plans = isolated_plans(adapter, cfg, run_dir)
        assert len(plans) == cfg.topology.gpus_per_node
        for k, plan in enumerate(plans, start=cfg.first_local_rank):
            assert len(plan.processes) == 1, f"isolated worker {k} is {len(plan.processes)} processes"
            assert f'"isolated_index": {k}' in plan.files[run_dir / f"isolated{k}" / "config.json"]
            devices = model(plan)
            assert devices == {0: expected_device(mask, k)}, f"{backend}: isolated worker {k} on {devices}"
            seen.append(k)
    assert seen == list(range(PER_NODE * n_nodes))
    assert not run_dir.exists(), "launch plans must not write anything"


@pytest.mark.parametrize("n_nodes", [1, 2])
@pytest.mark.parametrize("backend", backend_names())
def test_cpu_plans_set_no_gpu_mask(backend, n_nodes, mask, tmp_path):
    """On CPU no launcher is handed a mask (tf-mwms hides every GPU from its workers with an empty one), and
    DeepSpeed, which would count GPUs, is told the number of workers."""
    adapter = get_backend(backend)
    run_dir = tmp_path / "logs" / "run"
    for cfg in node_configs(backend, n_nodes, "cpu"):
        plans = [
            node_plan(adapter, cfg, run_dir, cfg.topology.master_port or MASTER_PORT),
            *isolated_plans(adapter, cfg, run_dir),
        ]
        for plan in plans:
            for proc in plan.processes:
                if backend == "tf-mwms":
                    assert proc.env[CUDA_MASK] == ""
                else:
                    assert CUDA_MASK not in proc.env, f"{backend}: {CUDA_MASK}={proc.env[CUDA_MASK]} on CPU"
                assert not any(a.startswith(("--devices", "--include")) for a in proc.argv), proc.argv
        if backend == "deepspeed" and n_nodes == 1:
            assert "--num_gpus=2" in only(plans[0]).argv
            assert all("--num_gpus=1" in only(p).argv for p in plans[1:])
        if backend == "deepspeed" and n_nodes == 2:
            assert plans[0].files[run_dir / "hostfile"] == "host-a slots=2\nhost-b slots=2\n"


def test_every_backend_has_a_launcher_model():
    assert set(backend_names()) <= set(LAUNCHERS)


def test_horovod_node1_isolated_workers_wait_for_node0s_launcher(tmp_path, monkeypatch):
    """horovodrun on node 0 runs node 1's ranks too: node 1's isolated workers, on the same GPUs, must not
    start before node 0's launcher has exited, although node 1's own (empty) launch returns at once."""
    monkeypatch.setattr(nodes, "POLL_S", 0.02)
    monkeypatch.delenv(CUDA_MASK, raising=False)  # a one-GPU mask here would refuse 2 ranks per node
    calls, lock = [], threading.Lock()

    def fake_run_processes(processes, log_path, timeout_s, cwd=None, leftovers=None):
        start = time.monotonic()
        if Path(log_path).name == "launcher.log":  # node 0's horovodrun, running every node's ranks
            time.sleep(1.0)
        end = time.monotonic()
        with lock:
            calls.append((Path(log_path).name, len(processes), start, end))
        return LaunchResult([0] * len(processes), False, end - start)

    monkeypatch.setattr(runner, "run_processes", fake_run_processes)
    adapter = get_backend("horovod")
    assert adapter.starts_remote_ranks
    cfgs = node_configs("horovod", 2, "cuda", "--compute-method", "isolated", "--timeout", "20")
    run_dir = tmp_path / "logs" / "hvd"
    markers, errors = {}, []

    def node(cfg):
        try:
            markers[cfg.topology.node_rank] = run_node(adapter, cfg, run_dir, ["harness", "run"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(cfg,)) for cfg in reversed(cfgs)]  # node 1 first
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert set(markers) == {0, 1}
    assert all(m["isolated_error"] is None for m in markers.values()), markers
    by_log = {name: (n, start, end) for name, n, start, end in calls}
    assert set(by_log) == {"launcher.log", "launcher.node1.log", "isolated.log", "isolated.node1.log"}
    assert by_log["launcher.node1.log"][0] == 0  # node 1 starts no ranks itself
    assert by_log["isolated.log"][0] == by_log["isolated.node1.log"][0] == 2
    node0_launch_end, node1_isolated_start = by_log["launcher.log"][2], by_log["isolated.node1.log"][1]
    assert node1_isolated_start >= node0_launch_end, (
        f"node 1's isolated workers started {node0_launch_end - node1_isolated_start:.2f} s before node 0's "
        "launcher (running node 1's ranks) exited"
    )


def test_no_framework_was_imported():
    assert not [m for m in FRAMEWORKS if m in sys.modules]
