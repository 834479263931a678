"""A tuned set keeps the overlap of communication with backward that its stack's default has."""

from __future__ import annotations

import pytest

from backends.torch_trace import COMPILED_GRAPH, torch_collectives


@pytest.mark.unit
def test_a_compiled_graph_the_rank_runs_is_compute_the_all_reduce_overlaps():
    """Inductor's generated kernels are no aten ops: without its graph's span, a compiled backward beside
    an all-reduce would count as idle, and a tuned set's overlap would read lower than the default's."""
    main, gloo = 1, 2

    def span(name, ts, dur, tid, **args):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}

    events = [
        span("c10d::allreduce_", 0, 5, main, **{"Input Dims": [[[1000]]], "Input type": ["TensorList"]}),
        span("gloo:all_reduce", 10, 100, gloo, **{"Input Dims": [[1000]], "Input type": ["float"]}),
        span(f"{COMPILED_GRAPH} fkp736whkhdrnfimrhi7s6ywusf2qe2aq6pdosz33dnqs2nw2liw ##", 20, 50, main),
        span("aten::mm", 30, 10, main),  # an extern kernel inside the compiled graph: counted once
        span("## Call CompiledFxGraph elsewhere ##", 20, 90, gloo),  # not the issuing thread's
    ]
    (reduce,) = torch_collectives(events, world=2)
    assert reduce["time_s"] == pytest.approx(100e-6)
    assert reduce["overlapped_s"] == pytest.approx(50e-6)
