"""Controls for experiments/after_compute_probe.py: is what slows a gloo call right after a burst of
compute the CPU itself, or the network stack, rather than the collective's own threads?

Two plain processes (no framework), one per core, start every round together from a barrier, then pause
B ms (none, sleep, or a bare Python loop, the probe's "spin") and then, interleaved round by round:

- compute: time a fixed loop of Python arithmetic (about 1 ms) five times: is the core slower after both
  cores were busy (a host's throttling or frequency change would show here, and so would steal time,
  counted over the run from /proc/stat);
- tcp: K round trips of an M-byte message over one loopback TCP connection (TCP_NODELAY), rank 0 sending
  first: is the kernel's network path slower after the burst.

    python3 experiments/busy_burst_controls.py --burst-ms 50 --rounds 60 --bytes 1048576 --trips 2

Run it on a quiet machine: it is a timing. Any Python 3 runs it (it imports no framework).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.process import free_port  # noqa: E402

CONDITIONS = ("none", "sleep", "spin")


def pause(kind: str, seconds: float) -> None:
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "spin":
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def arithmetic(n: int = 20_000) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def receive(conn: socket.socket, n: int) -> None:
    got = 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("peer closed the connection")
        got += len(chunk)


def rank_main(rank: int, port: int, barrier, queue, args) -> None:
    if rank == 0:
        server = socket.create_server(("127.0.0.1", port))
        barrier.wait()
        conn, _ = server.accept()
    else:
        barrier.wait()
        conn = socket.create_connection(("127.0.0.1", port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    message = b"x" * args.bytes
    times = {(test, kind): [] for test in ("compute", "tcp") for kind in CONDITIONS}
    for _ in range(args.rounds):
        for kind in CONDITIONS:
            barrier.wait()
            pause(kind, args.burst_ms / 1e3)
            start = time.perf_counter()
            arithmetic()
            times["compute", kind].append(time.perf_counter() - start)
            barrier.wait()
            pause(kind, args.burst_ms / 1e3)
            start = time.perf_counter()
            for _ in range(args.trips):
                if rank == 0:
                    conn.sendall(message)
                    receive(conn, args.bytes)
                else:
                    receive(conn, args.bytes)
                    conn.sendall(message)
            times["tcp", kind].append(time.perf_counter() - start)
    conn.close()
    queue.put((rank, times))


def steal_ticks() -> tuple[int, int]:
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return fields[7], sum(fields)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--burst-ms", type=float, default=50.0, help="pause before each timing")
    parser.add_argument("--rounds", type=int, default=60, help="timings per test and condition")
    parser.add_argument("--bytes", type=int, default=1 << 20, help="message size of the TCP round trips")
    parser.add_argument("--trips", type=int, default=2, help="round trips a timing")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    barrier, queue, port = ctx.Barrier(2), ctx.Queue(), free_port()
    steal0, total0 = steal_ticks()
    procs = [ctx.Process(target=rank_main, args=(r, port, barrier, queue, args)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    steal1, total1 = steal_ticks()
    print(
        f"2 processes, {args.rounds} rounds, pause {args.burst_ms:g} ms; steal {steal1 - steal0} of "
        f"{total1 - total0} CPU ticks; ms (compute: both ranks' timings; tcp: rank 0's)"
    )
    for test in ("compute", "tcp"):
        base = None
        for kind in CONDITIONS:
            xs = sorted(
                x * 1e3 for r in (results if test == "compute" else [0]) for x in results[r][test, kind]
            )
            median = statistics.median(xs)
            base = base or median
            print(
                f"  {test:7s} after {kind:5s}  median {median:7.3f}  p10 {xs[len(xs) // 10]:7.3f}  "
                f"p90 {xs[9 * len(xs) // 10]:7.3f}  ({median / base:.2f}x)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
