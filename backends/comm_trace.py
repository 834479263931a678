"""Collectives read out of a framework's own trace of a few profiled steps: which op, how many bytes, how
long, and how much of that time the rank's compute ran alongside. Framework-free: the workers hand in the
trace their profiler wrote (a Chrome-trace event list), and the rank record gets one entry per collective.

Sizes follow nccl-tests (`size_bytes`: the whole buffer of all_reduce and broadcast, the gathered output of
all_gather, the input a reduce_scatter splits, one rank's send buffer of all_to_all), so the figures derived
from them (harness.analyze.metrics) use the same bus factors as commbench.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import json
import math
import os
import re
import socket
import stat
import struct
import sys
import tempfile
from collections.abc import Hashable
from contextlib import contextmanager
from datetime import datetime, timedelta

# torch's c10d ops, as the profiler names them on the issuing thread -> (op, index of the input in Input Dims)
C10D_OPS = {
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "c10d::_allgather_base_": ("all_gather", 1),
    "c10d::allgather_": ("all_gather", 1),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 1),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::alltoall_base_": ("all_to_all", 1),
}
# Element bytes by the dtype names the instruments write: torch's C++ names, numpy's (Horovod, TensorFlow).
DTYPE_BYTES = {
    "float": 4,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "double": 8,
    "int": 4,
    "long int": 8,
    "unsigned char": 1,
    "signed char": 1,
    "bool": 1,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    # c10::ScalarType's names, as record_param_comms and the NCCL kernels' args write them; older torch's
    # Input type spells int64 "long"
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
    "long": 8,
}


def elements(dims) -> int:
    """Elements of a tensor (its shape; [] is a scalar) or of a TensorList's tensors (a list of shapes),
    from the profiler's Input Dims entry."""
    if dims and all(isinstance(d, list) for d in dims):
        return sum(math.prod(d) for d in dims)
    return math.prod(dims)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    """Seconds of [start, end] covered by the (merged) busy intervals."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy if a < end and b > start)


def size_elements(op: str, sent: int, world: int) -> int:
    """nccl-tests' size S in elements, from the elements of this rank's input: an all_gather's S is the
    gathered output, every other op's its input."""
    return sent * world if op == "all_gather" else sent


def collective(op, api, elements, dtype, world, start_s, time_s, overlapped_s) -> dict:
    """One call's entry in the rank record; `elements`: its size S (size_elements), None if unknown."""
    element_bytes = DTYPE_BYTES.get(dtype)
    return {
        "op": op,
        "api": api,
        "elements": elements,
        "dtype": dtype,
        "size_bytes": elements * element_bytes if element_bytes and elements else None,
        "group_size": world,
        "start_s": start_s,
        "time_s": time_s,
        "overlapped_s": overlapped_s,
    }


def torch_collectives(trace_events: list[dict], world: int) -> list[dict]:
    """The collectives of a torch.profiler Chrome trace, one dict per call on this rank.

    The issuing thread's c10d op names the API call and its tensors; the call itself runs asynchronously
    (gloo: an event `gloo:<op>` on one of gloo's threads; NCCL: an `nccl...Kernel` on a CUDA stream), whose
    interval is the collective's time. On CPU each c10d op is paired with the first later unpaired gloo
    event of the same input size, and compute overlap is the part of that interval during which the
    issuing thread ran aten ops. A trace with NCCL kernels is read by nccl_collectives."""
    spans = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in spans if is_nccl_kernel(e)), key=lambda e: e["ts"])
    if kernels:
        return nccl_collectives(spans, kernels, world)
    calls = sorted((e for e in spans if e["name"] in C10D_OPS), key=lambda e: e["ts"])
    if not calls:
        return []
    main_tid = calls[0]["tid"]
    gloo = sorted((e for e in spans if e["name"].startswith("gloo:")), key=lambda e: e["ts"])
    # the collectives run on gloo's threads: the rank's compute is the issuing thread's aten ops
    busy = union(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in spans
            if e["tid"] == main_tid and e["name"].startswith("aten::")
        ]
    )
    t0 = min(e["ts"] for e in spans)
    used: set[int] = set()
    out = []
    for call in calls:
        op, which = C10D_OPS[call["name"]]
        args = call.get("args", {})
        dims = args.get("Input Dims") or []
        sent = elements(dims[which]) if len(dims) > which else 0
        work = None
        for i, candidate in enumerate(gloo):
            if i in used:
                continue
            g_dims = candidate.get("args", {}).get("Input Dims") or []  # the same input size, started after
            if candidate["ts"] < call["ts"] or not g_dims or elements(g_dims[0]) != sent:
                continue
            work = candidate
            used.add(i)
            break
        work_types = (work or {}).get("args", {}).get("Input type") or [None]
        dtype = next(
            (t for t in [work_types[0], args.get("dtype"), *args.get("Input type", [])] if t in DTYPE_BYTES),
            None,
        )
        start, duration = (work["ts"], work["dur"]) if work else (call["ts"], None)
        out.append(
            collective(
                op,
                call["name"],
                size_elements(op, sent, world),
                dtype,
                args.get("Group size") or world,
                (start - t0) / 1e6,
                duration / 1e6 if duration is not None else None,
                overlap(start, start + duration, busy) / 1e6 if duration else None,
            )
        )
    return out


# kineto's categories of what ran on a device (a stream's row); everything else ran on a host thread
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
# The op's family in a name, once lower-cased and stripped to letters, however the trace spells it
OP_PREFIXES = (
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
)
NCCL_KERNEL = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")


def is_nccl_kernel(e: dict) -> bool:
    return e.get("cat") == "kernel" and "nccl" in e["name"].lower()


def op_named(name: str | None) -> str | None:
    """The collective a name in the trace stands for, in each of its spellings: a c10d op
    (c10d::_allgather_base_), ProcessGroupNCCL's annotation (nccl:all_reduce), record_param_comms'
    Collective name (allgather_into_tensor_coalesced), an NCCL kernel's op (AllReduce). None for what
    nccl-tests has no bus factor for (send, recv, barrier, wait, reduce, gather, scatter)."""
    if not name:
        return None
    key = re.sub(r"[^a-z]", "", name.rsplit(":", 1)[-1].lower())
    return next((op for prefix, op in OP_PREFIXES if key.startswith(prefix)), None)


def listed_elements(dims, kind) -> int | None:
    """elements() of one Input Dims entry, or None where the profiler recorded no shape: a TensorList
    given as [] (older torch writes no shapes of a list's tensors; an empty list is no collective)."""
    if dims is None or (kind == "TensorList" and dims == []):
        return None
    return elements(dims)


def call_facts(op: str, anchor: dict, found: dict, kernels: list[dict], world: int):
    """(elements S, dtype, group size) of one call. Its own events first, the most exact first:
    record_param_comms' In/Out msg nelems and dtype (an all_gather's S is Out msg nelems, the gathered
    output), ProcessGroupNCCL's nccl:<op> annotation (its input tensor), the c10d op's Input Dims (as on
    CPU); then its kernels' args (newer torch copies record_param_comms' fields there), which are only as
    right as the pairing. The size and the dtype each come from the first source that has them; what no
    source has stays None."""

    def message(args: dict) -> tuple | None:
        if "In msg nelems" not in args or op_named(args.get("Collective name")) != op:
            return None
        return args["Out msg nelems" if op == "all_gather" else "In msg nelems"], args.get("dtype"), args

    own = [m for a in found["params"] if (m := message(a))]
    paired = [m for k in kernels if (m := message(k.get("args", {})))]
    group = next((m[2]["Group size"] for m in own + paired if m[2].get("Group size")), world)

    def tensor(args: dict, i: int) -> tuple:  # (Input Dims, Input type) of an event's i-th input
        dims, kinds = args.get("Input Dims") or [], args.get("Input type") or []
        return (dims[i] if len(dims) > i else None, kinds[i] if len(kinds) > i else None)

    tensors = [tensor(note.get("args", {}), 0) for note in found["annotations"]]
    if anchor["name"] in C10D_OPS:
        tensors.append(tensor(anchor.get("args", {}), C10D_OPS[anchor["name"]][1]))
    sources = [m[:2] for m in own]
    for dims, kind in tensors:
        count = listed_elements(dims, kind)
        sources.append((None if count is None else size_elements(op, count, group), kind))
    sources += [m[:2] for m in paired]
    count = next((c for c, _ in sources if c is not None), None)
    dtype = next((d for _, d in sources if d in DTYPE_BYTES), None)
    return count, dtype, group


def same_communicator(group: str | None, kernel: dict, one_stream: bool) -> bool:
    """Whether a call of process group `group` (its Process Group Name, None if unrecorded) may have run
    `kernel`: by the kernel's group where both are named, else only where the trace has one NCCL stream."""
    theirs = kernel.get("args", {}).get("Process Group Name")
    return group == theirs if group is not None and theirs is not None else one_stream


def nccl_collectives(spans: list[dict], kernels: list[dict], world: int) -> list[dict]:
    """The collectives of a torch.profiler trace of a GPU rank, one dict per call.

    A call is the host's outermost collective event on its thread: a c10d op (c10d::allreduce_), or where
    the trace has none, ProcessGroupNCCL's nccl:<op> annotation or a record_param_comms naming a
    collective. Its op is the c10d op's, else the Collective name's. Its time is the NCCL kernel(s) it
    launched: the kernel whose correlation id is a CUDA runtime call (cudaLaunchKernel) made inside it,
    exact across communicators. A trace without the launches pairs each call with the next unpaired
    kernel of its communicator (the same Process Group Name where call and kernel carry one, the one
    NCCL stream where there is only one) and never guesses across communicators: DeepSpeed's cloned
    world group runs on a second stream, whose kernels interleave with the first's. Where the trace has
    the launches, a kernel launched by no call in it (before the profiler started) counts alone, named by
    its args or its name (so does every kernel of a trace without calls).
    Compute overlap: the part of a kernel's interval during which other (non-NCCL) kernels ran, as
    Holistic Trace Analysis's get_comm_comp_overlap counts it."""
    host = sorted(
        (e for e in spans if e.get("cat") not in DEVICE_CATEGORIES), key=lambda e: (e["ts"], -e["dur"])
    )
    calls: list[dict] = []
    open_call: dict[tuple, dict] = {}  # per thread, the outermost call whose span is not over
    for e in host:
        thread = (e.get("pid"), e.get("tid"))
        call = open_call.get(thread)
        if call and e["ts"] <= call["anchor"]["ts"] + call["anchor"]["dur"]:
            pass
        elif (
            e["name"] in C10D_OPS
            or e["name"].startswith(("c10d::", "_c10d_functional::", "nccl:"))
            or (e["name"] == "record_param_comms" and op_named(e.get("args", {}).get("Collective name")))
        ):
            call = open_call[thread] = {"anchor": e, "params": [], "annotations": [], "launches": set()}
            calls.append(call)
        else:
            continue
        if e["name"] == "record_param_comms":
            call["params"].append(e.get("args", {}))
        elif e["name"].startswith("nccl:"):
            call["annotations"].append(e)
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            call["launches"].add(e["args"]["correlation"])
    launched = {c: i for i, call in enumerate(calls) for c in call["launches"]}
    ran: dict[int, list[dict]] = {}  # call index -> its kernels
    unpaired = []
    for k in kernels:
        i = launched.get(k.get("args", {}).get("correlation"))
        if i is None:
            unpaired.append(k)
        else:
            ran.setdefault(i, []).append(k)
    linked = bool(ran)  # the trace records the launches: an unlinked kernel was launched before it began
    if not linked:  # no launch in the trace: issue order, per communicator
        one_stream = len({k.get("args", {}).get("stream", k.get("tid")) for k in kernels}) == 1
        for i, call in enumerate(calls):
            group = next((a["Process Group Name"] for a in call["params"] if "Process Group Name" in a), None)
            kernel = next(
                (
                    k
                    for k in unpaired
                    if k["ts"] >= call["anchor"]["ts"] and same_communicator(group, k, one_stream)
                ),
                None,
            )
            if kernel is not None:
                unpaired.remove(kernel)
                ran[i] = [kernel]
    busy = union(
        [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "kernel" and not is_nccl_kernel(e)]
    )
    t0 = min(e["ts"] for e in spans)
    out = []
    for i, call in enumerate(calls):
        anchor = call["anchor"]
        op = C10D_OPS[anchor["name"]][0] if anchor["name"] in C10D_OPS else None
        if op is None:
            names = [a.get("Collective name") for a in call["params"]] + [
                n["name"] for n in call["annotations"]
            ]
            op = op_named(next((n for n in names if n), anchor["name"]))
        if op is not None:
            out.append((anchor["ts"], op, anchor["name"], call, ran.get(i, [])))
    for k in unpaired if linked or not calls else []:  # else they may be the calls' own, left unguessed
        args = k.get("args", {})
        named = NCCL_KERNEL.match(k["name"])
        op = op_named(args.get("Collective name") or (named and named[1]))
        if op is not None:
            call = {"anchor": k, "params": [], "annotations": []}
            out.append((k["ts"], op, k["name"].split("(")[0], call, [k]))
    entries = []
    for _, op, api, call, work in sorted(out, key=lambda x: x[0]):
        count, dtype, group = call_facts(op, call["anchor"], call, work, world)
        start = min((k["ts"] for k in work), default=call["anchor"]["ts"])
        entries.append(
            collective(
                op,
                api,
                count,
                dtype,
                group,
                (start - t0) / 1e6,
                sum(k["dur"] for k in work) / 1e6 if work else None,
                sum(overlap(k["ts"], k["ts"] + k["dur"], busy) for k in work) / 1e6 if work else None,
            )
        )
    return entries


HOROVOD_OPS = {
    "ALLREDUCE": "all_reduce",
    "ALLGATHER": "all_gather",
    "BROADCAST": "broadcast",
    "REDUCESCATTER": "reduce_scatter",
    "ALLTOALL": "all_to_all",
}
# The transfer inside an op's row, by the library that did it (Gloo, NCCL, MPI, oneCCL).
TRANSFER_PREFIXES = ("GLOO_", "NCCL_", "MPI_", "CCL_")


def timeline_events(text: str) -> list[dict]:
    """Horovod's timeline file: a Chrome-trace JSON array that is left open (no closing bracket) until
    Horovod shuts down, and may end in a comma."""
    body = text.strip().rstrip(",")
    if not body.endswith("]"):
        body += "]"
    return json.loads(body)


def horovod_collectives(events: list[dict], world: int) -> list[dict]:
    """The collectives of a Horovod timeline, one dict per call on this rank.

    The timeline has a row per tensor: the op (B ALLREDUCE ... E, whose end event carries dtype and shape)
    with its phases inside (NEGOTIATE_*, MEMCPY_IN_FUSION_BUFFER, then the transfer: GLOO_ALLREDUCE,
    NCCL_ALLREDUCE, GLOO_BCAST, ...). BROADCAST's end carries no shape: its size is unknown (None).
    Tensors fused into one buffer share one transfer: Horovod writes that transfer's begin for each of them
    in one loop (Timeline::ActivityStartAll), each stamped as it is written, microseconds apart. So one call
    is a run of begins of one transfer name that ends when a transfer begins after one of the run's has
    ended. Other events between them (ends, other tensors' negotiation, which another thread writes on
    GPU) do not end a run. Each run is one call (its elements summed), from its first begin to its last
    end. Responses that overlap in time (GPU finalizer threads in parallel) would be taken as one call.
    The timeline records no compute, so overlap is not known from it (None)."""
    transfers: dict[tuple[str, int], dict] = {}
    stacks: dict[Hashable, list] = {}  # pid -> its open begins; ("transfer", pid) -> its ended transfers
    run, run_name, run_ended = 0, None, False  # the run of one transfer's begins
    for e in events:
        pid, phase = e.get("pid"), e.get("ph")
        if phase == "B" and e.get("name", "").startswith(TRANSFER_PREFIXES):
            if e["name"] != run_name or run_ended:
                run, run_name, run_ended = run + 1, e["name"], False
        if phase == "B":
            stacks.setdefault(pid, []).append({**e, "run": run})
        elif phase == "E" and stacks.get(pid):
            begin = stacks[pid].pop()
            name = begin["name"]
            if name.startswith(TRANSFER_PREFIXES):
                stacks.setdefault(("transfer", pid), []).append((begin["run"], begin["ts"], e["ts"]))
                run_ended = run_ended or begin["run"] == run
            elif name in HOROVOD_OPS and stacks.get(("transfer", pid)):
                run_of, start, end = stacks[("transfer", pid)].pop()
                args = e.get("args") or {}
                shape = json.loads(args["shape"]) if "shape" in args else None  # ALLGATHER's: the output's
                count = math.prod(shape) if shape is not None else None
                call = transfers.setdefault(
                    (name, run_of),
                    {
                        "op": HOROVOD_OPS[name],
                        "elements": 0,
                        "dtype": args.get("dtype"),
                        "start": start,
                        "end": end,
                    },
                )
                call["start"], call["end"] = min(call["start"], start), max(call["end"], end)
                call["elements"] = (
                    None if count is None or call["elements"] is None else call["elements"] + count
                )
    t0 = min((e["ts"] for e in events if "ts" in e), default=0)
    out = []
    for call in sorted(transfers.values(), key=lambda c: c["start"]):
        out.append(
            collective(
                call["op"],
                "horovod " + call["op"].replace("_", ""),
                call["elements"],  # the end event's shape: the input, or ALLGATHER's output (both S)
                call["dtype"],
                world,
                (call["start"] - t0) / 1e6,
                (call["end"] - call["start"]) / 1e6,
                None,
            )
        )
    return out


# TensorFlow's collective kernels (the op type after the ':' of a profiler event's name) -> op
TF_OPS = {
    "CollectiveReduceV2": "all_reduce",
    "CollectiveGatherV2": "all_gather",
    "CollectiveReduceScatterV2": "reduce_scatter",
    "CollectiveAllToAllV2": "all_to_all",
    "CollectiveBcastSendV2": "broadcast",
    "CollectiveBcastRecvV2": "broadcast",
}


def tf_collectives(spans: list[dict], inputs: dict[str, tuple[int, str]], world: int) -> list[dict]:
    """The collectives of a TensorFlow profile, one dict per call on this rank.

    `spans`: the host events of the profile ({"name", "line", "start_s", "time_s"}); a collective kernel's
    event is named "<node>:<op type>" and times the collective. Its size is not in the profile: `inputs`
    gives each collective node's input (elements, dtype name), read from the traced functions' graphs.
    Overlap: the part of its time during which TensorFlow's compute threads (tf_Compute*) ran other ops."""
    busy = union(
        [
            (s["start_s"], s["start_s"] + s["time_s"])
            for s in spans
            if s["line"].startswith("tf_Compute") and "Collective" not in s["name"]
        ]
    )
    calls = sorted(
        (s for s in spans if s["name"].partition(":")[2] in TF_OPS and s["name"].partition(":")[0] in inputs),
        key=lambda s: s["start_s"],
    )
    t0 = min((s["start_s"] for s in spans), default=0.0)
    out = []
    for s in calls:
        node, _, kind = s["name"].partition(":")
        sent, dtype = inputs[node]
        end = s["start_s"] + s["time_s"]
        out.append(
            collective(
                TF_OPS[kind],
                kind,
                size_elements(TF_OPS[kind], sent, world),
                dtype,
                world,
                s["start_s"] - t0,
                s["time_s"],
                overlap(s["start_s"], end, busy),
            )
        )
    return out


# glog's line prefix (Paddle's C++ log): severity, MMDD, wall-clock time to the microsecond, thread id,
# file:line], message
GLOG_LINE = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) +(\d+) ([^:\]\s]+):\d+\] ?(.*)$")
# Paddle's EagerReducer (paddle/fluid/distributed/collective/reducer.cc) at VLOG(3)
REDUCER_GROUP = re.compile(r"The Group\[(\d+)\]:numel: (\d+) ;var number: (\d+)")
REDUCER_VAR_TYPE = re.compile(r"^var\[.*\] 's type is (\w+)")
REDUCER_START = re.compile(r"^group \[(\d+)\] start fused_allreduce")
# The files whose lines end a fused all-reduce (the reducer's own and the gradient hook's return): other
# files that log on the thread meanwhile (Paddle's API at a user's GLOG_v) run inside the call
REDUCER_FILES = ("reducer.cc", "accumulation_node.cc")
EPOCH = datetime(1970, 1, 1)


def glog_entries(text: str, now: datetime | None = None) -> list[tuple[int, str, str, str]]:
    """The lines glog wrote, as (microseconds since 1970, thread, file, message), in whole microseconds so
    differences are exact; a message's continuation lines (text without the prefix) are left out. glog
    writes no year: each line's is the latest that does not put it after `now` (default: the present; the
    log is read as it is written), so a log that runs past New Year's midnight counts on. Its times are
    local: a clock change while the log runs (daylight saving) is not undone."""
    now = now or datetime.now()
    entries: list[tuple[int, str, str, str]] = []
    for line in text.splitlines():
        m = GLOG_LINE.match(line)
        if not m:
            continue
        month, day, hour, minute, second, micro, thread, file, message = m.groups()
        fields = (int(month), int(day), int(hour), int(minute), int(second), int(micro))
        for year in range(now.year, now.year - 8, -1):  # back to a leap year for a 29 February
            try:
                when = datetime(year, *fields)
            except ValueError:
                continue
            if when <= now + timedelta(days=1):  # a day's slack for a log written in another time zone
                break
        entries.append(((when - EPOCH) // timedelta(microseconds=1), thread, file, message))
    return entries


def glog_levels(modules, environ) -> dict[str, int]:
    """The VLOG level glog gave each module from the environment: its GLOG_vmodule entry, else GLOG_v,
    else 0 (Paddle's binding can set a level but not read one back)."""
    vmodule = dict(item.split("=", 1) for item in environ.get("GLOG_vmodule", "").split(",") if "=" in item)
    default = environ.get("GLOG_v", "0")
    levels = {}
    for module in modules:
        level = vmodule.get(module, default).strip()
        levels[module] = int(level) if level.lstrip("-").isdigit() else 0
    return levels


def paddle_reducer_groups(text: str) -> dict:
    """Paddle DataParallel's gradient groups as its reducer logs them when it is built (VLOG 3 of
    reducer.cc): elements per group index, and the parameters' dtype (None if they differ)."""
    entries = glog_entries(text)
    groups = {int(m[1]): int(m[2]) for *_, msg in entries if (m := REDUCER_GROUP.search(msg))}
    dtypes = {m[1] for *_, msg in entries if (m := REDUCER_VAR_TYPE.search(msg))}
    return {"elements": groups, "dtype": dtypes.pop() if len(dtypes) == 1 else None}


def paddle_reducer_collectives(
    text: str, groups: dict, world: int, now: datetime | None = None
) -> list[dict]:
    """The collectives of Paddle DataParallel's reducer log over the traced steps, one dict per call.

    The reducer logs "group [k] start fused_allreduce" and then concatenates the group's gradients, scales
    them by 1/n and all-reduces them. On CPU the gloo all-reduce runs on the calling thread
    (ProcessGroupGloo::AllReduce runs its task before it returns), so the call ends before that thread's
    next line from REDUCER_FILES: the next group's start, the gradient hook's return
    (accumulation_node.cc, logged at the same level), or "Reducer is finished" after the last group, which
    follows the copy of the reduced gradients back into their tensors. A call's time thus includes its
    concatenation and scaling (and the last one's copy back): an upper bound by those copies. Nothing
    else runs on that thread meanwhile, so no compute overlaps it (0). `groups`: paddle_reducer_groups of
    the reducer's construction; `now`: as glog_entries takes it."""
    entries = glog_entries(text, now)
    t0 = entries[0][0] if entries else 0
    out = []
    for i, (start, thread, _, message) in enumerate(entries):
        m = REDUCER_START.search(message)
        if not m:
            continue
        end = next(
            (
                t
                for t, th, file, _ in itertools.islice(entries, i + 1, None)
                if th == thread and file in REDUCER_FILES
            ),
            None,
        )
        out.append(
            collective(
                "all_reduce",
                "paddle DataParallel fused_allreduce",
                groups["elements"].get(int(m[1])),
                groups["dtype"],
                world,
                (start - t0) / 1e6,
                (end - start) / 1e6 if end is not None else None,
                0.0 if end is not None else None,
            )
        )
    return out


@contextmanager
def captured_stderr():
    """What this process writes to file descriptor 2 for the duration (what C++ code logs there: glog), as
    the "text" of the dict it yields, set on exit. Where fd 2 is a regular file opened for appending (a
    worker's rank log), the text is read back from that file, so the log keeps every line as it is
    written, even if the process dies meanwhile. Otherwise fd 2 goes to a temporary file for the
    duration, and the text is then written on to the real stderr too."""
    sys.stderr.flush()
    captured: dict = {"text": ""}
    log = "/proc/self/fd/2"
    appended = stat.S_ISREG(os.fstat(2).st_mode) and fcntl.fcntl(2, fcntl.F_GETFL) & os.O_APPEND
    if appended and os.path.exists(log):  # every write lands at the file's end, where reading starts
        start = os.fstat(2).st_size
        try:
            yield captured
        finally:
            sys.stderr.flush()
            with open(log, "rb") as f:
                f.seek(start)
                captured["text"] = f.read().decode(errors="replace")
        return
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            data = sink.read()
            captured["text"] = data.decode(errors="replace")
            unwritten = memoryview(data)
            while unwritten:
                unwritten = unwritten[os.write(2, unwritten) :]


# struct tcp_info (linux/tcp.h): byte offsets of the counters read here (Linux 4.19+); TCP_INFO_BYTES is the
# struct's size up to tcpi_snd_wnd (5.4). tcpi_bytes_acked is not used: it waits for the peer's ACK, which
# may come after the reading, so a reading between steps would move bytes from one step to the next.
TCP_INFO_BYTES = 232
TCPI_NOTSENT_BYTES = 144  # u32: written by the application, not yet handed to the network
TCPI_BYTES_RECEIVED, TCPI_BYTES_SENT, TCPI_BYTES_RETRANS = 128, 200, 208  # u64


def tcp_endpoints() -> dict[str, tuple[str, str]]:
    """Every connected TCP socket of this network namespace by inode: (local, peer) as the kernel writes
    them in /proc/net/tcp and tcp6 (hex address:port)."""
    out = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and not fields[2].endswith(":0000"):  # a listening socket has no peer port
                out[fields[9]] = (fields[1], fields[2])
    return out


def tcp_counters() -> dict[tuple[str, str], tuple[int, int]]:
    """This process's connected TCP sockets, by (local, peer) endpoint: the kernel's count of the payload
    bytes written to them (sent, less retransmissions, plus not yet sent) and received, no TCP/IP headers.
    getsockopt(TCP_INFO) is called on each descriptor through libc, so no Python socket object wraps (and
    no default timeout changes) the framework's sockets; {} where the platform has no such interface."""
    if not hasattr(socket, "TCP_INFO") or not os.path.isdir("/proc/self/fd"):
        return {}
    libc = ctypes.CDLL(None, use_errno=True)
    endpoints = tcp_endpoints()
    counters = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        inode = link[len("socket:[") : -1] if link.startswith("socket:[") else None
        if inode not in endpoints:
            continue
        info = ctypes.create_string_buffer(TCP_INFO_BYTES)
        length = ctypes.c_uint32(TCP_INFO_BYTES)
        if libc.getsockopt(int(fd), socket.IPPROTO_TCP, socket.TCP_INFO, info, ctypes.byref(length)):
            continue
        if length.value < TCPI_BYTES_RETRANS + 8:  # a kernel before 4.19
            continue
        (notsent,) = struct.unpack_from("I", info.raw, TCPI_NOTSENT_BYTES)
        (received,) = struct.unpack_from("Q", info.raw, TCPI_BYTES_RECEIVED)
        sent, retransmitted = struct.unpack_from("QQ", info.raw, TCPI_BYTES_SENT)
        counters[endpoints[inode]] = (sent - retransmitted + notsent, received)
    return counters


def wire_bytes(before: dict, after: dict) -> dict:
    """Bytes this process's TCP connections carried between two tcp_counters() readings: over connections
    open at both readings, the difference; over one opened in between, all it carried. A connection
    whose both ends are this process's (a store's server and its client in one rank) is no traffic
    between ranks and is left out. A connection closed in between took its bytes with it: counted in
    `connections_closed`, so a reader knows the figure may be short."""
    local = {key for key in after if (key[1], key[0]) in after}
    moved = []
    for key, (sent, received) in after.items():
        was = before.get(key, (0, 0))
        if key not in local and (sent, received) != was:
            moved.append(
                {"endpoints": list(key), "sent_bytes": sent - was[0], "received_bytes": received - was[1]}
            )
    return {
        "sent_bytes": sum(c["sent_bytes"] for c in moved),
        "received_bytes": sum(c["received_bytes"] for c in moved),
        "connections": moved,
        "connections_closed": len(set(before) - set(after)),
    }
