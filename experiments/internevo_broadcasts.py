"""What InternEvo's parameter sync would cost on the InternEvo rows' cluster, priced as `harness predict`
prices a collective: the lead for why those rows miss past 128 GPUs (docs/prediction.md).

    .venv/bin/python experiments/internevo_broadcasts.py

InternEvo's hybrid ZeRO-1 sends the updated parameters with one dist.broadcast per owning rank and
parameter group (internlm/solver/optimizer/hybrid_zero_optim.py, broadcast_params; overlap_sync_param off in
configs/7B_sft.py): N calls a step, each of 1/N of the parameters. DeepSpeed's stage 1, which the rows are
modelled as, issues one all-gather per parameter group. NCCL's broadcast is a ring pipeline, so each call is
priced here as nccl.py prices a ring call of its size (its latency grows with the ranks), at the profile's
nominal bandwidth and latency; one parameter group. The published loss is what the row's own step (4.03 s,
16,384 tokens at 4,062 tokens/s per GPU on 8 GPUs) lost beyond the model's ratio: 4.03 s x (1 / published
ratio - 1 / predicted ratio). Arithmetic only: no launch, no timing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.predict.hardware import load_profile  # noqa: E402
from harness.predict.published import CHECK_FILE, hardware, load_rows, row_configs  # noqa: E402

ELEMENT_BYTES = 2  # the bf16 module's parameters
STEP_AT_8_S = 16_384 / 4062  # the published 8-GPU step


def main() -> None:
    rows = [r for r in load_rows() if r["id"].startswith("internevo-")]
    checked = {r["id"]: r for r in json.loads(CHECK_FILE.read_text())["rows"]}
    profile = load_profile(hardware(rows[0]))
    params = None
    print("ranks | broadcasts s | one all-gather s | broadcasts less it s | published loss beyond model s")
    for row in sorted(rows, key=lambda r: r["n_large"]):
        _, large, _ = row_configs(row)
        params = params or large.model.spec.n_params
        n = row["n_large"]
        whole = params * ELEMENT_BYTES
        broadcasts = n * profile.collective_time("all_gather", whole / n, n, "nominal")
        gather = profile.collective_time("all_gather", whole, n, "nominal")
        predicted = checked[row["id"]]["predicted_ratio"]["nominal"]
        published = row["value_large"] / row["value_small"]
        lost = STEP_AT_8_S * (1 / published - 1 / predicted)
        print(f"{n:5d} | {broadcasts:12.2f} | {gather:16.2f} | {broadcasts - gather:20.2f} | {lost:.2f}")


if __name__ == "__main__":
    main()
