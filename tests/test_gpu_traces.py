"""The torch trace reader on GPU traces, and `harness trace`, without a GPU.

Real kineto traces of NCCL jobs on A100s (tests/data/gpu-traces, from Holistic Trace Analysis's test data;
its README says what each holds): every expected figure is computed here from the raw events (the NCCL
kernels' own durations and args, ProcessGroupNCCL's nccl:<op> annotations), not by the reader. Hand-made
traces cover what the files do not: two communicators (DeepSpeed clones the world group) whose kernels
interleave on two streams.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import shutil

import pytest
from conftest import REPO

from backends.torch_trace import torch_collectives
from harness.cli import main

pytestmark = pytest.mark.unit

TRACES = REPO / "tests" / "data" / "gpu-traces"
DDP = "a100_ddp_2rank_nccl2.17_rank0.json.gz"
MIXED = "a100_16rank_mixed_collectives_rank0.json.gz"
SAMPLED = ["a100_128rank_sampled_rank0.json.gz", "a100_128rank_sampled_rank1.json.gz"]
H200_WORLD1 = "h200_nccl_world1_allreduce.json.gz"
# Element bytes of the dtype names these files use (record_param_comms' and torch's Input type)
BYTES = {"Float": 4, "Long": 8, "float": 4, "long": 8, "int": 4, "unsigned char": 1, "signed char": 1}
# ProcessGroupNCCL's annotation of each op in the older files -> the op; its Input Dims is the op's input
ANNOTATIONS = {
    "nccl:all_reduce": "all_reduce",
    "nccl:_all_gather_base": "all_gather",
    "nccl:_reduce_scatter_base": "reduce_scatter",
    "nccl:all_to_all": "all_to_all",
}


def trace_path(name: str):
    """A trace of the repository's own test data: a missing file fails the test, it never skips."""
    return TRACES / name


@functools.cache  # read once per session; nothing here changes a trace
def load(name: str) -> dict:
    return json.loads(gzip.decompress(trace_path(name).read_bytes()))


def read(doc: dict, events=None) -> list[dict]:
    return torch_collectives(
        doc["traceEvents"] if events is None else events, doc["distributedInfo"]["world_size"]
    )


def nccl_kernels(doc: dict) -> list[dict]:
    return sorted(
        (e for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_")),
        key=lambda e: e["ts"],
    )


def test_ddp_trace_counts_its_15_all_reduces_with_their_bytes_and_kernel_times():
    """DDP's bucket all-reduces carry no dtype in c10d::allreduce_ (a TensorList): each call's size is its
    NCCL kernel's In msg nelems x 4 (fp32), its time the kernel's duration, call by call."""
    doc = load(DDP)
    kernels = [k for k in nccl_kernels(doc) if k["name"].startswith("ncclKernel_AllReduce")]
    expected = [(k["args"]["In msg nelems"] * BYTES[k["args"]["dtype"]], k["dur"] / 1e6) for k in kernels]
    assert len(expected) == 15 and sum(size for size, _ in expected) == 306_684_384
    assert sum(t for _, t in expected) == pytest.approx(46.76e-3, abs=0.01e-3)
    reduces = [c for c in read(doc) if c["op"] == "all_reduce"]
    assert [(c["size_bytes"], c["time_s"]) for c in reduces] == [(s, pytest.approx(t)) for s, t in expected]
    assert {(c["dtype"], c["group_size"], c["api"]) for c in reduces} == {("Float", 2, "c10d::allreduce_")}


def test_ddp_trace_broadcasts_take_their_size_and_dtype_from_the_kernels_args():
    """DDP's start-up broadcasts of parameters (fp32) and buffers (int64): the broadcast kernel is named
    int8_t whatever it moves; its args give the dtype."""
    doc = load(DDP)
    kernels = [k for k in nccl_kernels(doc) if k["name"].startswith("ncclKernel_Broadcast")]
    expected = [(k["args"]["In msg nelems"] * BYTES[k["args"]["dtype"]], k["args"]["dtype"]) for k in kernels]
    casts = [c for c in read(doc) if c["op"] == "broadcast"]
    assert len(casts) == 6 and [(c["size_bytes"], c["dtype"]) for c in casts] == expected
    assert {"Float", "Long"} == {dtype for _, dtype in expected}


def test_ddp_trace_overlap_is_holistic_trace_analysis_s(tmp_path, monkeypatch):
    """The share of the NCCL kernels' time that other kernels overlap, from the calls, is what HTA's
    get_comm_comp_overlap computes from the same file, given the same window and clock: every profiled
    step (HTA by default drops the last one as incomplete, which leaves out 7 of the 21 NCCL kernels) and
    the trace's nanosecond timestamps (HTA by default rounds them to whole microseconds, a workaround for
    older torch's overlapping events, which opens gaps between back-to-back kernels)."""
    from hta.trace_analysis import TraceAnalysis

    shutil.copy(trace_path(DDP), tmp_path / "rank0.json.gz")
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    hta = TraceAnalysis(trace_dir=str(tmp_path), include_last_profiler_step=True)
    overlap = hta.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0] / 100
    calls = read(load(DDP))
    ours = sum(c["overlapped_s"] for c in calls) / sum(c["time_s"] for c in calls)
    assert ours > 0.1 and overlap == pytest.approx(ours, abs=1e-4)


def annotated_sizes(doc: dict) -> dict[str, list[int]]:
    """Per op, the size S of each call as ProcessGroupNCCL's nccl:<op> annotation gives its input tensor
    (an all_gather's S: the gathered output, input x ranks)."""
    world = doc["distributedInfo"]["world_size"]
    sizes: dict[str, list[int]] = {}
    for e in sorted(doc["traceEvents"], key=lambda e: e.get("ts", 0)):
        if e.get("cat") == "user_annotation" and e.get("name") in ANNOTATIONS:
            op = ANNOTATIONS[e["name"]]
            count = math.prod(e["args"]["Input Dims"][0]) * (world if op == "all_gather" else 1)
            sizes.setdefault(op, []).append(count * BYTES[e["args"]["Input type"][0]])
    return sizes


def launched_kernel_time(doc: dict) -> float:
    """Seconds of the NCCL kernels whose launch (a CUDA runtime call of the same correlation id) is in the
    trace: those a call issued while the profiler ran."""
    launches = {e["args"]["correlation"] for e in doc["traceEvents"] if e.get("cat") == "cuda_runtime"}
    return sum(k["dur"] for k in nccl_kernels(doc) if k["args"]["correlation"] in launches) / 1e6


def test_16_rank_trace_finds_every_op_with_the_sizes_its_annotations_give():
    """Rank 0 of 16 (torch of 2023): c10d::allreduce_'s TensorList has no recorded shape and no kernel has
    size args, so sizes come from the nccl:<op> annotations. Every NCCL kernel is named SendRecv here,
    whatever the op: the op is the call's. Ten all_to_alls of 0 elements launch no kernel: no time."""
    doc = load(MIXED)
    calls = read(doc)
    by_op = {op: [c for c in calls if c["op"] == op] for op in ANNOTATIONS.values()}
    assert {op: len(cs) for op, cs in by_op.items()} == {
        "all_reduce": 10,
        "all_gather": 10,
        "reduce_scatter": 10,
        "all_to_all": 55,
    }
    for op, sizes in annotated_sizes(doc).items():
        assert [c["size_bytes"] or 0 for c in by_op[op]] == sizes, op
    empty = [c for c in by_op["all_to_all"] if c["size_bytes"] is None]
    assert len(empty) == 10 and all(c["time_s"] is None for c in empty)
    assert all(c["size_bytes"] and c["time_s"] for op, cs in by_op.items() if op != "all_to_all" for c in cs)


def test_16_rank_trace_times_the_calls_by_the_kernels_they_launched():
    """Pairing by launch: the calls' time is the NCCL kernels launched inside them. Five kernels were
    launched before the profiler started (no launch in the trace) and ten calls launched none: pairing
    each call with the next kernel would shift every call after the first gap onto another's kernel."""
    doc = load(MIXED)
    assert sum(c["time_s"] or 0 for c in read(doc)) == pytest.approx(launched_kernel_time(doc), abs=1e-9)


@pytest.mark.parametrize("name", SAMPLED)
def test_128_rank_traces_find_every_op_with_its_size_and_kernel_time(name):
    """Two ranks of a 128-rank job: all_to_all, all_reduce (a TensorList: size from its annotation) and an
    all_gather of int8 on a second NCCL stream; every call is sized and timed."""
    doc = load(name)
    calls = read(doc)
    assert {op: sum(c["op"] == op for c in calls) for op in ("all_reduce", "all_gather", "all_to_all")} == {
        "all_reduce": 4,
        "all_gather": 2,
        "all_to_all": 4,
    }
    for op, sizes in annotated_sizes(doc).items():
        assert [c["size_bytes"] for c in calls if c["op"] == op] == sizes, op
    assert sum(c["time_s"] for c in calls) == pytest.approx(launched_kernel_time(doc), abs=1e-9)


@pytest.mark.parametrize("name", [DDP, SAMPLED[0]])
def test_a_trace_without_c10d_ops_is_read_from_record_param_comms_or_the_nccl_annotations(name):
    """Where the trace has no c10d op (a call made under another name), the call is the outermost
    record_param_comms naming a collective (newer torch) or nccl:<op> annotation (older)."""
    doc = load(name)
    events = [e for e in doc["traceEvents"] if not e.get("name", "").startswith("c10d::")]
    calls = read(doc, events)
    if name == DDP:
        reduces = [c for c in calls if c["op"] == "all_reduce"]
        assert len(reduces) == 15 and sum(c["size_bytes"] for c in reduces) == 306_684_384
        assert {c["api"] for c in calls} == {"record_param_comms"}
    else:
        for op, sizes in annotated_sizes(doc).items():
            assert [c["size_bytes"] for c in calls if c["op"] == op] == sizes, op
        assert {c["api"] for c in calls} == {"nccl:all_reduce", "nccl:_all_gather_base", "nccl:all_to_all"}
    assert sum(c["time_s"] for c in calls) == pytest.approx(launched_kernel_time(doc), abs=1e-9)


# ----------------------------------------------------------------------------- two communicators, by hand
def host(name, ts, dur, **args):
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur, "args": args}


def device(name, ts, dur, stream, **args):
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": stream,
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream, "device": 0, **args},
    }


def params(name, nelems_in, nelems_out, dtype, group):
    """What newer torch records of a call, in record_param_comms and in its NCCL kernel's args."""
    return {
        "Collective name": name,
        "In msg nelems": nelems_in,
        "Out msg nelems": nelems_out,
        "dtype": dtype,
        "Group size": 2,
        "Process Group Name": group,
    }


AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def test_two_communicators_pair_each_call_with_its_own_groups_kernel():
    """DeepSpeed's cloned world group ("1", stream 30) beside the default group ("0", stream 20), no
    launches in the trace: the all-gather, issued second, runs first on its idle stream while the first
    all-reduce waits on stream 20. Issue order across the device would give the first all-reduce the
    all-gather's kernel (40 us) and the all-gather the all-reduce's (100 us)."""
    reduce_args = params("allreduce", 1000, 1000, "Float", "0")
    gather_args = params("_allgather_base", 300, 600, "BFloat16", "1")
    small_args = params("allreduce", 50, 50, "Float", "0")
    events = [
        host("c10d::allreduce_", 0, 8),
        host("record_param_comms", 1, 6, **reduce_args),
        host("c10d::_allgather_base_", 10, 8),
        host("record_param_comms", 11, 6, **gather_args),
        host("c10d::allreduce_", 20, 8),
        host("record_param_comms", 21, 6, **small_args),
        device("ampere_sgemm_128x64_nn", 0, 150, 7),
        device(AG, 30, 40, 30, **gather_args),
        device(AR, 100, 100, 20, **reduce_args),
        device(AR, 210, 10, 20, **small_args),
    ]
    calls = torch_collectives(events, world=2)
    assert [(c["op"], c["size_bytes"], c["dtype"]) for c in calls] == [
        ("all_reduce", 4000, "Float"),
        ("all_gather", 1200, "BFloat16"),  # nccl-tests' S: the gathered output
        ("all_reduce", 200, "Float"),
    ]
    assert [c["time_s"] for c in calls] == pytest.approx([100e-6, 40e-6, 10e-6])
    assert [c["overlapped_s"] for c in calls] == pytest.approx([50e-6, 40e-6, 0.0])  # the sgemm, 0..150


def launch(ts, correlation):
    return {**host("cudaLaunchKernel", ts, 2, correlation=correlation), "cat": "cuda_runtime"}


def two_stream_trace(with_launches: bool) -> list[dict]:
    """ZeRO's gradient all-reduce (1,000 fp32) on the default group's stream 20, then an all-reduce of one
    fp32 (a norm) on the cloned group's stream 30, whose kernel runs first. The calls record no shapes and
    no record_param_comms (a trace filtered down to the c10d ops): the sizes are in the kernels' args."""
    one = {"Collective name": "allreduce", "In msg nelems": 1, "Out msg nelems": 1, "dtype": "Float"}
    grads = {**one, "In msg nelems": 1000, "Out msg nelems": 1000}
    events = [
        host("c10d::allreduce_", 0, 8),
        host("c10d::allreduce_", 10, 8),
        device(AR, 30, 20, 30, correlation=502, **one),
        device(AR, 100, 100, 20, correlation=501, **grads),
    ]
    return events + ([launch(2, 501), launch(12, 502)] if with_launches else [])


def test_two_streams_are_paired_by_each_kernels_launch():
    """Each call gets the kernel it launched: pairing in issue order across the device would give the
    gradients' all-reduce the norm's kernel, 4 bytes in 20 us, and the norm 4,000 bytes."""
    grads, norm = torch_collectives(two_stream_trace(with_launches=True), world=2)
    assert (grads["size_bytes"], grads["dtype"], grads["time_s"]) == (4000, "Float", pytest.approx(100e-6))
    assert (norm["size_bytes"], norm["time_s"]) == (4, pytest.approx(20e-6))


def test_without_launches_or_group_names_two_streams_are_not_guessed_between():
    """Neither a launch nor a process group ties a call to a stream: the calls' sizes and times stay
    unknown (None), not another communicator's kernel's, and the kernels are not counted twice."""
    calls = torch_collectives(two_stream_trace(with_launches=False), world=2)
    assert [(c["op"], c["size_bytes"], c["time_s"], c["overlapped_s"]) for c in calls] == [
        ("all_reduce", None, None, None)
    ] * 2


# ------------------------------------------------------------------------------------------ harness trace
def test_harness_trace_prints_each_op_with_calls_bytes_and_bandwidths(capsys):
    assert main(["trace", str(trace_path(DDP))]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if "all_reduce" in line]
    cells = [cell.strip() for cell in row.split("│") if cell.strip()]
    assert cells[:4] == ["all_reduce", "15", "306,684,384", "46.76 ms"]
    assert "rank 0 of 2, timed by NCCL kernels" in out


def test_harness_trace_json_gives_each_ranks_ops_with_nccl_tests_bus_factors(capsys):
    """One JSON document, a file per rank; busbw = algbw x 2(n-1)/n for an all_reduce of 128 ranks,
    (n-1)/n for all_gather and all_to_all (nccl-tests)."""
    assert main(["trace", "--json", *(str(trace_path(name)) for name in SAMPLED)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(f["rank"], f["world_size"]) for f in doc["files"]] == [(0, 128), (1, 128)]
    for f in doc["files"]:
        ops = f["ops"]
        assert ops["all_reduce"]["calls"] == 4 and ops["all_reduce"]["bytes"] == sum(
            c["size_bytes"] for c in f["collectives"] if c["op"] == "all_reduce"
        )
        for op, factor in [
            ("all_reduce", 2 * 127 / 128),
            ("all_gather", 127 / 128),
            ("all_to_all", 127 / 128),
        ]:
            o = ops[op]
            assert o["algbw_Bps"] == pytest.approx(o["bytes"] / o["time_s"])
            assert o["busbw_Bps"] == pytest.approx(o["algbw_Bps"] * factor)
            assert 0 <= o["overlap_fraction"] < 1


@pytest.mark.parametrize(
    "content, expected",
    [
        (None, "no such file"),
        (b"# a README, not a trace\n", "not JSON"),
        (b"\x1f\x8b\x08\x00 cut short", "not a readable gzip file"),
        (json.dumps({"schemaVersion": 1}).encode(), "not a PyTorch profiler trace (no traceEvents list)"),
    ],
)
def test_harness_trace_of_a_file_that_is_no_trace_is_one_line_and_exit_2(content, expected, tmp_path, capsys):
    path = tmp_path / "rank0.json.gz" if content and content.startswith(b"\x1f\x8b") else tmp_path / "x.json"
    if content is not None:
        path.write_bytes(content)
    assert main(["trace", str(path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"harness: error: {path}: {expected}"), captured.err
    assert captured.out == ""


@pytest.mark.unit
def test_nccl_at_world_1_is_sized_from_its_annotation_and_left_untimed():
    """An H200's NCCL 2.28 all_reduce of 262,144 fp32 at world 1 (torch 2.11) launches no kernel: the trace
    holds the c10d op and its `nccl:all_reduce` annotation only. The call is sized from the annotation and
    has no time, since no device work is there to time (harness doctor --gpu's one-GPU check reads it)."""
    doc = load(H200_WORLD1)
    assert not nccl_kernels(doc) and not [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    [call] = torch_collectives(doc["traceEvents"], 1)
    assert (call["op"], call["size_bytes"], call["dtype"]) == ("all_reduce", 262144 * 4, "float")
    assert call["time_s"] is None and call["overlapped_s"] is None
