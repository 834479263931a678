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
import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from backends.faults import inject_fault
from backends.process_stats import rank_from_env
from core.config import RunConfig
from core.hooks import NO_HOOKS, TestHooks
from core.process import seen_process_settings


class WrongResult(RuntimeError):
    """A collective returned something other than the known answer."""


class Collectives(ABC):
    """One rank's handle on a stack's collective API: buffers, the call, and the device's synchronisation."""

    framework = ""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.spec = cfg.commbench_spec
        self.rank = rank_from_env()
        self.world_size = cfg.topology.world_size
        self.device_name = "cpu"

    @abstractmethod
    def prepare(self, op: str, elements: int, value: float):
        """Buffers for one call of `op` on a message of `elements` elements (CommbenchSpec.sizes' count),
        the input filled with `value`; returned as whatever `call` and `result` take."""

    @abstractmethod
    def call(self, op: str, buffers) -> None:
        """Issue `op` on `buffers` with this stack's API; returns when the framework does (the loop then
        synchronises the device)."""

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


def timed_calls(comm: Collectives, op: str, buffers, iters: int) -> list[float]:
    """Seconds of `iters` calls, each alone: from a barrier to the device being idle again."""
    times = []
    for _ in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        comm.call(op, buffers)
        comm.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def run_collectives(comm: Collectives, cfg: RunConfig, hooks: TestHooks = NO_HOOKS) -> dict:
    """Time every op at every size; returns the raw rank record (per call times, nothing derived).

    A timed call runs from a barrier to the device being idle again, so each is one collective on its own:
    unlike nccl-tests, which times a batch of calls back to back, launch overhead is included (the cost a
    training step pays for a collective issued alone). A fault hook (core.hooks) counts (op, size) points
    as steps."""
    spec = comm.spec
    points, index = [], 0
    for op in spec.ops:
        for size in spec.sizes:
            inject_fault(hooks, comm.rank, index)
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
            points.append(point)
            if comm.rank == 0:
                print(
                    f"commbench {index}/{len(spec.ops) * len(spec.sizes)} {op} {size} B "
                    f"median {statistics.median(point['times']) * 1e6:.1f} us",
                    flush=True,
                )
    return {
        "rank": comm.rank,
        "host": socket.gethostname(),
        "device": comm.device_name,
        "pid": os.getpid(),
        "status": "ok",
        "collectives": points,
        "versions": {"python": platform.python_version(), **comm.versions()},
        "interpreter": sys.executable,  # the environment this rank ran in (RunConfig.python)
        "threads": cfg.topology.threads_per_worker,
        "process_settings": seen_process_settings(),
    }
