"""A plain, hand-written DDP training loop of the spec's GPT: the yardstick for the adapter's overhead.

torchrun --nproc-per-node N experiments/plain_ddp.py OUT.json --micro-batch 8 --steps 20 --warmup 3
Same model, weights, data, optimizer and threads as `harness run --backend torch-ddp`, with none of the
harness: batches are made before the loop, and a step is zero_grad, forward, backward, step, loss.item().
"""

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from workloads.data import Shard, SyntheticTokens, micro_batches  # noqa: E402
from workloads.spec import resolve  # noqa: E402
from workloads.torch_model import GPT, make_optimizer  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--workload", default="tiny")
p.add_argument("--micro-batch", type=int, default=8)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--threads", type=int, default=1)
args = p.parse_args()

torch.set_num_threads(args.threads)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
spec = resolve(args.workload)
model = DDP(GPT(spec).load_spec_weights(0))
opt = make_optimizer(model.module)
source, shard = SyntheticTokens(spec.vocab_size, spec.seq_len, 0), Shard(rank, world, args.micro_batch, 1)
batches = [
    [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in micro_batches(source, shard, s)]
    for s in range(args.warmup + args.steps)
]

times = []
for step, ((x, y),) in enumerate(batches):
    if step == args.warmup:
        faults_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    loss.item()
    if step >= args.warmup:
        times.append(time.perf_counter() - t0)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_at_start) / args.steps

gathered = [None] * world
dist.all_gather_object(gathered, {"step_times": times, "minor_faults_per_step": faults})
if rank == 0:
    Path(args.out).write_text(json.dumps({"ranks": gathered, "threads": args.threads, "world": world}))
dist.barrier()  # no rank tears gloo down while another still reads from it
dist.destroy_process_group()
