"""Every stack's own collective and rendezvous waits follow the run's collective timeout (the run's --timeout
unless --collective-timeout says otherwise), so a busy or oversubscribed node waits as long as the run allows
instead of failing at a framework default (torchrun's 600 s rendezvous, horovodrun's 30 s start and gloo
timeouts, MWMS's 10 s health check, Paddle's NCCL groups' 30 min).

Data only, nothing launched: each adapter states its waits, by knob, in Backend.timeouts(cfg); the launch plan
carries those its launcher takes (argv or environment), and the worker side reads the others from there. A
stack that drops a knob, sets one to a constant, or leaves its launcher at the default fails here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_device_contract import node_configs

import backends.base
from backends import backend_names, get_backend
from backends.horovod_torch import HOROVOD_GLOO_TIMEOUT, HOROVOD_START_TIMEOUT
from backends.paddle_fleet import PADDLE_NCCL_TIMEOUT
from backends.tf_mwms import TF_PEER_CHECK, TF_PEER_CHECK_TRIES
from harness.run.runner import node_plan

pytestmark = pytest.mark.unit

BACKENDS_DIR = Path(backends.base.__file__).parent
# Two collective timeouts no framework has as its default, one with a fraction of a second
TIMEOUTS = (1234.5, 77.0)


def waits(backend: str, timeout: float, nodes: int = 1) -> list[tuple]:
    """(config, the adapter's timeouts, every process of every node's plan) for a CPU run of 2 ranks per
    node with this collective timeout."""
    adapter = get_backend(backend)
    out = []
    for cfg in node_configs(backend, nodes, "cpu", "--collective-timeout", str(timeout)):
        assert cfg.collective_timeout == timeout
        plan = node_plan(adapter, cfg, Path("/nonexistent/run"), 29500)
        out.append((cfg, adapter.timeouts(cfg), plan.processes))
    return out


@pytest.mark.parametrize("backend", backend_names())
def test_every_stack_states_its_waits_and_each_follows_the_collective_timeout(backend):
    """At least one knob per stack; each in proportion to the run's collective timeout (one wait, or each
    try of several), never under a third of it, and the same knobs whatever the timeout."""
    (cfg_a, a, _), (cfg_b, b, _) = (waits(backend, t)[0] for t in TIMEOUTS)
    assert a, f"{backend} states none of its own waits (Backend.timeouts)"
    assert a.keys() == b.keys()
    for knob in a:
        assert a[knob] / cfg_a.collective_timeout == pytest.approx(b[knob] / cfg_b.collective_timeout), knob
        assert a[knob] >= cfg_a.collective_timeout / 3 - 1e-9, knob


def test_mwms_gives_a_silent_peer_the_whole_collective_timeout_over_its_tries():
    """MWMS declares a peer down after TF_PEER_CHECK_TRIES unanswered pings: together they wait the run's
    collective timeout, not TensorFlow's 3 x 10 s."""
    for timeout in TIMEOUTS:
        (cfg, t, _) = waits("tf-mwms", timeout)[0]
        assert t[TF_PEER_CHECK] * TF_PEER_CHECK_TRIES == pytest.approx(cfg.collective_timeout)


def argv_value(argv: list[str], flag: str) -> str:
    """The value of `--flag=value` or `--flag value` in a command line."""
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return argv[i + 1]
    raise AssertionError(f"{flag} not in {argv}")


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_the_launchers_are_given_the_collective_timeout(timeout, nodes):
    """What each launcher is told, on every node that starts one: torchrun's rendezvous store (static:
    --rdzv-conf timeout), horovodrun's start and gloo timeouts, Paddle's NCCL group timeout (ms, in the
    environment the launcher passes its workers), each rounded up to the unit the launcher takes."""
    for backend in ("torch-ddp", "torch-fsdp"):
        for _, t, procs in waits(backend, timeout, nodes):
            seconds = t[backends.base.TORCHRUN_RENDEZVOUS]
            assert [argv_value(p.argv, "--rdzv-conf") for p in procs] == [f"timeout={math.ceil(seconds)}"]
    started = [procs for _, _, procs in waits("horovod", timeout, nodes) if procs]
    assert len(started) == 1  # node 0's horovodrun starts every node's workers
    t, procs = waits("horovod", timeout, nodes)[0][1], started[0]
    flags = {HOROVOD_START_TIMEOUT: "--start-timeout", HOROVOD_GLOO_TIMEOUT: "--gloo-timeout-seconds"}
    for knob, flag in flags.items():
        assert argv_value(procs[0].argv, flag) == str(math.ceil(t[knob])), flag
    for _, t, procs in waits("paddle-fleet", timeout, nodes):
        assert [p.env[PADDLE_NCCL_TIMEOUT] for p in procs] == [str(math.ceil(t[PADDLE_NCCL_TIMEOUT] * 1000))]


def knob_names(backend: str, knob: str) -> list[str]:
    """The module-level names an adapter (or backends.base, for what stacks share) gives a knob."""
    module = __import__(type(get_backend(backend)).__module__, fromlist=["_"])
    return [n for m in (module, backends.base) for n, v in vars(m).items() if v == knob and n.isupper()]


def worker_sources(backend: str) -> str:
    """A stack's worker side: its own package's modules but its adapter (__init__.py), and the worker code
    the stacks share at the top of backends/ (torch_common.py, loop.py, ...), never another stack's."""
    package = BACKENDS_DIR / type(get_backend(backend)).__module__.split(".")[1]
    files = [p for p in package.rglob("*.py") if p.name != "__init__.py"]
    files += [p for p in BACKENDS_DIR.glob("*.py") if p.name not in ("__init__.py", "base.py")]
    return "\n".join(p.read_text() for p in files)


# The knobs a launcher takes (test_the_launchers_are_given_the_collective_timeout checks each plan)
LAUNCHED = {
    backends.base.TORCHRUN_RENDEZVOUS,
    HOROVOD_START_TIMEOUT,
    HOROVOD_GLOO_TIMEOUT,
    PADDLE_NCCL_TIMEOUT,
}


@pytest.mark.parametrize("backend", backend_names())
def test_every_other_wait_is_read_by_the_worker(backend):
    """A knob no launcher takes is one the worker sets: the worker side reads it from the adapter's
    timeouts() by its name (`timeouts(cfg)[NAME]`), so a stack whose worker keeps a framework default, or
    sets its own number, fails."""
    worker = worker_sources(backend)
    for knob in get_backend(backend).timeouts(waits(backend, TIMEOUTS[0])[0][0]):
        names = knob_names(backend, knob)
        assert names, f"{backend}: knob {knob!r} has no name in its adapter"
        if knob not in LAUNCHED:
            assert any(f"[{n}]" in worker for n in names), f"{backend}: no worker reads {knob!r}"
