"""The collective trace: what each stack's own instrument says it sent, read back into one shape.

Unit tier on hand-made traces in the instruments' formats (torch.profiler's Chrome trace with gloo work
events, Horovod's timeline, Paddle's reducer log); the real runs' traces are checked against known gradient
bytes in tests/test_ddp.py, tests/test_torch_family.py and tests/test_tf_paddle_backends.py.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime

import pytest

from backends.comm_trace import tcp_counters, wire_bytes
from backends.horovod_torch.trace import horovod_collectives, timeline_events
from backends.paddle_fleet.trace import (
    captured_stderr,
    glog_entries,
    glog_levels,
    paddle_reducer_collectives,
    paddle_reducer_groups,
)
from backends.tf_mwms.trace import tf_collectives
from backends.torch_trace import torch_collectives
from harness.analyze.metrics import measured_comm
from harness.analyze.summary import measured_comm_text

pytestmark = pytest.mark.unit


def span(name, ts, dur, tid, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


NCCL_ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
NCCL_ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def gpu_kernel(name, ts, dur, stream, cat="kernel"):
    """A device event as kineto writes it: on its stream's row, the stream in its args."""
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream, "device": 0, "correlation": ts},
    }


def gpu_rank_trace() -> list[dict]:
    """Rank 0 of 2 on a GPU: an all-reduce of 1,000 floats and an all-gather of a 300-element bf16 shard,
    each an NCCL kernel on the communication stream (20); matrix products on two compute streams that
    overlap each other (merged: 0..120) and one beside the gather (230..300); a copy, which is no compute."""
    return [
        {**span("c10d::allreduce_", 5, 3, 1, **{"Input Dims": [[[1000]], [], []]}), "cat": "cpu_op"},
        {**span("c10d::_allgather_base_", 150, 3, 1, **{"Input Dims": [[600], [300]]}), "cat": "cpu_op"},
        gpu_kernel("ampere_sgemm_128x64_nn", 0, 100, 7),
        gpu_kernel("ampere_sgemm_64x64_nn", 40, 80, 8),
        gpu_kernel(NCCL_ALL_REDUCE, 60, 100, 20),
        gpu_kernel("Memcpy HtoD (Pageable -> Device)", 130, 20, 9, cat="gpu_memcpy"),
        gpu_kernel(NCCL_ALL_GATHER, 200, 40, 20),
        gpu_kernel("ampere_sgemm_128x64_nn", 230, 70, 7),
    ]


def test_torch_trace_on_gpu_times_each_call_by_its_nccl_kernel():
    reduce, gather = torch_collectives(gpu_rank_trace(), world=2)
    assert (reduce["op"], reduce["elements"], reduce["time_s"]) == ("all_reduce", 1000, pytest.approx(100e-6))
    assert reduce["overlapped_s"] == pytest.approx(60e-6)  # the merged compute 0..120 over 60..160
    assert (gather["op"], gather["elements"], gather["time_s"]) == ("all_gather", 600, pytest.approx(40e-6))
    assert gather["overlapped_s"] == pytest.approx(10e-6)  # 230..240: the copy at 130..150 is no compute


def test_gpu_overlap_is_holistic_trace_analysis_s(tmp_path):
    """The share of communication time that compute kernels overlap, as measured_comm gives it from the
    calls, is what Holistic Trace Analysis (Meta's HTA, get_comm_comp_overlap) computes from the same
    kineto trace: the same kernels count as communication and as compute."""
    from hta.trace_analysis import TraceAnalysis

    events = gpu_rank_trace()
    trace = {"distributedInfo": {"rank": 0, "world_size": 2}, "traceEvents": events, "schemaVersion": 1}
    (tmp_path / "rank0.json").write_text(json.dumps(trace))
    hta = TraceAnalysis(trace_dir=str(tmp_path)).get_comm_comp_overlap(visualize=False)
    calls = torch_collectives(events, world=2)
    ours = sum(c["overlapped_s"] for c in calls) / sum(c["time_s"] for c in calls)
    assert ours == pytest.approx(0.5)
    assert hta["comp_comm_overlap_pctg"].iloc[0] / 100 == pytest.approx(ours, abs=1e-4)


def test_torch_trace_pairs_each_c10d_call_with_its_gloo_work_and_measures_overlap():
    """Rank 0 of 2: a DDP bucket all-reduce of 1,000 floats and an FSDP all-gather of a 300-element shard.
    The all-reduce's gloo work (main thread busy for 30 of its 100 us) is timed, not the enqueue."""
    main, gloo = 10, 20
    events = [
        # issued first, but its work runs after the all-reduce's: pairing goes by size, not by order
        span("c10d::broadcast_", 30, 2, main, **{"Input Dims": [[[53]], []], "Input type": ["TensorList"]}),
        span("gloo:broadcast", 160, 10, gloo, **{"Input Dims": [[53]], "Input type": ["int"]}),
        span("aten::copy_", 60, 30, gloo),  # gloo's own copies are not the rank's compute
        span("aten::mm", 0, 50, main),
        span(
            "c10d::allreduce_",
            40,
            5,
            main,
            **{"Input Dims": [[[1000]], [], []], "Input type": ["TensorList"]},
        ),
        span("aten::mm", 60, 20, main),  # overlaps the all-reduce's work: 60..80
        span("gloo:all_reduce", 50, 100, gloo, **{"Input Dims": [[1000]], "Input type": ["float"]}),
        span(
            "c10d::_allgather_base_",
            200,
            5,
            main,
            **{"Input Dims": [[600], [300]], "Input type": ["c10::BFloat16", "c10::BFloat16"]},
        ),
        span("gloo:all_gather", 210, 40, gloo, **{"Input Dims": [[300]], "Input type": ["c10::BFloat16"]}),
    ]
    bcast, reduce, gather = torch_collectives(events, world=2)
    assert (
        bcast["op"] == "broadcast" and bcast["time_s"] == pytest.approx(10e-6) and bcast["size_bytes"] == 212
    )
    assert (reduce["op"], reduce["elements"], reduce["size_bytes"], reduce["dtype"]) == (
        "all_reduce",
        1000,
        4000,
        "float",
    )
    assert reduce["time_s"] == pytest.approx(100e-6)
    assert reduce["overlapped_s"] == pytest.approx(20e-6)  # aten::mm 60..80 inside the work's 50..150
    # nccl-tests' size of an all-gather is the gathered output: 2 ranks x 300 bf16 elements
    assert (gather["op"], gather["elements"], gather["size_bytes"]) == ("all_gather", 600, 1200)
    assert gather["time_s"] == pytest.approx(40e-6) and gather["overlapped_s"] == 0


def test_a_scalar_collective_counts_one_element():
    """ZeRO all-reduces scalars (an overflow flag, a norm): Input Dims [] is one element, not none."""
    events = [
        span("c10d::allreduce_", 0, 1, 1, **{"Input Dims": [[[]]], "Input type": ["TensorList"]}),
        span("gloo:all_reduce", 2, 3, 2, **{"Input Dims": [[]], "Input type": ["double"]}),
    ]
    (call,) = torch_collectives(events, world=2)
    assert call["elements"] == 1 and call["size_bytes"] == 8


def timeline_text(calls: list[tuple[str, int, int, str, list[tuple[int, str | None]]]]) -> str:
    """A Horovod timeline (left unterminated, as Horovod leaves it while running), its events in the order
    Horovod writes them: per call (one response: op, its transfer's start and end, transfer name, and its
    tensors as (pid, shape)) each phase begun and ended for all its tensors in one loop, each event stamped
    a microsecond after the one before, as Timeline::ActivityStartAll and ActivityEndAll write them."""
    events = []

    def each(tensors, ph, ts, name=None, args=None):
        for i, (pid, shape) in enumerate(tensors):
            event = {"ph": ph, "ts": ts + i, "pid": pid}
            if name:
                event["name"] = name
            if args and shape:
                event["args"] = {"dtype": "float32", "shape": shape}
            events.append(event)

    for op, start, end, transfer, tensors in calls:
        each(tensors, "B", start - 50, f"NEGOTIATE_{op}")
        each(tensors, "E", start - 40)
        each(tensors, "B", start - 30, op)
        each(tensors, "B", start - 20, "MEMCPY_IN_FUSION_BUFFER")
        each(tensors, "E", start - 10)
        each(tensors, "B", start, transfer)
        each(tensors, "E", end)
        each(tensors, "E", end + 5, args=True)
    return "[\n" + ",\n".join(json.dumps(e) for e in events) + ","


def test_horovod_timeline_counts_a_fused_allreduce_once_with_every_tensor_in_it():
    """Fused tensors' transfer begins are a run of adjacent events microseconds apart (their order in the
    file, not equal stamps, makes them one call); a response that follows is a call of its own, however
    soon it starts."""
    text = timeline_text(
        [
            ("ALLREDUCE", 1000, 1500, "GLOO_ALLREDUCE", [(1, "[1000]"), (2, "[2, 1500]"), (3, "[10]")]),
            ("ALLREDUCE", 1510, 1600, "GLOO_ALLREDUCE", [(4, "[100]")]),
            ("ALLGATHER", 2000, 2100, "GLOO_ALLGATHER", [(5, "[800]")]),  # the gathered output's shape
            ("BROADCAST", 3000, 3050, "GLOO_BCAST", [(6, None)]),  # Horovod gives no shape for broadcasts
        ]
    )
    fused, alone, gather, bcast = horovod_collectives(timeline_events(text), world=2)
    assert (fused["op"], fused["elements"], fused["size_bytes"]) == ("all_reduce", 4010, 16040)
    # from the first tensor's begin to the last tensor's end (stamped 1000 and 1502)
    assert fused["time_s"] == pytest.approx(502e-6) and fused["overlapped_s"] is None
    assert (alone["elements"], alone["time_s"]) == (100, pytest.approx(90e-6))
    assert (gather["op"], gather["elements"], gather["size_bytes"]) == ("all_gather", 800, 3200)
    assert bcast["op"] == "broadcast" and bcast["size_bytes"] is None


def test_other_tensors_events_inside_a_run_of_transfer_begins_do_not_split_the_call():
    """On GPU a finalizer thread writes the transfer's begins while the background thread writes other
    tensors' negotiation (a begin and a rank's tick) and ends: none of them splits the fused call."""
    events = timeline_events(
        timeline_text([("ALLREDUCE", 1000, 1500, "NCCL_ALLREDUCE", [(1, "[8]"), (2, "[8]"), (3, "[8]")])])
    )
    begins = [i for i, e in enumerate(events) if e.get("name") == "NCCL_ALLREDUCE"]
    events[begins[2] : begins[2]] = [{"ph": "X", "name": "1", "ts": 1001, "pid": 7, "dur": 0}]
    events[begins[1] : begins[1]] = [
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 1000, "pid": 7},
        {"ph": "E", "ts": 1000, "pid": 9},  # pid 9: nothing open, ignored
    ]
    (call,) = horovod_collectives(events, world=2)
    assert call["elements"] == 24


def trace(calls, steps=1, **extra):
    return {
        "comm_trace": {
            "method": "test",
            "steps": steps,
            "step_times": [0.2] * steps,
            "collectives": calls,
            **extra,
        }
    }


def call(op, size_bytes, time_s, overlapped_s=None):
    return {
        "op": op,
        "size_bytes": size_bytes,
        "time_s": time_s,
        "overlapped_s": overlapped_s,
        "dtype": "float",
    }


def test_measured_volume_uses_the_ring_factor_and_sits_beside_the_analytic():
    """4 ranks, 1,000-element fp32 gradients: an all-reduce sends 2(N-1)/N x 4,000 B = 6,000 B per rank."""
    terms = [{"op": "all_reduce", "elements": 1000, "dtype_bytes": 4, "per_step": 1, "what": "gradients"}]
    ranks = [trace([call("all_reduce", 4000, 0.01, 0.004)])] + [
        trace([call("all_reduce", 4000, 0.02, 0.0)])
    ] * 3
    m = measured_comm(ranks, 4, terms)
    assert m["bytes_per_rank_per_step"] == 6000 and m["vs_analytic"] == 1.0
    op = m["ops"]["all_reduce"]
    assert op["time_s_per_step"] == 0.02  # the slowest rank's
    assert op["overlap_fraction"] == pytest.approx(0.004 / 0.07)
    assert op["busbw_Bps"] == pytest.approx(4000 * 1.5 / 0.02)
    assert op["analytic_size_bytes_per_step"] == 4000 and op["ranks_agree"]


def test_a_rank_whose_trace_lost_a_call_is_named_and_does_not_set_the_size():
    """Every rank issues the same all-reduces: rank 0's profile dropping step 2's (as TensorFlow's can) is
    a loss of events, so the size per step is rank 1's and rank 0 is named with what it held."""
    ranks = [
        {"rank": 0, **trace([call("all_reduce", 4000, 0.01)], steps=2)},
        {"rank": 1, **trace([call("all_reduce", 4000, 0.01), call("all_reduce", 4000, 0.03)], steps=2)},
    ]
    m = measured_comm(ranks, 2, [])
    op = m["ops"]["all_reduce"]
    assert op["size_bytes_per_step"] == 4000 and op["calls_per_step"] == 1.0
    assert not op["ranks_agree"] and op["ranks_short"] == {"0": 2000}
    assert op["busbw_Bps"] == pytest.approx(4000 / 0.02)


def test_a_trace_that_also_counted_the_wire_shows_both():
    """Paddle's reducer log gives the calls and the TCP counters the bytes: each rank's wire figure per
    step stands beside the traced volume, in the record and its line."""
    wire = {"received_bytes": 0, "connections": [], "connections_closed": 0}
    ranks = [
        {"rank": r, **trace([call("all_reduce", 4000, 0.01)] * 2, steps=2, wire={**wire, "sent_bytes": b})}
        for r, b in [(0, 8_300), (1, 8_100)]
    ]
    m = measured_comm(ranks, 2, [])
    assert m["ops"]["all_reduce"]["size_bytes_per_step"] == 4000
    assert m["wire_sent_bytes_per_step"] == {"0": 4_150, "1": 4_050}
    assert "on the wire rank 0 4.1 KiB, rank 1 4.0 KiB" in measured_comm_text(m)
    assert "wire_sent_bytes_per_step" not in measured_comm([trace([call("all_reduce", 4000, 0.01)])], 2, [])


def test_a_rank_without_a_trace_is_left_out_and_an_unknown_overlap_is_not_zero():
    """Horovod's timeline is rank 0's only: rank 1's reason is kept, its missing data not counted as 0."""
    ranks = [
        trace([call("all_reduce", 4000, 0.01)]),
        trace(None, reason="Horovod writes its timeline on rank 0 only"),
    ]
    m = measured_comm(ranks, 2, [])
    assert m["ranks_traced"] == 1 and "rank 0 only" in m["untraced_reason"]
    assert m["ops"]["all_reduce"]["overlap_fraction"] is None
    untraced = measured_comm(
        [{"comm_trace": {"method": None, "reason": "no trace for tensorflow"}}] * 2, 2, []
    )
    assert untraced == {"method": None, "reason": "no trace for tensorflow"}


# Paddle's reducer as glog writes it at VLOG 3 (shortened from a real rank log): built with two groups, then
# one step on thread 77 (glog pads the id); thread 99 logs meanwhile, and so does Paddle's API on thread 77
# (a user's GLOG_v) inside the call; a message may run over several lines.
PADDLE_REDUCER_BUILT = """\
I1201 16:58:29.830410    77 reducer.cc:104] var[embedding_0.w_0] 's type is float32
I1201 16:58:29.830461    77 reducer.cc:104] var[linear_0.w_0] 's type is float32
I1201 16:58:29.830605    77 reducer.cc:592] The Group[0]:numel: 809728 ;var number: 51
I1201 16:58:29.830610    77 reducer.cc:592] The Group[1]:numel: 262144 ;var number: 1
"""
PADDLE_REDUCER_STEP = """\
I1201 23:59:59.990000    77 reducer.cc:783] Tensor[1] [embedding_1.w_0@GRAD] arrived and triggered DistHook
I1201 23:59:59.990010    77 reducer.cc:956] Group[0] is ready
I1201 23:59:59.990020    77 reducer.cc:1095] group [0] start fused_allreduce.
I1201 23:59:59.990300    77 api.cc:109879] scale API kernel key: [CPU, NCHW, float32]
I1201 23:59:59.991000    99 process_group_gloo.cc:748] GlooStore::set
I1201 23:59:59.995020    77 accumulation_node.cc:200]
==========================Finish_AD_API_Grad: GradNodeAccumulation==========================
W1201 23:59:59.999000    77 reducer.cc:956] Group[1] is ready
I1202 00:00:00.000000    77 reducer.cc:1095] group [1] start fused_allreduce.
I1202 00:00:00.002500    77 reducer.cc:1086] In the batch, Reducer is finished.
"""
READ_AT = datetime(2026, 12, 2, 0, 0, 1)  # when the log is read: just after it was written


def test_paddle_reducer_log_times_each_fused_allreduce_to_its_threads_next_reducer_line():
    """A group's call runs from its "start fused_allreduce" to the next line its own thread logs from the
    reducer or the gradient hook (not another thread's, not Paddle's API inside the call; the last ends at
    "Reducer is finished"), past midnight too; its size is the group's numel as the reducer logged it
    when built, its dtype the variables'."""
    groups = paddle_reducer_groups(PADDLE_REDUCER_BUILT)
    assert groups == {"elements": {0: 809728, 1: 262144}, "dtype": "float32"}
    calls = paddle_reducer_collectives(PADDLE_REDUCER_STEP, groups, 2, READ_AT)
    assert [(c["op"], c["elements"], c["size_bytes"], c["dtype"]) for c in calls] == [
        ("all_reduce", 809728, 4 * 809728, "float32"),
        ("all_reduce", 262144, 4 * 262144, "float32"),
    ]
    assert [c["start_s"] for c in calls] == pytest.approx([0.000020, 0.010000], abs=1e-9)
    assert [c["time_s"] for c in calls] == pytest.approx([0.005000, 0.002500], abs=1e-9)
    assert [e[2] for e in glog_entries(PADDLE_REDUCER_STEP, READ_AT)].count("accumulation_node.cc") == 1
    half = "I1201 16:58:29.900000    77 reducer.cc:104] var[a] 's type is float16\n"
    assert paddle_reducer_groups(PADDLE_REDUCER_BUILT + half)["dtype"] is None


def test_a_call_the_trace_cut_off_has_no_time():
    cut = paddle_reducer_collectives(
        "I1231 23:59:59.999000 5 reducer.cc:1095] group [0] start fused_allreduce.\n",
        {"elements": {0: 10}, "dtype": "float32"},
        2,
    )
    assert cut[0]["time_s"] is None and cut[0]["overlapped_s"] is None


@pytest.mark.parametrize(
    "first, second, read_at",
    [
        ("1231 23:59:59.999000", "0101 00:00:00.001000", datetime(2027, 1, 1, 0, 0, 5)),  # New Year
        ("0228 23:59:59.999000", "0301 00:00:00.001000", datetime(2027, 3, 1, 0, 0, 5)),  # not a leap year
        ("0228 23:59:59.999000", "0229 00:00:00.001000", datetime(2028, 2, 29, 0, 0, 5)),  # a leap year
    ],
)
def test_glog_times_without_a_year_count_on_across_year_and_month_ends(first, second, read_at):
    entries = glog_entries(f"I{first} 5 a.cc:1] x\nI{second} 5 a.cc:2] y\n", read_at)
    assert entries[1][0] - entries[0][0] == 2_000


def test_the_reducer_log_leaves_each_file_at_the_level_the_environment_gave_it():
    modules = ("reducer", "accumulation_node")
    assert glog_levels(modules, {}) == {"reducer": 0, "accumulation_node": 0}
    assert glog_levels(modules, {"GLOG_v": "4", "GLOG_vmodule": "reducer=1,api=6"}) == {
        "reducer": 1,
        "accumulation_node": 4,
    }


@pytest.fixture
def fd2():
    """Puts a given file descriptor on fd 2 (a worker's rank log, or a pipe), and the real one back."""
    saved = os.dup(2)
    yield lambda fd: os.dup2(fd, 2)
    os.dup2(saved, 2)
    os.close(saved)


def test_captured_stderr_reads_what_c_code_wrote_back_from_a_rank_log_that_keeps_it(fd2, tmp_path):
    log = tmp_path / "rank0.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    fd2(fd)
    os.write(2, b"before\n")
    with captured_stderr() as captured:
        os.write(2, b"I1201 glog line\n")
        assert log.read_text() == "before\nI1201 glog line\n"  # in the log as it is written
    os.close(fd)
    assert captured["text"] == "I1201 glog line\n"


def test_captured_stderr_of_a_pipe_reads_what_c_code_wrote_and_hands_it_on(fd2):
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)  # a missing copy fails instead of waiting
    fd2(write_end)
    with captured_stderr() as captured:
        os.write(2, b"I1201 glog line\n")
        assert captured["text"] == ""
    os.close(write_end)
    assert captured["text"] == "I1201 glog line\n"
    assert os.read(read_end, 100) == b"I1201 glog line\n"


def test_tcp_counters_count_each_connections_payload_both_ways():
    """A localhost connection inside this process: 100,000 bytes one way and 3,000 back are what the
    kernel's counters of its two ends moved between two readings, read without touching the sockets'
    blocking mode or leaving a descriptor open. Its ends are both this process's, so it is no traffic
    between ranks: wire_bytes leaves it out."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with client, accepted:
            fds = len(os.listdir("/proc/self/fd"))
            before = tcp_counters()
            client.sendall(b"x" * 100_000)
            received = 0
            while received < 100_000:
                received += len(accepted.recv(1 << 16))
            accepted.sendall(b"y" * 3_000)
            assert len(client.recv(3_000, socket.MSG_WAITALL)) == 3_000
            after = tcp_counters()
            assert len(os.listdir("/proc/self/fd")) == fds and client.gettimeout() is None
            ends = [key for key in after if int(key[0].rsplit(":", 1)[1], 16) == client.getsockname()[1]]
            (mine,) = ends
            theirs = (mine[1], mine[0])
    assert (after[mine][0] - before[mine][0], after[mine][1] - before[mine][1]) == (100_000, 3_000)
    assert (after[theirs][0] - before[theirs][0], after[theirs][1] - before[theirs][1]) == (3_000, 100_000)
    assert wire_bytes(before, after)["connections"] == []


def test_wire_bytes_count_a_connection_opened_between_readings_whole_and_name_a_closed_one():
    before = {("a", "p"): (1_000, 500), ("b", "q"): (7, 7), ("x", "y"): (0, 0), ("y", "x"): (0, 0)}
    after = {("a", "p"): (5_000, 900), ("c", "r"): (300, 200), ("x", "y"): (50, 60), ("y", "x"): (60, 50)}
    moved = wire_bytes(before, after)
    assert moved["sent_bytes"] == 4_000 + 300 and moved["received_bytes"] == 400 + 200
    assert [c["endpoints"] for c in moved["connections"]] == [["a", "p"], ["c", "r"]]
    assert moved["connections_closed"] == 1


def test_bytes_on_the_wire_stand_in_for_a_trace_without_ops_or_times():
    """Paddle on CPU: each rank's bytes sent per step, their mean beside the analytic volume (a 2-rank
    all-reduce of 4,000 B sends 4,000 B from each rank), and no per-op figure."""
    terms = [{"op": "all_reduce", "elements": 1000, "dtype_bytes": 4, "per_step": 1, "what": "gradients"}]

    def wired(rank, sent):
        wire = {"sent_bytes": sent, "received_bytes": 0, "connections": [], "connections_closed": rank}
        return {
            "rank": rank,
            "comm_trace": {
                "method": "kernel TCP counters",
                "steps": 2,
                "step_times": [0.1] * 2,
                "collectives": None,
                "wire": wire,
                "reason": "no events",
            },
        }

    m = measured_comm([wired(0, 8_200), wired(1, 8_000)], 2, terms)
    assert m["method"] == "kernel TCP counters" and m["ranks_traced"] == 2 and m["ops"] == {}
    assert m["wire_sent_bytes_per_step"] == {"0": 4_100, "1": 4_000}
    assert m["bytes_per_rank_per_step"] == 4_050 and m["vs_analytic"] == pytest.approx(4_050 / 4_000)
    assert m["connections_closed"] == 1 and "1 connection(s) closed" in measured_comm_text(m)
    assert "bytes on the wire only" in measured_comm_text(m)


def test_tf_profile_collectives_get_their_size_from_the_graph_and_their_time_from_the_profile():
    """MWMS packs the gradients into one CollectiveReduceV2 (1,071,872 fp32 on tiny); the profile names the
    kernel "<node>:<op type>" and times it, the graph gives its input; a compute op on a tf_Compute thread
    during it is overlap, one on the collective thread is not."""
    spans = [
        {
            "name": "adam_w/CollectiveReduceV2:CollectiveReduceV2",
            "line": "collective_ops/1",
            "start_s": 10.0,
            "time_s": 0.02,
        },
        {"name": "MatMul:MatMul", "line": "tf_Compute/7", "start_s": 10.015, "time_s": 0.01},
        {"name": "Copy:Copy", "line": "collective_ops/1", "start_s": 10.0, "time_s": 0.02},
        {
            "name": "gather/CollectiveGatherV2:CollectiveGatherV2",
            "line": "collective_ops/1",
            "start_s": 11.0,
            "time_s": 0.001,
        },
        {
            "name": "unknown/CollectiveReduceV2:CollectiveReduceV2",
            "line": "collective_ops/1",
            "start_s": 12.0,
            "time_s": 0.001,
        },  # a node the graphs do not have: not counted
    ]
    inputs = {
        "adam_w/CollectiveReduceV2": (1_071_872, "float32"),
        "gather/CollectiveGatherV2": (64, "bfloat16"),
    }
    reduce, gather = tf_collectives(spans, inputs, world=2)
    assert (reduce["op"], reduce["size_bytes"], reduce["time_s"]) == ("all_reduce", 4 * 1_071_872, 0.02)
    assert reduce["overlapped_s"] == pytest.approx(0.005)
    assert (gather["op"], gather["elements"], gather["size_bytes"]) == ("all_gather", 128, 256)
