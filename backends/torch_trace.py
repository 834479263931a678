"""The torch family's collective trace reader (torch-ddp, torch-fsdp, deepspeed): the collectives of a
torch.profiler (kineto) Chrome trace, on CPU (gloo work events) and on GPU (NCCL kernels). Framework-free, so
the workers (backends.torch_common) and `harness trace` (through Backend.trace_reader) read a trace with the
same code; entries are backends.comm_trace's.
"""

from __future__ import annotations

import json
import math
import re

from backends.comm_trace import (
    DTYPE_BYTES,
    NotThisFormat,
    TraceFile,
    collective,
    overlap,
    size_elements,
    union,
)

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


# record_function's name for a call of an inductor-compiled graph (forward or backward), then its cache key
COMPILED_GRAPH = "## Call CompiledFxGraph"


def elements(dims) -> int:
    """Elements of a tensor (its shape; [] is a scalar) or of a TensorList's tensors (a list of shapes),
    from the profiler's Input Dims entry."""
    if dims and all(isinstance(d, list) for d in dims):
        return sum(math.prod(d) for d in dims)
    return math.prod(dims)


def torch_collectives(trace_events: list[dict], world: int) -> list[dict]:
    """The collectives of a torch.profiler Chrome trace, one dict per call on this rank.

    The issuing thread's c10d op names the API call and its tensors; the call itself runs asynchronously
    (gloo: an event `gloo:<op>` on one of gloo's threads; NCCL: an `nccl...Kernel` on a CUDA stream), whose
    interval is the collective's time. On CPU each c10d op is paired with the first later unpaired gloo
    event of the same input size (without one, an `nccl:` annotation of that size gives its dtype, untimed:
    NCCL at world 1 launches no kernel), and compute overlap is the part of that interval during which the
    issuing thread ran aten ops or a graph torch.compile generated. A trace with NCCL kernels is read by
    nccl_collectives."""
    spans = [e for e in trace_events if e.get("ph") == "X" and "dur" in e]
    kernels = sorted((e for e in spans if is_nccl_kernel(e)), key=lambda e: e["ts"])
    if kernels:
        return nccl_collectives(spans, kernels, world)
    calls = sorted((e for e in spans if e["name"] in C10D_OPS), key=lambda e: e["ts"])
    if not calls:
        return []
    main_tid = calls[0]["tid"]
    gloo = sorted((e for e in spans if e["name"].startswith("gloo:")), key=lambda e: e["ts"])
    # A trace with c10d ops and no NCCL kernel: NCCL at world 1, which copies nothing and launches none;
    # the call is sized from its `nccl:<op>` annotation and left untimed (its host span is no device time).
    nccl_annotations = sorted((e for e in spans if e["name"].startswith("nccl:")), key=lambda e: e["ts"])
    annotated: set[int] = set()
    # the collectives run on gloo's threads: the rank's compute is the issuing thread's aten ops, and the
    # graphs torch.compile's inductor generated (their kernels are no aten ops; the profiler spans each call)
    busy = union(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in spans
            if e["tid"] == main_tid and e["name"].startswith(("aten::", COMPILED_GRAPH))
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
        if work is None:  # NCCL with no kernel (world 1): its annotation still names the tensor's dtype
            work = next(
                (
                    e
                    for e in nccl_annotations
                    if e["ts"] >= call["ts"]
                    and id(e) not in annotated
                    and elements((e.get("args", {}).get("Input Dims") or [[]])[0]) == sent
                ),
                None,
            )
            if work is not None:
                annotated.add(id(work))
        timed = work is not None and work["name"].startswith("gloo:")
        work_types = (work or {}).get("args", {}).get("Input type") or [None]
        dtype = next(
            (t for t in [work_types[0], args.get("dtype"), *args.get("Input type", [])] if t in DTYPE_BYTES),
            None,
        )
        start, duration = (work["ts"], work["dur"]) if timed and work else (call["ts"], None)
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


FILE_FORMAT = "PyTorch profiler (kineto) traces"


def read_trace_file(raw: bytes, world: int | None) -> TraceFile:
    """One rank's torch.profiler trace file (its JSON text): NotThisFormat if it is no such trace;
    ValueError if neither the trace (distributedInfo) nor `world` gives the number of ranks."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotThisFormat(f"not JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise NotThisFormat("not a PyTorch profiler trace (no traceEvents list)")
    info = doc.get("distributedInfo") or {}
    world_size = info.get("world_size") or world
    if not world_size:
        raise ValueError("the trace names no world size (no distributedInfo); give --world N")
    events = doc["traceEvents"]
    gpu = any(e.get("ph") == "X" and "name" in e and is_nccl_kernel(e) for e in events)
    return TraceFile(
        rank=info.get("rank"),
        world_size=world_size,
        timed_by="NCCL kernels" if gpu else "gloo work events",
        collectives=torch_collectives(events, world_size),
    )
