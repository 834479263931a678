"""Horovod's collective trace reader: the collectives of a Horovod timeline, which the horovod worker starts
and stops around its traced steps (hvd.start_timeline). Framework-free; entries are backends.comm_trace's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable

from backends.comm_trace import collective

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
