"""`harness doctor`'s collective check, started by torchrun with N processes: every rank all-reduces
(rank + 1) and must get N(N+1)/2, over gloo (CPU) or NCCL (one GPU per rank).

With `--trace`, each rank then all-reduces TRACED_ELEMENTS fp32 values under torch's profiler and reads the
trace with the reader the runs use (backends.torch_trace), so a node whose profiler cannot see its
collectives (no NCCL kernels in the trace, say, or a dtype the reader cannot size) is found before a run's
collective trace comes back empty. It runs at any N, 1 included: NCCL launches its kernels at world 1 too,
which is the one collective a one-GPU node can check (there the call is sized from its annotation but
untimed: NCCL launches no kernel for it).
"""

import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # started as a script, as backends/worker.py

from backends.torch_trace import torch_collectives  # noqa: E402

TRACED_ELEMENTS = 1 << 18  # 1 MiB of fp32: large enough that the kernel shows, small enough for any node


def traced_all_reduce(device: torch.device, world: int) -> list[dict]:
    """The collectives the profiler saw around one all-reduce of TRACED_ELEMENTS fp32 values."""
    from torch.autograd import profiler

    value = torch.ones(TRACED_ELEMENTS, device=device)
    with profiler.profile(
        use_cpu=True,
        use_device="cuda" if device.type == "cuda" else None,
        record_shapes=True,
        use_kineto=True,
    ) as prof:
        dist.all_reduce(value)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return torch_collectives(events, world)


def main(backend: str, trace: bool = False) -> int:
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    value = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    print(f"rank {rank}: all_reduce sum {value.item():g} (expected {expected:g})", flush=True)
    ok = value.item() == expected
    if trace:
        calls = [c for c in traced_all_reduce(device, world) if c["op"] == "all_reduce"]
        traced = sum(c["size_bytes"] or 0 for c in calls)
        timed = sum(c["time_s"] is not None for c in calls)
        print(
            f"rank {rank}: traced all_reduce {len(calls)} call(s), {traced} bytes, {timed} timed "
            + (
                f"(expected 1 call, {TRACED_ELEMENTS * 4} bytes, untimed: NCCL launches no kernel at world 1)"
                if backend == "nccl" and world == 1
                else f"(expected 1 call, {TRACED_ELEMENTS * 4} bytes)"
            ),
            flush=True,
        )
        # NCCL launches no kernel for an all_reduce at world 1: the reader sizes the call from its
        # annotation but has no device time for it; from two ranks on the kernel times it.
        untimed = backend == "nccl" and world == 1
        ok = ok and len(calls) == 1 and traced == TRACED_ELEMENTS * 4 and timed == (0 if untimed else 1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], trace="--trace" in sys.argv[2:]))
