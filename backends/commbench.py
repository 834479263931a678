"""The worker side of `harness commbench`: the `Collectives` interface each stack implements with its own
collective API, and THE timing loop they all share. Nothing here imports a framework.

Every op and size is first called once on inputs whose correct output is known (rank r holds r + 1
everywhere) and checked: a wrong answer fails the run, since a fast wrong collective is no result. The
timed calls then run on zeros, so in-place all-reduces cannot overflow.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from backends.loop import inject_fault, rank_from_env
from core.config import CommbenchSpec, RunConfig
from core.process import seen_process_settings


class WrongResult(RuntimeError):
    """A collective returned something other than the known answer."""


# A burst: calls issued back to back, waited for together, as nccl-tests times its iterations and as
# DeepSpeed ZeRO-3 gathers its persistent parameters after every step (one call per tensor, all queued
# before the first is waited for). Timed up to BURST_MAX_BYTES, where a call's latency is most of its cost.
BURST_CALLS = 8
BURST_MAX_BYTES = 1 << 20


class Collectives(ABC):
    """One rank's handle on a stack's collective API: buffers, the call, and the device's synchronisation."""

    framework = ""
    burst_mode = "sequential"  # how call_burst issues its calls: "async" where the API returns handles

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        if cfg.commbench is None:
            raise ValueError("a commbench worker needs a commbench configuration (RunConfig.commbench)")
        self.spec = CommbenchSpec.from_dict(cfg.commbench)
        self.rank = rank_from_env()
        self.world_size = cfg.world_size
        self.device_name = "cpu"

    @abstractmethod
    def prepare(self, op: str, elements: int, value: float):
        """Buffers for one call of `op` on a message of `elements` elements (CommbenchSpec.sizes' count),
        the input filled with `value`; returned as whatever `call` and `result` take."""

    @abstractmethod
    def call(self, op: str, buffers) -> None:
        """Issue `op` on `buffers` with this stack's API; returns when the framework does (the loop then
        synchronises the device)."""

    def call_burst(self, op: str, buffer_sets: list) -> None:
        """Issue `op` on each of `buffer_sets` back to back and return when all are done. Here one call
        after another; a stack whose API returns handles queues them all first (burst_mode "async")."""
        for buffers in buffer_sets:
            self.call(op, buffers)

    def burst_results(self, op: str, buffer_sets: list) -> list[np.ndarray]:
        """The outputs of the last burst's calls, each as `result` gives one (a stack whose outputs are not
        its buffers keeps them from call_burst)."""
        return [self.result(op, buffers) for buffers in buffer_sets]

    @abstractmethod
    def result(self, op: str, buffers) -> np.ndarray:
        """The output of the last call as a flat float64 numpy array."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has arrived, so each timed call starts together."""

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on CPU, where the calls return when done)."""

    def versions(self) -> dict:
        return {}

    def close(self) -> None:
        """Tear down process groups so the launcher sees a clean exit."""


def message_elements(op: str, elements: int, world: int) -> tuple[int, int]:
    """(send, receive) buffer elements of one call of `op` on a message of `elements` (nccl-tests' size):
    an all_gather sends its share and receives the whole, a reduce_scatter the reverse; the others send and
    receive the whole (all_reduce and broadcast in one buffer, in place)."""
    share = elements // world
    if op == "all_gather":
        return share, elements
    if op == "reduce_scatter":
        return elements, share
    return elements, elements


def expected_output(op: str, elements: int, world: int) -> np.ndarray:
    """The correct output of `op` when rank r's input is r + 1 everywhere (broadcast's root is rank 0)."""
    total = world * (world + 1) / 2
    share = elements // world
    if op == "all_reduce":
        return np.full(elements, total)
    if op == "broadcast":
        return np.ones(elements)
    if op == "reduce_scatter":
        return np.full(share, total)
    if op in ("all_gather", "all_to_all"):  # chunk k came from rank k
        return np.repeat(np.arange(1, world + 1, dtype=np.float64), share)
    raise ValueError(f"unknown collective {op}")


def check_output(op: str, got: np.ndarray, elements: int, world: int, dtype: str) -> None:
    want = expected_output(op, elements, world)
    tolerance = 1e-2 if dtype == "bf16" else 1e-6  # bf16 holds 8 significant bits: sums round
    if got.shape != want.shape:
        raise WrongResult(
            f"{op} of {elements} elements over {world} ranks returned shape {got.shape}, "
            f"expected {want.shape}"
        )
    wrong = np.flatnonzero(~np.isclose(got, want, rtol=tolerance, atol=0))
    if wrong.size:
        i = int(wrong[0])
        raise WrongResult(
            f"{op} of {elements} elements over {world} ranks returned a wrong result: {wrong.size} "
            f"element(s) wrong, the first at index {i}: {got[i]:g}, expected {want[i]:g}"
        )


def timed(comm: Collectives, issue, iters: int, calls: int = 1) -> list[float]:
    """Seconds per call of `iters` runs of `issue()` (which makes `calls` calls), each run from a barrier to
    the device being idle again."""
    times = []
    for _ in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        issue()
        comm.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return times


def timed_calls(comm: Collectives, op: str, buffers, iters: int) -> list[float]:
    """Seconds of `iters` calls, each alone."""
    return timed(comm, lambda: comm.call(op, buffers), iters)


class ComputeLoad:
    """A thread of matrix products beside the calls, as a training step's compute runs beside its
    collectives: numpy's BLAS releases the GIL, so it holds the worker's cores (its thread count is the
    worker's, set in the environment) while the collective's own threads need them too."""

    SIDE = 256  # one product is ~34 MFLOP: a few ms on one core, so the thread stops promptly

    def __enter__(self):
        self._stop = threading.Event()
        self._started = threading.Event()
        self.products = 0
        self._thread = threading.Thread(target=self._spin, name="commbench-load", daemon=True)
        self._thread.start()
        self._started.wait()
        return self

    def _spin(self):
        try:
            a = np.random.default_rng(0).random((self.SIDE, self.SIDE), dtype=np.float32)
        finally:
            self._started.set()  # even if that failed, so __enter__ never waits for nothing
        while not self._stop.is_set():
            a @ a
            self.products += 1

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


def timed_bursts(comm: Collectives, op: str, buffer_sets: list, repeats: int) -> list[float]:
    """Seconds per call of `repeats` bursts, each a call on every one of `buffer_sets`."""
    return timed(comm, lambda: comm.call_burst(op, buffer_sets), repeats, len(buffer_sets))


def run_collectives(comm: Collectives, cfg: RunConfig) -> dict:
    """Time every op at every size; returns the raw rank record (per call times, nothing derived).

    A timed call runs from a barrier to the device being idle again, so each is one collective on its own:
    unlike nccl-tests, which times a batch of calls back to back, launch overhead is included (the cost a
    training step pays for a collective issued alone). Sizes up to BURST_MAX_BYTES are also timed in bursts
    of BURST_CALLS calls (the cost per call of calls queued back to back). With `under_load` every series is
    timed again beside a ComputeLoad. Fault injection counts (op, size) points as steps."""
    spec = comm.spec
    points, index = [], 0
    for op in spec.ops:
        for size in spec.sizes:
            inject_fault(cfg, comm.rank, index)
            index += 1
            elements = size // spec.element_bytes
            buffers = comm.prepare(op, elements, comm.rank + 1.0)
            comm.call(op, buffers)
            comm.synchronize()
            check_output(op, comm.result(op, buffers), elements, comm.world_size, spec.dtype)
            buffers = comm.prepare(op, elements, 0.0)
            for _ in range(spec.warmup):
                comm.call(op, buffers)
            comm.synchronize()
            point: dict[str, Any] = {
                "op": op,
                "bytes": size,
                "times": timed_calls(comm, op, buffers, spec.iters),
            }
            if spec.under_load:
                with ComputeLoad():
                    point["times_under_load"] = timed_calls(comm, op, buffers, spec.iters)
            if size <= BURST_MAX_BYTES:  # each call of a burst on buffers of its own, checked first too
                burst = [comm.prepare(op, elements, comm.rank + 1.0) for _ in range(BURST_CALLS)]
                comm.call_burst(op, burst)
                comm.synchronize()
                for got in comm.burst_results(op, burst):
                    check_output(op, got, elements, comm.world_size, spec.dtype)
                burst = [comm.prepare(op, elements, 0.0) for _ in range(BURST_CALLS)]
                point["burst_times"] = timed_bursts(comm, op, burst, spec.iters)
                if spec.under_load:
                    with ComputeLoad():
                        point["burst_times_under_load"] = timed_bursts(comm, op, burst, spec.iters)
            points.append(point)
            if comm.rank == 0:
                loaded = point.get("times_under_load")
                print(
                    f"commbench {index}/{len(spec.ops) * len(spec.sizes)} {op} {size} B "
                    f"median {statistics.median(point['times']) * 1e6:.1f} us"
                    + (f", under load {statistics.median(loaded) * 1e6:.1f} us" if loaded else ""),
                    flush=True,
                )
    return {
        "rank": comm.rank,
        "host": socket.gethostname(),
        "device": comm.device_name,
        "pid": os.getpid(),
        "status": "ok",
        "collectives": points,
        "burst": {"calls": BURST_CALLS, "mode": comm.burst_mode},
        "versions": {"python": platform.python_version(), **comm.versions()},
        "interpreter": sys.executable,  # the environment this rank ran in (RunConfig.python)
        "threads": cfg.threads_per_worker,
        "process_settings": seen_process_settings(),
    }
