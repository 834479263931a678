"""The published rows' outcomes as `harness predict` reads them: published_check.json, and what it says of
a prediction of one stack.

harness.predict.published writes the file, with this module's target and the stack a row is matched on.
It builds each row's configurations with `harness predict`'s own parser, so the command reads the file
through this module and never imports the rows' predictor: the two import each other one way only.
"""

from __future__ import annotations

import json
from pathlib import Path

from backends import get_backend
from core.config import RunConfig

CHECK_FILE = Path(__file__).with_name("published_check.json")
# The target a row is held to: the predicted ratio within this fraction of the published one, and the
# published ratio inside the predicted band (its slow end widened by the empirical scale-loss margin fitted
# without the row's publisher: harness.predict.margin).
RATIO_TOLERANCE = 0.15


def stack_of(cfg: RunConfig) -> str:
    """What a check is matched on: the stack and what it shards (its variants, such as a reduce dtype or
    DeepSpeed's native bf16, count as the same stack)."""
    backend = get_backend(cfg.backend)
    return f"{backend.name} ({backend.sharding(cfg)} sharded)"


def load_check(path: Path = CHECK_FILE) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def check(cfg: RunConfig, world_sizes: list[int], rows: list[dict] | None = None) -> dict:
    """What the published rows of this configuration's stack say of a prediction at `world_sizes`: how
    many met the target, at which rank counts, the published ratio as a share of the predicted one on
    those that missed, and whether the largest rank count asked is beyond every row."""
    rows = load_check() if rows is None else rows
    stack = stack_of(cfg)
    mine = [r for r in rows if r["stack"] == stack]
    out: dict = {"stack": stack, "rows": [r["id"] for r in mine], "file": CHECK_FILE.name}
    if not mine:
        return out | {"verdict": f"no published row checks {stack}"}
    missed = [r for r in mine if not r["meets_the_target"]]
    shares = {r["id"]: r["published_ratio"] / r["predicted_ratio"]["nominal"] for r in missed}
    below = [r for r in missed if r["published_ratio"] < r["band"][0]]
    largest = max(r["n_large"] for r in mine)
    out |= {
        "met": len(mine) - len(missed),
        "of": len(mine),
        "n_range": [min(r["n_small"] for r in mine), largest],
        "largest_met": max((r["n_large"] for r in mine if r["meets_the_target"]), default=None),
        "missed_share_of_predicted": [min(shares.values()), max(shares.values())] if shares else None,
        "worst": min(shares, key=shares.__getitem__) if shares else None,
        "below_the_band": len(below),
        "beyond": max(world_sizes) > largest,
        "below": max(world_sizes) < min(r["n_small"] for r in mine),
    }
    verdict = (
        f"{stack}: {out['met']} of {len(mine)} published rows met the target (ratio within "
        f"{RATIO_TOLERANCE:.0%}, inside the band), at {out['n_range'][0]:,}–{largest:,} GPUs"
    )
    if shares:
        low, high = out["missed_share_of_predicted"]
        verdict += (
            f"; on the {len(missed)} missed, the published per-GPU ratio was {low:.2f}–{high:.2f} of the "
            f"predicted (worst {out['worst']})"
        )
        if len(below) == len(missed):
            verdict += ", below the band every time: read scaling figures here as upper bounds"
    if out["beyond"]:
        verdict += f"; N={max(world_sizes):,} is beyond every published check of this stack"
    elif out["below"]:
        verdict += "; the rank counts asked are below every published check of this stack"
    return out | {"verdict": verdict}
