"""Under torchrun: count the collectives one FSDP2 training step issues, at grad_accum 1 and 2 (printed as
JSON by rank 0). Gradient reduction must happen once per step however many micro-batches it has."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from backends.loop import data_shard  # noqa: E402
from backends.torch_fsdp.worker import make_trainer  # noqa: E402
from core.config import RunConfig  # noqa: E402
from workloads.data import make_source, micro_batches  # noqa: E402
from workloads.spec import PRESETS  # noqa: E402

REDUCTIONS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
GATHERS = ("all_gather_single", "all_gather_into_tensor")
counts = {name: 0 for name in REDUCTIONS + GATHERS}


def counting(name):
    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    return wrapper


for name in counts:
    setattr(dist, name, counting(name))

result = {}
trainer = None
for accum in (1, 2):
    cfg = RunConfig.build(
        backend="torch-fsdp",
        workload="tiny",
        spec=PRESETS["tiny"],
        world_size=2,
        device="cpu",
        micro_batch=2,
        grad_accum=accum,
        threads_per_worker=1,
    )
    trainer = make_trainer(cfg)
    source = make_source(cfg.model.spec.vocab_size, cfg.model.spec.seq_len, cfg.global_batch, cfg.model.seed)
    batches = micro_batches(source, data_shard(cfg, trainer.rank), 0)
    trainer.step(batches)  # warm-up: lazy initialisation
    for name in counts:
        counts[name] = 0
    trainer.step(micro_batches(source, data_shard(cfg, trainer.rank), 1))
    result[accum] = {
        "reductions": sum(counts[n] for n in REDUCTIONS),
        "gathers": sum(counts[n] for n in GATHERS),
        "by_name": dict(counts),
    }
if trainer.rank == 0:
    print("COUNTS " + json.dumps(result), flush=True)
trainer.close()
