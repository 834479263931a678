"""`harness predict` against published scaling results at 128 GPUs and more
(tests/data/published_scaling_rows.yaml: each row's source, quote, setup as `harness predict` flags and
published per-GPU figures at two N).

Nothing in the model is fitted to any row (no constant is fitted to published data at all: the profiles'
ranges come from data sheets and published collective benchmarks), so every row is predicted leave-one-out
by construction. The target, per row: the per-GPU throughput at the larger N over that at the smaller one
predicted within 15% of the published ratio, and the published ratio inside the predicted band (the ratio
over every combination of the inputs' fast and slow ends, the same at both N). The rows the model misses
are marked (strict xfail: the day the model gets one right, its mark must go).

Every modelled term decides some row: with any one of them taken out, at least one row's outcome changes
(a row that meets the target misses it, or a marked row meets it and its strict xfail fails), so this test
fails; experiments/predict_terms.py prints how far each term moves every row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from core.config import RunConfig
from harness.cli import make_parser
from harness.predict import nccl
from harness.predict.command import configs
from harness.predict.hardware import Profile, load_profile
from harness.predict.model import Calibration, scaling_ratio

unit = pytest.mark.unit
REPO = Path(__file__).resolve().parent.parent
ROWS = yaml.safe_load((REPO / "tests" / "data" / "published_scaling_rows.yaml").read_text())
RATIO_TOLERANCE = 0.15

# The rows the model misses (docs/prediction.md has what it predicts for each): where the published runs lose
# more than any modelled term explains, read its predictions as upper bounds.
MISSED = {
    "torchtitan-llama31-8b-fsdp2-8to128",
    "foundry-mpt7b-h100-8to256",
    "foundry-mpt7b-h100-8to512",
    "internevo-7b-zero1-8to256",
    "internevo-7b-zero1-8to512",
    "internevo-7b-zero1-8to1024",
    "megatron-sc21-zero3-175b-384to768",
    "megatron-sc21-zero3-175b-384to1536",
    "megatron-sc21-zero3-530b-1120to2240",
    "foundry-mpt13b-h100-128to512",
    "foundry-mpt30b-h100-128to512",
    "foundry-mpt70b-h100-128to512",
    "foundry-mpt3b-h100-sgo-128to512",
    "foundry-mpt1b-h100-sgo-128to512",
    "foundry-mpt125m-a100-40g-16to128",
    "foundry-mpt350m-a100-40g-16to128",
    "foundry-mpt1b-a100-40g-64to128",
    "foundry-mpt3b-a100-40g-32to128",
    "foundry-mpt7b-a100-40g-32to128",
    "nvidia-tf-bert-large-s128-dgx2h-16to512",
    "nvidia-tf-bert-large-s512-dgx2h-16to512",
    "nvidia-tf-bert-large-s128-dgxa100-8to256",
    "nvidia-tf-bert-large-s512-dgxa100-32to256",
    "nvidia-pyt-bert-large-s128-dgx2h-16to1024",
}
MISSED_MARK = pytest.mark.xfail(
    strict=True, reason="the published ratio is more than 15% off the prediction or outside its band"
)


def hardware(row: dict) -> str:
    return str(REPO / row["hardware"]) if row["hardware"].endswith(".yaml") else row["hardware"]


def row_configs(row: dict, tweak: Callable | None = None) -> tuple[RunConfig, RunConfig, Profile]:
    """The configurations at n_small and n_large of `harness predict ARGV --hardware H --gpus
    n_small,n_large` (the row's own flags, its precision and workload included), and the profile, which
    `tweak(profile)` edits first."""
    args = make_parser().parse_args(
        ["predict", *row["argv"], "--hardware", hardware(row), "--gpus", f"{row['n_small']},{row['n_large']}"]
    )
    profile = load_profile(hardware(row))
    if tweak:
        tweak(profile)
    small, large = configs(args, profile)
    return small, large, profile


def predicted_ratio(row: dict, tweak: Callable | None = None) -> dict:
    """Per-GPU tokens/s at n_large over n_small, nominal and its band over every combination of the inputs'
    ends (harness.predict.model.scaling_ratio)."""
    small, large, profile = row_configs(row, tweak)
    return scaling_ratio(small, large, profile, Calibration())


def meets_the_target(row: dict, ratio: dict) -> bool:
    published = row["value_large"] / row["value_small"]
    return (
        abs(ratio["nominal"] / published - 1) <= RATIO_TOLERANCE
        and ratio["low"] <= published <= ratio["high"]
    )


# Each modelled term that moves a prediction at scale, and how it is taken out: NCCL's (algorithm, protocol)
# pairs narrowed or its latencies zeroed (a filter on harness.predict.nccl.options), or the profile's range
# set to nothing. experiments/predict_terms.py reads this table.
TERMS = {
    "protocols (Simple only)": (lambda pairs: [p for p in pairs if p[0].endswith("Simple")], None),
    "tree (ring only)": (lambda pairs: [p for p in pairs if p[0].startswith("ring")], None),
    "latency (none)": (lambda pairs: [(name, 0.0, seconds) for name, _, seconds in pairs], None),
    "bandwidth lost at scale": (
        None,
        lambda profile: profile.inter_node.pop("scale_loss_per_doubling", None),
    ),
    "stragglers": (None, lambda profile: setattr(profile, "step_cv", [0.0, 0.0, 0.0])),
    "overlap slowdown": (None, lambda profile: setattr(profile, "overlap_slowdown", [0.0, 0.0, 0.0])),
}


def without(term: str, monkeypatch) -> Callable | None:
    """Take `term` out of the model (NCCL's options through `monkeypatch`); the profile tweak it needs."""
    narrow, tweak = TERMS[term]
    if narrow:
        every = nccl.options
        monkeypatch.setattr(nccl, "options", lambda *args, **kwargs: narrow(every(*args, **kwargs)))
    return tweak


@unit
def test_the_rows_are_enough_independent_cited_and_at_scale():
    """At least 10 rows at 128 GPUs or more from at least 5 publishers; strong-scaling rows with 1-4
    sequences a GPU at the larger N; two stacks besides FSDP at least; every row cited and quoted."""
    assert len({r["id"] for r in ROWS}) == len(ROWS)
    at_scale = [r for r in ROWS if r["n_large"] >= 128]
    assert len(at_scale) >= 10 and len({r["publisher"] for r in at_scale}) >= 5
    strong = [r for r in at_scale if r["scaling"] == "strong" and 1 <= r["sequences_per_gpu_at_large"] <= 4]
    assert strong, "no strong-scaling row with 1-4 sequences a GPU"
    backends = Counter(r["argv"][r["argv"].index("--backend") + 1] for r in at_scale)
    assert len(set(backends) - {"torch-fsdp"}) >= 2, backends
    for r in ROWS:
        assert r["source"] and r["quote"] and r["hardware_note"] and r["value_small"] > 0, r["id"]
        assert r["n_large"] > r["n_small"], r["id"]
    assert MISSED <= {r["id"] for r in ROWS}


@unit
@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=[MISSED_MARK] if r["id"] in MISSED else []) for r in ROWS],
    ids=[r["id"] for r in ROWS],
)
def test_the_published_scaling_ratio_is_predicted_within_15_percent_and_inside_the_band(row):
    ratio = predicted_ratio(row)
    assert meets_the_target(row, ratio), (row["id"], ratio, row["value_large"] / row["value_small"])


@unit
@pytest.mark.parametrize("term", TERMS)
def test_the_published_rows_fail_with_any_one_modelled_term_removed(term, monkeypatch):
    """Some row's outcome changes without the term (the first found is enough: each row costs its band)."""
    tweak = without(term, monkeypatch)
    changed = next(
        (
            row["id"]
            for row in ROWS
            if meets_the_target(row, predicted_ratio(row, tweak)) != (row["id"] not in MISSED)
        ),
        None,
    )
    assert changed, f"without {term} every row keeps its outcome: the term decides none"
