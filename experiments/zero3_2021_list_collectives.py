"""Why the SC21 ZeRO-3 rows miss: the 2021 DeepSpeed issued one collective per parameter tensor, each with
work that grows with the rank count; the cost per (rank x collective) each row's published loss implies is
of the same order in all three rows, about a CUDA launch or two.

    .venv/bin/python experiments/zero3_2021_list_collectives.py

The paper's DeepSpeed (v0.3.15, April 2021, the month of arXiv 2104.04473; stage3.py first tagged in
v0.3.12; v0.4.0 the same) gathered and reduced parameter by parameter with torch.distributed's list
collectives (deepspeed/runtime/zero/partition_parameters.py):

- `_allgather_param`, which `fetch_sub_module` and the prefetch call for every partitioned parameter: a
  `torch.cuda.synchronize()`, a Python loop of N `flat_tensor.narrow(...)` views, then
  `torch.distributed.all_gather(partitions, ...)`;
- `_allgather_params`, which `_post_step` calls for the persistent parameters (fewer elements than
  stage3_param_persistence_threshold, 100,000 by default: here every bias and layernorm tensor) after every
  step: one list all-gather, then for each parameter a Python loop of N narrow views and N `copy_`;
- `_reduce_scatter_gradient`, for every parameter's gradient: a Python loop of N narrow views, then
  `torch.distributed.reduce_scatter(out, input_list)`;
- PyTorch's ProcessGroupNCCL serves a list collective through a flat buffer: after an all-gather it copies
  the flat result into each of the N outputs (`outputTensors[i][j].copy_(outputFlattened[i][j], true)`, with
  a recordStream per output), and before a reduce-scatter it copies the N inputs into one
  (`flatten_for_scatter_gather`).

So every per-parameter collective costs N view creations in Python and N copy kernels, on top of the NCCL
call `harness predict` prices. DeepSpeed v0.5.10 (January 2022) gathers with `_all_gather_base` where
PyTorch has it (no views, no copies) and keeps the list reduce-scatter; today's DeepSpeed gathers and
reduce-scatters flat buckets. So the product's deepspeed stack does not do this and the model does not
price it: like the InternEvo lead, this explains rows of another version of a stack.

What this prints, per SC21 row: the published extra time at n_large, E = T_s x n_s / n_l x (1 / published
ratio - 1 / predicted ratio P), T_s the row's published n_small step (Megatron eq. 3 over its teraFLOP/s);
K, the per-parameter collectives of one step (Megatron's GPT layer holds 12 parameter tensors, 4 of them
weight matrices and 8 biases and layernorm tensors; outside the layers the word and position embeddings and
the final layernorm), as a range: with the default persistence threshold each weight is gathered at least
twice (forward, then the recomputed forward and backward) and each bias or layernorm tensor once (after the
step), every tensor's gradient reduce-scattered (28 a layer); with no persistent parameters every tensor is
gathered twice and reduce-scattered (36 a layer); and c, the cost per (rank x collective) that would make
the O(N) work that extra. If each step is the modelled part A (whose ratio the model has right) plus K c N,
then T_s = A_s + K c n_s, the n_large step is A_s n_s / (n_l P) + K c n_l, and E = K c (n_l - n_s^2 /
(n_l P)). Then it times, on this machine, the host work DeepSpeed's own loop does per rank (CPU tensors: the
view is created by the same host code on any device) and the Python-level `copy_` of a one-element tensor
(no CUDA launch, which this machine cannot time). Timings: run it on a quiet machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from core.config import RunConfig  # noqa: E402
from harness.predict.published import load_rows, published_ratio, row_configs  # noqa: E402
from harness.predict.published_check import load_check  # noqa: E402

# Megatron-LM's ParallelTransformerLayer (biases on): QKV, output projection and the two MLP matrices, and
# their 4 biases and the two layernorms' weight and bias (at hidden 12,288 or more, each under 100,000
# elements: persistent at DeepSpeed's default threshold)
WEIGHTS_PER_LAYER, SMALL_PER_LAYER = 4, 8
# per-parameter collectives a step: persistent (default threshold) or none persistent
PER_LAYER = {"default threshold": 2 * WEIGHTS_PER_LAYER + SMALL_PER_LAYER + 12, "none persistent": 3 * 12}
# word and position embeddings (2 gathers and a reduce-scatter each), final layernorm weight and bias
OUTSIDE = {"default threshold": 2 * 3 + 2 * 2, "none persistent": 4 * 3}
RANKS_TIMED = 1536


def megatron_step_flops(cfg: RunConfig) -> float:
    """Megatron's eq. 3 (the paper's own count, with the recompute) for one step of the global batch."""
    spec, batch = cfg.model.spec, cfg.batch
    sequences = batch.micro_batch * batch.grad_accum * cfg.topology.world_size
    layers, hidden, seq = spec.n_layers, spec.d_model, spec.seq_len
    return (
        96 * sequences * seq * layers * hidden**2
        * (1 + seq / (6 * hidden) + spec.vocab_size / (16 * layers * hidden))
    )  # fmt: skip


def per_rank_host_seconds(ranks: int, repeats: int = 30) -> tuple[float, float]:
    """Median seconds per rank of (DeepSpeed's loop of narrow views, a Python-level one-element copy_)."""
    import torch

    partition = 1024
    flat = torch.empty(partition * ranks, dtype=torch.float16)
    src, dst = torch.empty(1, dtype=torch.float16), torch.empty(1, dtype=torch.float16)
    rank = ranks // 2
    views, copies = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        partitions = []
        for i in range(ranks):
            partitions.append(flat.narrow(0, partition * i, partition))
            if i == rank:  # DeepSpeed copies its own shard into its own view
                partitions[i].copy_(flat[:partition])
        views.append((time.perf_counter() - start) / ranks)
        start = time.perf_counter()
        for _ in range(ranks):
            dst.copy_(src, non_blocking=True)
        copies.append((time.perf_counter() - start) / ranks)
    return statistics.median(views), statistics.median(copies)


def main() -> None:
    rows = [r for r in load_rows() if r["id"].startswith("megatron-sc21-zero3-")]
    checked = {r["id"]: r for r in load_check()}
    print(
        "row | published step at n_small s | published extra at n_large s | collectives a step (default"
        " threshold, none persistent) | implied µs per rank x collective"
    )
    implied = []
    for row in rows:
        n_s, n_l = row["n_small"], row["n_large"]
        small, _, _ = row_configs(row)
        step_small = megatron_step_flops(small) / (n_s * row["value_small"] * 1e12)
        published = published_ratio(row)
        predicted = checked[row["id"]]["predicted_ratio"]["nominal"]
        extra = step_small * n_s / n_l * (1 / published - 1 / predicted)
        counts = [PER_LAYER[k] * small.model.spec.n_layers + OUTSIDE[k] for k in PER_LAYER]
        per = [extra / (k * (n_l - n_s * n_s / (n_l * predicted))) for k in counts]
        implied += per
        print(
            f"{row['id']} | {step_small:.1f} | {extra:.1f} | {counts[0]}, {counts[1]} | "
            f"{max(per) * 1e6:.1f}, {min(per) * 1e6:.1f}"
        )
    view_s, copy_s = per_rank_host_seconds(RANKS_TIMED)
    print(f"implied: {min(implied) * 1e6:.1f}-{max(implied) * 1e6:.1f} µs per rank and collective")
    print(
        f"timed here ({RANKS_TIMED} ranks, median of 30): DeepSpeed's narrow-view loop {view_s * 1e6:.2f} µs"
        f" a rank; a Python-level one-element copy_ {copy_s * 1e6:.2f} µs a call (no CUDA launch)"
    )


if __name__ == "__main__":
    main()
