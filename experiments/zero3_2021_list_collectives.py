"""Why the SC21 ZeRO-3 rows miss: the 2021 DeepSpeed issued one collective per parameter tensor, each with
work that grows with the rank count, and a single cost per (rank x collective) fits all three rows.

    .venv/bin/python experiments/zero3_2021_list_collectives.py

The paper's DeepSpeed (v0.3.15, April 2021, the month of arXiv 2104.04473; stage3.py first tagged in
v0.3.12, and the same loops through v0.5.10, January 2022) gathered and reduced parameter by parameter with
torch.distributed's list collectives (deepspeed/runtime/zero/partition_parameters.py):

- `_allgather_param`, which `fetch_sub_module` and the prefetch call for every parameter: a Python loop of N
  `flat_tensor.narrow(...)` views, then `torch.distributed.all_gather(partitions, ...)`, after a
  `torch.cuda.synchronize()`;
- `_reduce_scatter_gradient`, for every parameter's gradient: a Python loop of N narrow views, then
  `torch.distributed.reduce_scatter(out, input_list)`;
- PyTorch's ProcessGroupNCCL serves a list collective through a flat buffer: after an all-gather it copies
  the flat result into each of the N outputs (`outputTensors[i][j].copy_(outputFlattened[i][j], true)`, with
  a recordStream per output), and before a reduce-scatter it copies the N inputs into one
  (`flatten_for_scatter_gather`).

So every per-parameter collective costs N view creations in Python and N copy kernels launched from C++, on
top of the NCCL call `harness predict` prices. Today's DeepSpeed gathers a bucket of parameters with one flat
`all_gather_into_tensor` and reduce-scatters flat buckets, so the product's deepspeed stack does not do this
and the model does not price it: like the InternEvo lead, this explains rows of another version of a stack.

What this prints, per SC21 row: the published extra time at n_large (the row's published n_small step x
n_small / n_large x (1 / published ratio - 1 / predicted ratio)); the per-parameter collectives of one step
(Megatron's GPT layer holds 12 parameter tensors: two layernorms' weight and bias, the QKV and output
projections' and the two MLP matrices' weight and bias; plus the word and position embeddings and the final
layernorm; each gathered for forward, gathered again for the recomputed forward and backward, and its
gradient reduce-scattered: 3 collectives a parameter, a lower bound); and the cost per (rank x collective)
that would make the O(N) work that extra: K x c x N at n_large against K x c x n_small scaled as the row's
published step is. Then it times, on this machine, the host work DeepSpeed's own loop does per rank (CPU
tensors: the view is created by the same host code on any device) and the Python-level `copy_` of a
one-element tensor (an upper bound on c10d's C++ per-output dispatch without the CUDA launch, which this
machine cannot time). Timings: run it on a quiet machine.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.predict.published import CHECK_FILE, load_rows  # noqa: E402

TENSORS_PER_LAYER = 12  # Megatron-LM ParallelTransformerLayer, biases on
TENSORS_OUTSIDE_LAYERS = 4  # word and position embeddings, final layernorm weight and bias
COLLECTIVES_PER_TENSOR = 3  # forward gather, backward (recompute) gather, gradient reduce-scatter
RANKS_TIMED = 1536


def argv_value(argv: list[str], flag: str) -> int:
    return int(argv[argv.index(flag) + 1])


def megatron_step_flops(row: dict) -> float:
    """Megatron's eq. 3 (the paper's own count, with the recompute) for one step of the row's global batch."""
    argv = row["argv"]
    layers, hidden = argv_value(argv, "--layers"), argv_value(argv, "--d-model")
    seq, vocab = argv_value(argv, "--seq-len"), argv_value(argv, "--vocab")
    batch = argv_value(argv, "--global-batch")
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


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
    checked = {r["id"]: r for r in json.loads(CHECK_FILE.read_text())["rows"]}
    print(
        "row | published step at n_small s | published extra at n_large s | collectives a step"
        " | implied µs per rank x collective"
    )
    implied = []
    for row in rows:
        n_s, n_l = row["n_small"], row["n_large"]
        step_small = megatron_step_flops(row) / (n_s * row["value_small"] * 1e12)
        published = row["value_large"] / row["value_small"]
        predicted = checked[row["id"]]["predicted_ratio"]["nominal"]
        extra = step_small * n_s / n_l * (1 / published - 1 / predicted)
        layers = argv_value(row["argv"], "--layers")
        collectives = COLLECTIVES_PER_TENSOR * (TENSORS_PER_LAYER * layers + TENSORS_OUTSIDE_LAYERS)
        # O(N) work K c N a step: at n_large K c n_l, at n_small K c n_s, which the published n_small step
        # already holds and the row's ratio carries to n_large as K c n_s x n_s / n_l
        per = extra / (collectives * (n_l - n_s * n_s / n_l))
        implied.append(per)
        print(f"{row['id']} | {step_small:.1f} | {extra:.1f} | {collectives} | {per * 1e6:.1f}")
    view_s, copy_s = per_rank_host_seconds(RANKS_TIMED)
    print(f"implied: {min(implied) * 1e6:.1f}-{max(implied) * 1e6:.1f} µs per rank and collective")
    print(
        f"timed here ({RANKS_TIMED} ranks, median of 30): DeepSpeed's narrow-view loop {view_s * 1e6:.2f} µs"
        f" a rank; a Python-level one-element copy_ {copy_s * 1e6:.2f} µs a call (no CUDA launch)"
    )


if __name__ == "__main__":
    main()
