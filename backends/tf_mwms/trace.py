"""TensorFlow's collective trace reader: the collectives of a TensorFlow profile of the traced steps, sized
from the traced functions' graphs (the tf-mwms worker reads both). Framework-free; entries are
backends.comm_trace's.
"""

from __future__ import annotations

from backends.comm_trace import collective, overlap, size_elements, union

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
