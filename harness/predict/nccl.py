"""What one NCCL collective costs, as NCCL itself prices it when it picks an algorithm and a protocol.

NCCL's tuning model (src/graph/tuning.cc, ncclTopoTuneModel and ncclTopoGetAlgoTime, read at v2.23-v2.27)
gives every (algorithm, protocol) pair a latency and a bandwidth, and each call runs the pair with the
smallest `latency + size / bandwidth`: that is why a collective's achieved bandwidth depends on its size
and on the rank count. The constants below are NCCL's (microseconds and GB/s, as tuning.cc states them);
the bandwidth the pairs scale is the profile's achieved bus bandwidth of ring/Simple (what nccl-tests
reports for large messages), which stands in for NCCL's channels x per-channel bandwidth. The derivation,
with every constant's version history: docs/notes/2026-12-03-collectives-at-scale.md.

Modelled: ring (every op) and tree (all_reduce only), each in LL, LL128 and Simple; and, where the profile
has NVLink SHARP (NVSwitch with NVLS: DGX/HGX H100 and H200), NVLS (all_reduce in one node) and NVLSTree
(all_reduce across nodes), Simple only. Not modelled: NVLS for all_gather/reduce_scatter (in a node it
reaches the ring's bus bandwidth, 370 GB/s on 8 H100, so it changes no price; across nodes NCCL needs
CollNet for it), CollNet/SHARP, PAT (NCCL enables it only with one GPU per node); the per-channel caps of
the tree and LL128 (at 16 channels they bind on no catalogue profile); the plain-tree 0.85 factor (NCCL
applies it only to one tree pattern).
"""

from __future__ import annotations

import math

PROTOCOLS = ("LL", "LL128", "Simple")
# baseLat[algorithm][protocol], µs
BASE_LATENCY_US = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4)}
# hwLat[link][algorithm][protocol], µs: one pipeline hop over NVLink inside a node, over the network across
HOP_LATENCY_US = {
    "nvlink": {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)},
    "net": {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)},
}
# NVLS and NVLSTree have no base latency; hwLat[NVLINK] 25 µs for the in-node NVLink SHARP reduction, and
# NVLSTree adds hwLat[NET] 14 µs per tree level up and down (v2.23-v2.28.7; 20.9 from v2.28.9). tuning.cc also
# adds the graph's latencyInter to each network hop (twice for Simple): 0 on NCCL's own IB and socket
# transports, set only by a network plugin, so left out here as for the ring and the tree.
NVLS_LATENCY_US = 25.0
NVLS_TREE_NET_HOP_US = 14.0
# A ring that leaves the node still pays the network proxy's overhead at every step, intra-node ones too
# ("Inter-node rings still have to launch nsteps * net overhead"): 1 µs on an Intel host, x3 for Simple.
NET_OVERHEAD_US = 1.0
# Multi-node ring/Simple all_reduce: the latency x1.4 on sm80 and newer ("Plateau effect of ring").
RING_SIMPLE_PLATEAU = 1.4
# LL moves 8 bytes of data in a 16-byte line (data and flags): half the bus bandwidth, capped (llMaxBws:
# one node by architecture, then by the host CPU, Intel's row) at these GB/s.
LL_SHARE = 0.5
LL_MAX_BUSBW_GBPS = {"ampere": (87.7, 39.0, 20.4), "hopper": (141.0, 39.0, 20.4)}  # 1, 2, 3+ nodes
LL128_SHARE = 0.92  # 120 bytes of data in a 128-byte line
TREE_SHARE = 0.92
TREE_LL_DIVISOR = 3.8
TREE_LL128_SHARE = {"one_node": 7 / 9, "nodes": 120 / 128}
# treeCorrectionFactor[protocol][k] for sizes 64 B x 2^k (k = 0..22, the last for 256 MiB and up):
# "Trees are not perfectly sticking to the model for medium sizes".
TREE_CORRECTION = {
    "LL": (1, 1, 1, 1, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1, 1, 1, 1),
    "LL128": (1, 1, 1, 1, 1, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1, 1),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}  # fmt: skip


def tree_correction(protocol: str, size_bytes: float) -> float:
    k = int(math.log2(size_bytes / 64)) if size_bytes >= 64 else 0
    table = TREE_CORRECTION[protocol]
    return table[min(max(k, 0), len(table) - 1)]


def options(
    op: str, size_bytes: float, world: int, gpus_per_node: int, busbw_Bps: float, arch: str,
    nvls_busbw_Bps: float | None = None, tree_busbw_Bps: float | None = None,
) -> list:  # fmt: skip
    """Every (algorithm, protocol) NCCL would weigh for one call: (name, latency_s, seconds for the bytes).
    `size_bytes` is the nccl-tests size (a rank's buffer for all_reduce, the whole gathered tensor for
    all_gather / reduce_scatter); `busbw_Bps` the achieved ring/Simple bus bandwidth at this rank count;
    `nvls_busbw_Bps`, where the profile has NVLink SHARP, the achieved all_reduce bus bandwidth of NVLS (one
    node) or NVLSTree (across nodes) at this rank count (`Profile.nvls_busbw`), else None; `tree_busbw_Bps`
    the tree's, where it differs from the ring's (two nodes: `Profile.tree_busbw`)."""
    nodes = math.ceil(world / gpus_per_node)
    per_node = world // nodes
    column = min(nodes, 3) - 1
    ll_cap = LL_MAX_BUSBW_GBPS[arch][column] * 1e9
    all_reduce = op == "all_reduce"
    steps = 2 * (world - 1) if all_reduce else world - 1
    across = (2 if all_reduce else 1) * (nodes - 1)
    bus_factor = steps / world  # nccl-tests' busbw factor: 2(n-1)/n or (n-1)/n
    out = []
    for k, protocol in enumerate(PROTOCOLS):
        # ring
        intra = HOP_LATENCY_US["nvlink"]["ring"][k]
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
        network = HOP_LATENCY_US["net"]["ring"][k]
        latency = BASE_LATENCY_US["ring"][k] + (steps - across) * intra + across * network
        if all_reduce and nodes > 1 and protocol == "Simple":
            latency *= RING_SIMPLE_PLATEAU
        bus = {"LL": min(ll_cap, LL_SHARE * busbw_Bps), "LL128": LL128_SHARE * busbw_Bps}.get(
            protocol, busbw_Bps
        )
        out.append((f"ring/{protocol}", latency * 1e-6, size_bytes * bus_factor / bus))
        if not all_reduce or world == 1:
            continue
        # tree (all_reduce only): a chain inside each node, a double binary tree across nodes
        hops = (per_node - 1) * HOP_LATENCY_US["nvlink"]["tree"][k]
        hops += int(math.log2(nodes)) * HOP_LATENCY_US["net"]["tree"][k]
        latency = BASE_LATENCY_US["tree"][k] + 2 * hops
        bus = TREE_SHARE * (tree_busbw_Bps or busbw_Bps)
        if protocol == "LL":
            bus = min(bus / TREE_LL_DIVISOR, ll_cap)
        elif protocol == "LL128":
            bus *= TREE_LL128_SHARE["one_node" if nodes == 1 else "nodes"]
        algorithm_bw = 0.5 * bus * tree_correction(protocol, size_bytes)  # the tree's bus -> algorithm bw
        out.append((f"tree/{protocol}", latency * 1e-6, size_bytes / algorithm_bw))
    if all_reduce and nvls_busbw_Bps and world > 1:
        # NVLink SHARP reduces in the switch (one node); NVLSTree adds a tree of nodes over the network,
        # log2(nodes) levels up and down. The bytes at the measured NVLS bus bandwidth, nccl-tests' factor.
        if nodes == 1:
            out.append(("nvls/Simple", NVLS_LATENCY_US * 1e-6, size_bytes * bus_factor / nvls_busbw_Bps))
        else:
            latency = NVLS_LATENCY_US + 2 * int(math.log2(nodes)) * NVLS_TREE_NET_HOP_US
            out.append(("nvls_tree/Simple", latency * 1e-6, size_bytes * bus_factor / nvls_busbw_Bps))
    return out


def fastest(
    op: str, size_bytes: float, world: int, gpus_per_node: int, busbw_Bps: float, arch: str,
    latency_scale: float = 1.0, nvls_busbw_Bps: float | None = None, tree_busbw_Bps: float | None = None,
) -> tuple[str, float]:  # fmt: skip
    """The pair NCCL picks (its own model's fastest) and its seconds, the latency scaled by
    `latency_scale` (what measured small-message latencies say of NCCL's constants on a real fabric)."""
    name, latency, transfer = min(
        options(op, size_bytes, world, gpus_per_node, busbw_Bps, arch, nvls_busbw_Bps, tree_busbw_Bps),
        key=lambda o: o[1] + o[2],
    )
    return name, latency * latency_scale + transfer
