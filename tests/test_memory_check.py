"""A run whose ranks cannot fit this node's memory is refused before anything launches (one line with the
estimate, exit 2), from each stack's measured footprint (harness.run.footprint); one that fits, or one told
--skip-memory-check, goes on. No launch: the node's memory is a figure the tests set."""

from __future__ import annotations

import pytest

from backends import all_backends, get_backend
from core.config import RunConfig
from harness.cli import main, make_parser
from harness.run import footprint
from harness.run.footprint import FIELDS, cgroup_available, check_fits, estimate
from harness.run.options import run_request
from harness.usage import UsageError
from workloads.spec import PRESETS

pytestmark = pytest.mark.unit

GiB = 1 << 30


@pytest.fixture
def node_has(monkeypatch):
    """Set what this node has (bytes) as the check reads it."""

    def have(nbytes: int) -> None:
        monkeypatch.setattr(footprint, "node_available", lambda: (nbytes, "available"))

    return have


def config(*argv: str) -> RunConfig:
    args = make_parser("run").parse_args(["run", *argv])
    request = run_request(args)
    return request.config(args.backend, request.world)


def cpu_config(backend: str, n: int, **settings) -> RunConfig:
    return RunConfig.build(
        backend=backend, workload="tiny", spec=PRESETS["tiny"], world_size=n, device="cpu", **settings
    )


@pytest.mark.parametrize("backend", [b.name for b in all_backends()])
def test_every_stack_keeps_its_measured_footprint(backend):
    """A shipped stack without its footprint would run unchecked: each keeps one, measured on a real run."""
    found = get_backend(backend).footprint()
    assert found is not None, f"{backend}: no {get_backend(backend).footprint_path()}"
    assert all(isinstance(found[k], int) and found[k] >= 0 for k in FIELDS), found
    assert found["worker_bytes"] > 0 and found["harness_bytes"] > 0
    assert found["measured"]["how"] == f"python -m harness.run.footprint --backend {backend} --write"


def test_a_run_that_does_not_fit_is_refused_with_its_estimate(node_has, out, capsys):
    node_has(2 * GiB)
    code = main(["run", "--backend", "torch-ddp", "--gpus", "32", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    ddp = get_backend("torch-ddp")
    need = estimate(ddp, cpu_config("torch-ddp", 32), ddp.footprint())
    per_worker, once, total = (footprint.fmt_bytes(need[k]) for k in ("per_worker", "once", "total"))
    assert f"32 x {per_worker} a worker (" in err and f" + {once} once = {total}" in err
    assert "the node has 2.0 GiB available" in err
    assert "fewer --gpus" in err and "--skip-memory-check" in err
    assert not out.exists() or not list(out.iterdir()), "nothing is written for a refused run"


def test_a_sweep_is_refused_before_its_first_run(node_has, out, capsys):
    node_has(2 * GiB)
    code = main(["sweep", "--backends", "torch-ddp", "--gpus", "1,32", "--device", "cpu", "--out", str(out)])
    assert code == 2
    assert "torch-ddp with 32 cpu workers would not fit" in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())


def test_a_run_that_fits_goes_and_the_override_skips_the_check(node_has):
    node_has(64 * GiB)
    assert config("--backend", "torch-ddp", "--gpus", "32", "--device", "cpu").topology.world_size == 32
    node_has(1)
    with pytest.raises(UsageError, match="would not fit"):
        config("--backend", "torch-ddp", "--gpus", "2", "--device", "cpu")
    config("--backend", "torch-ddp", "--gpus", "2", "--device", "cpu", "--skip-memory-check")


def test_the_estimate_is_the_footprint_plus_the_model_state_per_worker():
    """harness + launcher + shared + N x (worker + the rank's analytic model state) on a CPU; on a GPU the
    model lives on the device; each node counts its own ranks."""
    ddp, fp = get_backend("torch-ddp"), get_backend("torch-ddp").footprint()
    cfg = cpu_config("torch-ddp", 8)
    need = estimate(ddp, cfg, fp)
    state = ddp.model_state_bytes(cfg)["total"]
    assert need["per_worker"] == int(fp["worker_bytes"] + state) and need["workers"] == 8
    once = fp["harness_bytes"] + fp["shared_bytes"] + fp["launcher_bytes"]
    assert need["total"] == int(8 * (fp["worker_bytes"] + state) + once)
    assert estimate(ddp, cfg.evolve(device="cuda"), fp)["per_worker"] == fp["worker_bytes"]
    two_nodes = cpu_config("torch-ddp", 8, nodes=2, gpus_per_node=4, hosts=["a", "b"], master_addr="a")
    assert estimate(ddp, two_nodes, fp)["workers"] == 4


def test_the_isolated_counterfactual_counts_a_launcher_and_the_whole_model_per_worker():
    fsdp = get_backend("torch-fsdp")
    fp = {"worker_bytes": 100, "shared_bytes": 10, "launcher_bytes": 1 << 30, "harness_bytes": 1}
    cfg = cpu_config("torch-fsdp", 4, compute_method="isolated")
    need = estimate(fsdp, cfg, fp)
    whole = cfg.model.spec.model_state_bytes()["total"]  # a process group of one shards nothing
    assert need["launch"] == "isolated"
    assert need["total"] == int(4 * (100 + (1 << 30) + whole) + 11)
    assert estimate(fsdp, cfg.evolve(compute_method="none"), fp)["launch"] == "run"


def test_a_stack_without_a_footprint_runs_unchecked(monkeypatch):
    ddp = get_backend("torch-ddp")
    monkeypatch.setattr(type(ddp), "footprint", lambda self: None)
    note = check_fits(ddp, cpu_config("torch-ddp", 32), available=lambda: (1, "available"))
    assert note is not None and "not checked" in note


def test_the_cgroup_limit_counts_where_one_is_set(tmp_path):
    own = tmp_path / "cgroup"
    own.write_text("0::/job\n")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text(f"{8 * GiB}\n")
    (tmp_path / "job" / "memory.current").write_text(f"{3 * GiB}\n")
    (tmp_path / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {GiB}\n")
    assert cgroup_available(tmp_path, own) == 6 * GiB  # the limit less what cannot be reclaimed
    (tmp_path / "job" / "memory.max").write_text("max\n")
    assert cgroup_available(tmp_path, own) is None
