"""The anatomy of a step (harness/analyze/anatomy.py) held to the truth: each stack at 2 ranks on CPU, with
a known delay slept in each part of every step (core.hooks part_delays), must show each delay in its own
part and nowhere else, and its parts must add up to the measured step.

One launch per stack: the four delays differ by DELAY_GAP, more than any part of EDGE's one-layer model
takes here, so a delay that lands in another part, or a part timed over the wrong call, moves that part by
a whole gap and fails the bound. The bounds are gross (what a slow, shared 2-core machine still meets):
a part is at least its delay, and less than its delay plus SLACK.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_exposed_as_measured, run_record
from test_equivalence import EDGE

from backends import backend_names, get_backend
from core.config import RunConfig
from core.hooks import TestHooks
from harness.analyze.anatomy import PARTS, median_difference, part_text, resolved, step_anatomy
from harness.run.runner import isolated_hooks
from workloads.spec import PRESETS

DELAY_GAP = 0.2
DELAYS = {"forward": DELAY_GAP, "backward": 2 * DELAY_GAP, "optimizer": 3 * DELAY_GAP, "comm": 4 * DELAY_GAP}
# A part's own time on EDGE (a millisecond or two) and what a loaded machine adds to it: with the suite's
# other worker running a 2-rank job beside it on 2 cores, a 1-layer TensorFlow forward took 45 ms and a
# ZeRO-3 isolated worker's step 50 ms more than alone. Under half of DELAY_GAP, so a delay that lands in the
# next part still fails.
SLACK = 0.09
# The exposed part is the delay and the stack's own collectives, which on a loaded 2-core machine took up to
# 130 ms a step (ZeRO's gathers and reductions at 4 processes on 2 cores): it is held to its delay from
# below only. A delay of another part leaking into it would leave that part short of its own delay.
# The parts each stack's worker times itself; the others are derived.
TIMED = ("forward", "backward", "optimizer")


def delayed_run(out, backend: str) -> dict:
    delays = [a for part, s in DELAYS.items() for a in ("--part-delay", f"{part}={s}")]
    args = EDGE.args()
    args[args.index("--steps") + 1] = 3
    return run_record(
        out, "--backend", backend, *args, "--warmup", 1, "--compute-steps", 2, "--anatomy-steps", 2,
        "--isolated-repeats", 1, "--no-trace-comm", *delays,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("backend", backend_names())
def test_a_delayed_part_moves_its_own_part_by_the_delay_and_no_other(backend, out):
    ok, why = get_backend(backend).availability()
    if not ok:
        pytest.skip(why)
    rec = delayed_run(out, backend)
    assert rec["status"] == "ok" and rec["test_hooks"]["part_delays"] == DELAYS
    anatomy = rec["summary"]["anatomy"]
    parts = anatomy["parts"]
    assert set(parts) == set(PARTS)
    for name in TIMED:
        p = parts[name]
        assert p["status"] == "measured", (name, p)
        assert DELAYS[name] <= p["s"] < DELAYS[name] + SLACK, (name, p["s"], anatomy)
    exposed = parts["exposed_comm"]
    assert exposed["status"] == "derived"
    assert DELAYS["comm"] - SLACK <= exposed["s"], (exposed, anatomy)
    other = parts["other"]
    assert abs(other["s"]) < SLACK, (other, anatomy)
    # the parts and other are the measured step, and the record says how each part was timed
    assert sum(p["s"] for p in parts.values()) == pytest.approx(anatomy["step_s"], abs=1e-9)
    # other within SLACK of zero, which is all a loaded machine allows: its sign may come out resolved
    # either way (TensorFlow's first call after a sleep runs a little slower, in three calls of an anatomy
    # step against one of a measured step), so the anatomy accounts for the step or cannot say
    assert anatomy["accounts_for_step"] is not False
    source = rec["isolated_ranks"] if rec["comm"]["t_compute_method"] == "isolated" else rec["ranks"]
    methods = source[0]["anatomy_methods"]
    assert set(TIMED) <= set(methods) and methods["sync"], methods
    assert not any(m.startswith("not split") for m in methods.values()), methods


def processes(**series) -> list[dict]:
    return [{key: list(values) for key, values in series.items()}]


@pytest.mark.unit
def test_the_parts_add_up_to_the_step_and_other_is_what_the_timed_parts_leave():
    step = [0.50, 0.52, 0.51, 0.50, 0.53]
    ranks = processes(
        compute_only_step_times=[0.40] * 3,
        forward_times=[0.1] * 3,
        backward_times=[0.2] * 3,
        optimizer_step_times=[0.05] * 3,
    )
    record = {"ranks": ranks}
    anatomy = step_anatomy(record, ranks, step, (0.40, [0.40] * 3), "no_sync", False, world=2)
    parts = {k: p["s"] for k, p in anatomy["parts"].items()}
    assert parts["exposed_comm"] == pytest.approx(np.median(step) - 0.40)
    assert parts["other"] == pytest.approx(0.05)
    assert sum(parts.values()) == pytest.approx(np.median(step))
    assert anatomy["parts"]["forward"]["status"] == "measured"


@pytest.mark.unit
def test_an_isolated_worker_of_a_sharded_stack_gives_a_rank_one_nth_of_its_optimizer():
    workers = processes(
        step_times=[0.4] * 3,
        forward_times=[0.1] * 3,
        backward_times=[0.2] * 3,
        optimizer_step_times=[0.08] * 3,
    )
    record = {"isolated_ranks": workers}
    t_compute = 0.4 - 3 / 4 * 0.08
    anatomy = step_anatomy(record, [], [0.5] * 3, (t_compute, [t_compute] * 3), "isolated", True, world=4)
    assert anatomy["parts"]["optimizer"]["s"] == pytest.approx(0.02)
    assert anatomy["parts"]["other"]["s"] == pytest.approx(t_compute - 0.1 - 0.2 - 0.02)
    assert "1/4" in anatomy["parts"]["optimizer"]["method"]


@pytest.mark.unit
def test_an_isolated_worker_of_a_sharded_stack_sleeps_n_times_the_optimizers_delay():
    """What the analysis above assumes of real optimizer work, the injected delay does too: the isolated
    worker of a sharded stack steps all P parameters where a rank steps P/N (harness/run/runner.py)."""
    hooks = TestHooks(part_delays={"forward": 0.1, "optimizer": 0.3})
    for stack, factor in (("torch-fsdp", 4), ("torch-ddp", 1)):
        cfg = RunConfig.build(stack, workload="tiny", spec=PRESETS["tiny"], world_size=4, device="cpu")
        scaled = isolated_hooks(get_backend(stack), cfg, hooks)
        assert scaled.part_delays == {"forward": 0.1, "optimizer": 0.3 * factor}, stack
    assert TestHooks().scaled("optimizer", 4) == TestHooks()


@pytest.mark.unit
def test_a_difference_negative_beyond_its_noise_is_unresolved_never_zero():
    """The sync-off steps slower than the synced ones (noise between phases, a machine that drifted):
    the exposed part keeps its sign and size, marked unresolved; within its noise it is shown as it is."""
    rng = np.random.default_rng(1)
    step = list(0.35 + rng.normal(0, 0.002, 20))
    slower = list(0.372 + rng.normal(0, 0.002, 5))
    ranks = processes(compute_only_step_times=slower)
    anatomy = step_anatomy(
        {"ranks": ranks}, ranks, step, (float(np.median(slower)), slower), "no_sync", False, 2
    )
    exposed = anatomy["parts"]["exposed_comm"]
    assert exposed["status"] == "unresolved" and exposed["s"] == pytest.approx(-0.022, abs=0.003)
    assert exposed["ci"][1] < 0
    assert anatomy["parts"]["other"]["status"] == "n/a"  # no part was timed: the rest is not known
    noisy = list(0.36 + rng.normal(0, 0.03, 5))
    value, interval = median_difference(step, [noisy])
    assert interval[0] < 0 < interval[1] or value > 0


@pytest.mark.unit
def test_a_negative_difference_of_one_value_is_unresolved_too():
    """One measured step gives no interval: a negative exposed part is then no more a figure than one
    negative beyond its noise (its ratio null, its text says why), where a positive one stands."""
    ranks = processes(compute_only_step_times=[1.5, 1.5, 1.52])
    anatomy = step_anatomy({"ranks": ranks}, ranks, [1.0], (1.5, [1.5, 1.5, 1.52]), "no_sync", False, 2)
    exposed = anatomy["parts"]["exposed_comm"]
    assert exposed["status"] == "unresolved" and exposed["ci"] is None and exposed["s"] == pytest.approx(-0.5)
    assert resolved(anatomy, "exposed_comm") is None
    assert "no interval" in part_text(exposed)
    anatomy = step_anatomy({"ranks": ranks}, ranks, [1.6], (1.5, [1.5, 1.5, 1.52]), "no_sync", False, 2)
    assert anatomy["parts"]["exposed_comm"]["status"] == "derived"


@pytest.mark.unit
def test_the_instrument_cost_of_a_sharded_isolated_worker_is_net_of_its_optimizer_cut():
    """Isolated workers of a stack that shards its optimizer, whose anatomy steps cost nothing beyond
    their steps (as on a CPU): t_compute takes (N−1)/N of each worker's optimizer off its steps, and the
    instrument's cost is its anatomy steps less the same cut, so zero, not that cut."""
    workers = [
        {
            "step_times": [1.0, 1.0, 1.01],
            "anatomy_step_times": [1.0, 1.01, 1.0],
            "forward_times": [0.2] * 3,
            "backward_times": [0.3] * 3,
            "optimizer_step_times": [0.4] * 3,
        }
        for _ in range(4)
    ]
    t_compute = 1.0 - 3 / 4 * 0.4
    anatomy = step_anatomy(
        {"isolated_ranks": workers}, [], [1.0] * 3, (t_compute, [t_compute] * 3), "isolated", True, world=4
    )
    assert anatomy["instrument_cost_s"] == pytest.approx(0.0, abs=0.011)


@pytest.mark.unit
def test_a_part_a_worker_cannot_time_apart_is_na_with_its_reason():
    ranks = processes(forward_times=[0.1] * 3, backward_times=[0.2] * 3)
    ranks[0]["anatomy_methods"] = {"sync": "alone", "optimizer": "not split: one traced function"}
    anatomy = step_anatomy({"ranks": ranks}, ranks, [0.4] * 3, (None, None), "none", False, world=1)
    assert anatomy["parts"]["optimizer"] == {
        "s": None,
        "ci": None,
        "share": None,
        "status": "n/a",
        "method": "not split: one traced function",
    }
    assert anatomy["parts"]["other"]["status"] == "n/a" and anatomy["accounts_for_step"] is None
    assert anatomy["parts"]["exposed_comm"]["s"] == 0.0  # one rank: no communication, by definition


@pytest.mark.unit
def test_the_live_runs_exposed_ratio_check_refuses_what_a_measurement_cannot_be():
    """conftest.assert_exposed_as_measured, which the live full-record tests hold each run to, passes a
    ratio in [0, 1), a negative one whose interval spans 0 and a null one whose part is unresolved, and
    fails on the rest: a clamp, an unclamped null or a ratio of a whole step would slip by otherwise."""

    def summary(ratio, status="derived", ci=(0.01, 0.03)) -> dict:
        part = {"s": 0.0, "ci": list(ci), "status": status}
        return {"exposed_comm_ratio": ratio, "anatomy": {"parts": {"exposed_comm": part}}}

    for fine in (summary(0.0), summary(0.4), summary(-0.02, ci=(-0.03, 0.01)), summary(None, "unresolved")):
        assert_exposed_as_measured(fine)
    for wrong in (summary(1.0), summary(-0.02, ci=(-0.03, -0.01)), summary(None, "derived")):
        with pytest.raises(AssertionError):
            assert_exposed_as_measured(wrong)
