"""Which published rows each modelled term of `harness predict` moves: every row of
harness/predict/published_scaling_rows.yaml predicted with one term removed at a time, its nominal per-GPU
ratio (larger N over smaller) against the full model's. The prediction-at-scale issue's term table.

    .venv/bin/python experiments/predict_terms.py [--min-move 0.005]

Terms: those tests/test_predict_published.py takes out one at a time (its TERMS): NCCL's protocols (Simple
only), the tree (ring only), every latency (none), the bandwidth lost as nodes are added, the stragglers'
wait, the overlap's slowdown. Arithmetic only: no launch, no timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))
from test_predict_published import ROWS, TERMS, without  # noqa: E402

from harness.predict.calibration import Calibration  # noqa: E402
from harness.predict.model import predict_point  # noqa: E402
from harness.predict.published import row_configs  # noqa: E402


def ratio(row: dict, tweak=None) -> float:
    """The row's nominal per-GPU ratio, without its band (the test's costs 32 combinations of the ends)."""
    small, large, profile = row_configs(row, tweak)
    per_device = [
        predict_point(c, profile, Calibration(), 1e9, None)["corners"]["nominal"]["per_device_tokens_per_s"]
        for c in (small, large)
    ]
    return per_device[1] / per_device[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-move", type=float, default=0.005, help="the smallest move listed")
    args = parser.parse_args()
    full = {r["id"]: ratio(r) for r in ROWS}
    for term in TERMS:
        moved = []
        with pytest.MonkeyPatch.context() as patch:
            tweak = without(term, patch)
            for r in ROWS:
                change = ratio(r, tweak) - full[r["id"]]
                if abs(change) >= args.min_move:
                    moved.append(f"{r['id']} {change:+.3f}")
        print(f"## {term}: {len(moved)} rows move by {args.min_move} or more")
        print("\n".join(moved) or "(none)")


if __name__ == "__main__":
    main()
