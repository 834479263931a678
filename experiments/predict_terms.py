"""Which published rows each modelled term of `harness predict` moves: every row of
tests/data/published_scaling_rows.yaml predicted with one term removed at a time, its nominal per-GPU
ratio (larger N over smaller) against the full model's. The prediction-at-scale issue's term table.

    .venv/bin/python experiments/predict_terms.py [--min-move 0.005]

Terms: NCCL's protocols (Simple only), the tree (ring only), every latency (none), the bandwidth lost as
nodes are added, the stragglers' wait, the overlap's slowdown. Arithmetic only: no launch, no timing.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from harness.cli import make_parser  # noqa: E402
from harness.predict import nccl  # noqa: E402
from harness.predict.command import configs  # noqa: E402
from harness.predict.hardware import load_profile  # noqa: E402
from harness.predict.model import Calibration, predict_point  # noqa: E402

ROWS = yaml.safe_load((REPO / "tests" / "data" / "published_scaling_rows.yaml").read_text())
FULL_OPTIONS = nccl.options


def hardware(row: dict) -> str:
    return str(REPO / row["hardware"]) if row["hardware"].endswith(".yaml") else row["hardware"]


def ratio(row: dict, tweak=None) -> float:
    gpus = f"{row['n_small']},{row['n_large']}"
    argv = ["predict", *row["argv"], "--hardware", hardware(row), "--gpus", gpus]
    profile = load_profile(hardware(row))
    if tweak:
        tweak(profile)
    small, large = (
        predict_point(c, profile, Calibration(), 1e9, None)["corners"]["nominal"]["per_device_tokens_per_s"]
        for c in configs(make_parser().parse_args(argv), profile)
    )
    return large / small


@contextlib.contextmanager
def nccl_options(replace):
    nccl.options = lambda *a, **k: replace(FULL_OPTIONS(*a, **k))
    try:
        yield
    finally:
        nccl.options = FULL_OPTIONS


TERMS = {
    "protocols (Simple only)": (lambda o: [x for x in o if x[0].endswith("Simple")], None),
    "tree (ring only)": (lambda o: [x for x in o if x[0].startswith("ring")], None),
    "latency (none)": (lambda o: [(name, 0.0, seconds) for name, _, seconds in o], None),
    "bandwidth lost at scale": (None, lambda p: p.inter_node.pop("scale_loss_per_doubling", None)),
    "stragglers": (None, lambda p: setattr(p, "step_cv", [0.0, 0.0, 0.0])),
    "overlap slowdown": (None, lambda p: setattr(p, "overlap_slowdown", [0.0, 0.0, 0.0])),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-move", type=float, default=0.005, help="the smallest move listed")
    args = parser.parse_args()
    full = {r["id"]: ratio(r) for r in ROWS}
    for term, (replace, tweak) in TERMS.items():
        moved = []
        for r in ROWS:
            with nccl_options(replace) if replace else contextlib.nullcontext():
                change = ratio(r, tweak) - full[r["id"]]
            if abs(change) >= args.min_move:
                moved.append(f"{r['id']} {change:+.3f}")
        print(f"## {term}: {len(moved)} rows move by {args.min_move} or more")
        print("\n".join(moved) or "(none)")


if __name__ == "__main__":
    main()
