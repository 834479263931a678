"""Shared test helpers. The pytest process imports no ML framework: training runs go through the CLI.

Tiers: `-m unit` is the in-process tier (no framework, no subprocess: a unit test that starts one fails,
unless it is marked `subprocess`), a minute or two in all; everything else is the integration tier, which
launches real multi-process training runs (`slow` marks the long ones).

Two test processes run at once (pytest-xdist, pyproject.toml's addopts), a module's tests in one of them.
A test marked `timing` asserts on elapsed times or on the ratio of two runs' times, which a neighbour's
launches would skew: it runs alone (`share_the_machine`), so no test fails on a busy machine when the code
is right.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from core.records import run_config

REPO = Path(__file__).resolve().parent.parent


def harness(*args, timeout=300) -> subprocess.CompletedProcess:
    """Run `python -m harness ARGS` from the repo root."""
    return subprocess.run(
        [sys.executable, "-m", "harness", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_record(out: Path, *args, expect_rc=0, timeout=300) -> dict:
    """`harness run ARGS --out OUT`, check its exit code, and return the record it wrote."""
    return run_with_output(out, *args, expect_rc=expect_rc, timeout=timeout)[0]


def run_with_output(out: Path, *args, expect_rc=0, timeout=300) -> tuple[dict, str]:
    """run_record, and what `harness run` printed (its progress lines: stdout is not a terminal here)."""
    before = set(out.glob("*.json")) if out.exists() else set()
    proc = harness("run", *args, "--out", out, timeout=timeout)
    if expect_rc is not None:  # None: any exit code, the record says how the run ended
        assert proc.returncode == expect_rc, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    new = sorted(set(out.glob("*.json")) - before)
    assert len(new) == 1, f"expected one new record in {out}, got {new}"
    return json.loads(new[0].read_text()), proc.stdout


# Taken and freed by every rank of the shared 2-rank CPU runs before its first step (core.hooks), where
# the GPU tier's CPU rehearsal reads their peak (tests/test_gpu_tier.py): about twice such a rank's whole
# RSS (torch and a tiny model, ~0.5 GiB), so a peak that still holds it was not reset; not more, as every
# run that carries it touches each of its pages.
CPU_WARMUP_TRANSIENT_BYTES = 1 << 30


@pytest.fixture
def out(tmp_path) -> Path:
    return tmp_path / "results"


MACHINE_TESTS = "DISTBENCH_MACHINE_TESTS"


def pytest_collection_modifyitems(items):
    """Every test that is not a unit test is an integration test. Tests that change the machine (`machine`:
    they install packages or edit /etc/hosts) run only where the environment asks for them (.ci/run does, on
    its throw-away machine), so a plain `pytest` on a developer's machine leaves it as it was."""
    opted_in = os.environ.get(MACHINE_TESTS) == "1"
    for item in items:
        if not item.get_closest_marker("unit"):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("machine") and not opted_in:
            item.add_marker(pytest.mark.skip(reason=f"changes this machine: set {MACHINE_TESTS}=1 to run it"))

    # Under `--dist loadscope` each process takes the next module when it finishes one, in this order: the
    # modules with the most slow tests first, so that the short ones fill in at the end, and the modules
    # of `timing` tests alone last, where running alone costs the other process least.
    def module(item) -> str:
        return item.nodeid.split("::")[0]

    slow = Counter(module(item) for item in items if item.get_closest_marker("slow"))
    untimed = Counter(module(item) for item in items if not item.get_closest_marker("timing"))
    items.sort(key=lambda item: (not untimed[module(item)], -slow[module(item)]))


def xdist_run_path() -> Path | None:
    """Where this pytest-xdist run's processes keep what they share (its lock files, saved references),
    named by the run's id; None without xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return None if run is None else Path(tempfile.gettempdir()) / f"distbench-tests-{run}"


@contextlib.contextmanager
def share_the_machine(alone: bool):
    """Under pytest-xdist: a readers-writer lock over this test run's processes, held for a whole test
    (its fixtures' set-up and tear-down included). Every test holds it shared; a `timing` test holds it
    alone and so waits for the running tests to end. The turnstile gives a waiting `timing` test its turn:
    while it waits, no new test takes the shared lock. Without xdist (`-n 0`) tests run one at a time."""
    base = xdist_run_path()
    if base is None:
        yield
        return
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


_launched: dict[str, dict] = {}


def launched_once(key: str, launch) -> dict:
    """The record `launch()` returns, launched once per test run whichever test asks first: reference runs
    that several modules compare against. Under pytest-xdist the first process to ask launches it while it
    holds a lock on `key`, and the other reads the record it saved (a launch that fails saves nothing, and
    the next to ask tries again)."""
    if key in _launched:
        return _launched[key]
    folder = xdist_run_path()
    if folder is None:
        _launched[key] = launch()
        return _launched[key]
    folder.mkdir(exist_ok=True)
    saved = folder / f"{key}.json"
    with open(folder / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            record = launch()
            saved.with_suffix(".tmp").write_text(json.dumps(record))
            saved.with_suffix(".tmp").rename(saved)
    _launched[key] = json.loads(saved.read_text())
    return _launched[key]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with share_the_machine(alone=item.get_closest_marker("timing") is not None):
        return (yield)


@pytest.fixture(scope="session", autouse=True)
def matplotlib_font_cache():
    """matplotlib builds its font cache on its first import on a machine, asking `fc-list` in a subprocess:
    build it before any unit test (which may not start a process) imports it, as on a fresh CI machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request, monkeypatch):
    """The unit tier's rule, checked rather than remembered: no subprocess unless marked `subprocess`."""
    if request.node.get_closest_marker("unit") and not request.node.get_closest_marker("subprocess"):

        def refuse(*args, **kwargs):
            raise AssertionError(
                "a unit test started a process; mark it `subprocess` or make it an integration test"
            )

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def assert_exposed_as_measured(summary: dict) -> None:
    """A live run's exposed-communication ratio, within the gross bounds a loaded machine leaves: below 1;
    below 0 only where the anatomy's interval of the exposed part spans 0 (noise: the sync-off steps no
    faster than the synced ones); null only where that part is unresolved (slower beyond its noise). Never
    clamped: tests/test_metrics.py holds the definition on recorded times."""
    ratio, part = summary["exposed_comm_ratio"], summary["anatomy"]["parts"]["exposed_comm"]
    if ratio is None:
        assert part["status"] == "unresolved", part
        return
    assert ratio < 1.0, summary
    assert ratio >= 0.0 or part["ci"][0] < 0 < part["ci"][1], part


def assert_traced_steps_follow_the_schedule(rec: dict, in_order: bool = True) -> None:
    """Each traced step of every rank issued the collectives the stack's schedule declares for this
    configuration (its adapter's `schedule`, which the prediction replays and the analytic volume sums):
    the same ops and sizes, in the same order where `in_order` (FSDP2's prefetch interleaves its gathers
    otherwise), so the predicted communication is the stack's."""
    from collections import Counter

    from backends import get_backend

    cfg = run_config(rec)
    messages = get_backend(cfg.backend).schedule(cfg).messages
    expected = [(m.op, m.size_bytes) for m in messages]
    for r in rec["ranks"]:
        trace = r["comm_trace"]
        calls = [(c["op"], c["size_bytes"]) for c in trace["collectives"]]
        assert len(calls) == len(expected) * trace["steps"], (r["rank"], calls, expected)
        for step in range(trace["steps"]):
            issued = calls[step * len(expected) : (step + 1) * len(expected)]
            if in_order:
                assert issued == expected, (r["rank"], step, issued, expected)
            else:
                assert Counter(issued) == Counter(expected), (r["rank"], step, issued, expected)


# How close the predicted model state (Backend.model_state_bytes: `harness select`'s and `harness predict`'s
# model_state term) is held to what the heaviest rank measured at the optimizer step's boundary: 2%, as the
# sharded stacks pad their flat partitions and Paddle's stage 1 gives each rank whole tensors (measured up to
# 1.5% over an even share on the test shapes).
MODEL_STATE_RTOL = 0.02


def assert_model_state_as_predicted(rec: dict) -> None:
    """Parameters and optimizer state as predicted. Gradients: the predicted peak is worked out here from
    the stack's declared sharding (whole where it leaves gradients whole, none and optimizer sharding alike,
    as ZeRO-1's backward holds them whole; a rank's share where it shards them), and what a rank holds lies
    between its share and that peak, as a stack may free what it reduced before the boundary (DeepSpeed's
    ZeRO-1 keeps only its partition once reduced), plus up to one tensor's fp32 gradient (DeepSpeed's
    ZeRO-1/2 keep whole the gradient of a tensor their partition boundary cuts: 8% over the share on the
    test shapes)."""
    from backends import get_backend
    from backends.base import parameter_numels
    from harness.predict.memory import peak_memory
    from workloads.spec import SHARDING_LEVELS

    cfg = run_config(rec)
    backend = get_backend(cfg.backend)
    predicted = backend.model_state_bytes(cfg)
    assert peak_memory(cfg)["model_state"] == predicted["total"]  # wiring: select sizes by this term
    held = {k: max(r["model_state_bytes"][k] for r in rec["ranks"]) for k in predicted}
    what = (rec["backend_info"]["label"], held, predicted)
    for part in ("params", "optimizer"):
        assert held[part] == pytest.approx(predicted[part], rel=MODEL_STATE_RTOL), what
    whole = cfg.model.spec.model_state_bytes(cfg.model.precision, backend.precision_scheme(cfg))["grads"]
    share = whole / cfg.topology.world_size  # a rank's share of the unsharded gradients
    shards_gradients = SHARDING_LEVELS.index(backend.sharding(cfg)) >= SHARDING_LEVELS.index("gradients")
    peak = share if shards_gradients else whole
    assert predicted["grads"] == pytest.approx(peak, rel=MODEL_STATE_RTOL), what
    tensor = 4 * max(parameter_numels(cfg).values())
    assert share * (1 - MODEL_STATE_RTOL) <= held["grads"] <= peak * (1 + MODEL_STATE_RTOL) + tensor, what


def assert_cpu_worker_probes(rec: dict) -> None:
    """What every framework family's CPU ranks record of themselves: the fp32 math mode (TF32 is a GPU
    matter, so None here, but core.precision's fp32 rule ran: every TF32 switch of the framework set to IEEE
    and read back) and the peak-RSS scope after the loop's reset at the end of warm-up, with no allocator
    peak or NVML sample on a CPU."""
    for r in rec["ranks"]:
        assert r["device"].startswith("cpu")
        mode = r["math_mode"]
        assert mode["tf32"] is None  # not applicable on CPU: neither True nor False
        switches = mode["tf32_setting"].split(", ")
        assert switches and all(s.endswith(("=ieee", "=False")) for s in switches), switches
        assert mode["numerics"]["compute"] == "fp32" and mode["numerics"]["observed"]["tf32"] is False
        memory = r["memory"]
        assert memory["peak_rss_scope"] == "after warm-up" and memory["peak_rss"] > 50e6
        assert set(memory) == {"peak_rss", "peak_rss_scope"}, memory
