"""What every stack's collective trace reader shares: the entry a rank record gets per collective call, the
dtype sizes, interval arithmetic, the contract of a reader of trace files, and the kernel's TCP counters.

Each stack reads its own instrument beside its adapter: the torch family's profiler traces in
backends.torch_trace, Horovod's timeline in backends.horovod_torch.trace, TensorFlow's profile in
backends.tf_mwms.trace, Paddle's reducer log in backends.paddle_fleet.trace. Every reader is framework-free:
the workers hand in what their profiler wrote, and the rank record gets one `collective` entry per call.
A stack whose trace is a file a user may hold names its reader (Backend.trace_reader), and `harness trace`
reads such files through it.

Sizes follow nccl-tests (`size_bytes`: the whole buffer of all_reduce and broadcast, the gathered output of
all_gather, the input a reduce_scatter splits, one rank's send buffer of all_to_all), so the figures derived
from them (harness.analyze.metrics) use the same bus factors as commbench.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from dataclasses import dataclass

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


@dataclass(frozen=True)
class TraceFile:
    """What a stack's reader of trace files (a Backend.trace_reader module's `read_trace_file(raw, world)`)
    found in one rank's file: its rank (None if the file does not say), the job's ranks, what timed the
    calls (shown by `harness trace`), and one `collective` entry per call."""

    rank: int | None
    world_size: int
    timed_by: str
    collectives: list[dict]


class NotThisFormat(ValueError):
    """Raised by a reader of trace files handed a file in another format; the message says what it found
    instead (`harness trace` tries each stack's reader and shows every reason when none reads the file)."""


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
