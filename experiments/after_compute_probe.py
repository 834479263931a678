"""Does a collective cost more right after a burst of compute than commbench's back-to-back calls?

torch-ddp's matched cross-check (experiments/comm_crosscheck.py) prices its last bucket, issued after backward
with nothing beside it, at commbench's idle time, and the traced call takes about 1.7x that. commbench
times each call from a barrier with the processes otherwise idle; DDP's last bucket is issued the moment
backward's tens of milliseconds of compute end. This probe times one all-reduce between two gloo ranks
(torch.distributed, one thread per rank, as the suite's CPU runs) in those conditions, interleaved call by
call so drift hits them alike:

- back-to-back: a barrier, then the call (commbench's idle condition);
- after B ms idle: a barrier, B ms of sleep, then the call;
- after B ms compute: a barrier, B ms of matrix products on the rank's thread (as backward), then the call;
- after B ms spin: the same with a bare Python loop instead, which touches no memory (so not caches);
- after B ms compute, then S ms idle (`--settle-ms`): how long the effect lasts.

With `--cpu-time`, beside each condition the CPU time the rank's threads ran during the call
(/proc/self/task/*/schedstat), to tell a slower CPU from more waiting; reading it takes a little time
between the pause and the call, so the conditions are not quite the same as without.

Each call is taken as the last rank to arrive saw it (the least time over ranks), as the cross-check does.
`--skew-ms` makes rank 1 pause that much longer than rank 0, so rank 0 waits for it (a step's ranks
arrive apart).

    .venv/bin/python experiments/after_compute_probe.py --calls 80 --burst-ms 20,50 [--skew-ms 3] \\
        [--settle-ms 2,10] [--cpu-time]

`experiments/busy_burst_controls.py` times the same pauses before a fixed loop on a core and before
loopback TCP round trips, with no gloo: the controls.

Run it on a quiet machine: it is a timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.process import free_port  # noqa: E402

DDP_TINY_LAST_BUCKET = 807_680  # floats: torch-ddp's last bucket on the tiny workload


def pause(kind: str, seconds: float, a: torch.Tensor) -> None:
    """`kind`: none, idle, compute, spin, or compute+idle:<settle seconds>."""
    kind, _, settle = kind.partition("+idle:")
    if kind == "idle":
        time.sleep(seconds)
    elif kind in ("compute", "spin"):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if kind == "compute":
                a @ a
    if settle:
        time.sleep(float(settle))


def cpu_seconds() -> float:
    """CPU time this process's threads have run: this thread's from its CPU clock, the others' from the
    kernel's schedstat (which for a running thread lags by up to a tick: this one has just computed)."""
    total, me = time.thread_time(), str(threading.get_native_id())
    for tid in os.listdir("/proc/self/task"):
        if tid == me:
            continue
        try:
            total += int(open(f"/proc/self/task/{tid}/schedstat").read().split()[0]) / 1e9
        except OSError:  # the thread ended
            continue
    return total


def worker(
    rank: int, port: int, conditions, elements: int, calls: int, skew_s: float, cpu_time: bool, queue
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buffer, a = torch.ones(elements), torch.rand(256, 256)
    for _ in range(10):  # warm-up: connections, buffers
        dist.all_reduce(buffer)
    times = {label: [] for label, _, _ in conditions}
    cpu = {label: [] for label, _, _ in conditions}
    for _ in range(calls):
        for label, kind, seconds in conditions:
            dist.barrier()
            pause(kind, seconds + (skew_s if rank == 1 and kind != "none" else 0.0), a)
            cpu_start = cpu_seconds() if cpu_time else 0.0
            start = time.perf_counter()
            dist.all_reduce(buffer)
            times[label].append(time.perf_counter() - start)
            if cpu_time:
                cpu[label].append(cpu_seconds() - cpu_start)
    queue.put((rank, times, cpu))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--elements", type=int, default=DDP_TINY_LAST_BUCKET, help="fp32 elements a call")
    parser.add_argument("--calls", type=int, default=80, help="timed calls per condition")
    parser.add_argument("--burst-ms", default="20,50", help="comma-separated idle/compute lengths")
    parser.add_argument("--skew-ms", type=float, default=0.0, help="rank 1 pauses this much longer")
    parser.add_argument("--settle-ms", default="", help="comma-separated idle times after the compute")
    parser.add_argument("--cpu-time", action="store_true", help="also each call's CPU time (see above)")
    args = parser.parse_args()
    bursts = [float(ms) for ms in args.burst_ms.split(",")]
    conditions = [("back-to-back", "none", 0.0)]
    for ms in bursts:
        conditions += [
            (f"after {ms:g} ms idle", "idle", ms / 1e3),
            (f"after {ms:g} ms compute", "compute", ms / 1e3),
            (f"after {ms:g} ms spin", "spin", ms / 1e3),
        ]
        conditions += [
            (f"after {ms:g} ms compute, {settle} ms idle", f"compute+idle:{float(settle) / 1e3}", ms / 1e3)
            for settle in filter(None, args.settle_ms.split(","))
        ]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=worker,
            args=(rank, port, conditions, args.elements, args.calls)
            + (args.skew_ms / 1e3, args.cpu_time, queue),
        )
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    by_rank = {rank: times for rank, times, _ in results}
    cpu_by_rank = {rank: cpu for rank, _, cpu in results}
    for p in procs:
        p.join()
    print(
        f"all_reduce of {args.elements:,} fp32 ({args.elements * 4 / 2**20:.2f} MiB), 2 gloo ranks, 1 thread "
        f"each, {args.calls} calls per condition, rank 1 {args.skew_ms:g} ms later; ms, least over ranks"
    )
    base = None
    for label, _, _ in conditions:
        least = sorted(min(pair) * 1e3 for pair in zip(by_rank[0][label], by_rank[1][label]))
        median = statistics.median(least)
        base = base or median
        p10, p90 = least[len(least) // 10], least[9 * len(least) // 10]
        cpu = [c * 1e3 for r in cpu_by_rank.values() for c in r[label]]
        print(
            f"  {label:32s} median {median:6.2f}  p10 {p10:6.2f}  p90 {p90:6.2f}  ({median / base:.2f}x)"
            + (f"  CPU time a rank {statistics.median(cpu):5.2f}" if cpu else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
