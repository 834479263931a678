"""`harness doctor`'s collective check, started by torchrun with N processes: every rank all-reduces
(rank + 1) and must get N(N+1)/2, over gloo (CPU) or NCCL (one GPU per rank)."""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(backend: str) -> int:
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
    dist.destroy_process_group()
    return 0 if value.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
