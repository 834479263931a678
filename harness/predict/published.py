"""How far `harness predict` holds on published scaling results, and what a prediction says of it.

published_scaling_rows.yaml beside this module holds published per-GPU throughputs at two rank counts, each
row with its source, quote and setup as `harness predict` flags. Predicting all of them takes about ten
seconds, too long for every prediction, so their outcomes under the current model are kept in
published_check.json beside it (written by `python -m harness.predict.published`;
tests/test_predict_published.py fails when it is not what the model predicts now). `harness predict` then
says, from the rows of the stack it predicts, how close the model came there: an optimistic prediction at
scale is the number a cluster gets budgeted on, so where the published runs lost more than the model does,
the prediction says so beside its figures.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

from backends import get_backend
from core.config import RunConfig
from harness.predict import margin
from harness.predict.calibration import Calibration
from harness.predict.hardware import Profile, load_profile
from harness.predict.model import scaling_ratio
from harness.predict.published_check import CHECK_FILE, RATIO_TOLERANCE, stack_of

# Package data, as published_check.json is: an installed wheel has both without a source tree.
ROWS_FILE = Path(__file__).with_name("published_scaling_rows.yaml")


def load_rows(path: Path = ROWS_FILE) -> list[dict]:
    import yaml

    return yaml.safe_load(path.read_text())


def hardware(row: dict) -> str:
    """A catalogue profile's name, or a profile file beside the rows (the publishers' own clusters,
    published_profiles/, which the catalogue of `--hardware` names leaves out)."""
    return str(ROWS_FILE.parent / row["hardware"]) if row["hardware"].endswith(".yaml") else row["hardware"]


@functools.cache
def predict_parser() -> argparse.ArgumentParser:
    """`harness predict`'s own parser (its `predict` subcommand alone), built once: every row, and every
    variant of a row's unknown settings, is parsed with it."""
    from harness.predict.command import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    (predict,) = parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
    return predict


def row_configs(
    row: dict, tweak: Callable | None = None, argv: list[str] | None = None
) -> tuple[RunConfig, RunConfig, Profile]:
    """The configurations at n_small and n_large of `harness predict ARGV --hardware H --gpus
    n_small,n_large` (the row's own flags, its precision and workload included; `argv`: other flags in
    their place), and the profile, which `tweak(profile)` edits first."""
    from harness.predict.command import configs

    args = predict_parser().parse_args(
        [*(argv or row["argv"]), "--hardware", hardware(row), "--gpus", f"{row['n_small']},{row['n_large']}"]
    )
    profile = load_profile(hardware(row))
    if tweak:
        tweak(profile)
    small, large = configs(args, profile)
    return small, large, profile


def valued_flags() -> set[str]:
    """`harness predict`'s flags that take one value (a switch takes none, so it cannot be set to one)."""
    actions = predict_parser()._actions
    return {flag for action in actions if action.nargs is None for flag in action.option_strings}


def with_setting(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag` set to `value`: in place where it is given, else added."""
    if flag in argv:
        at = argv.index(flag)
        return [*argv[: at + 1], value, *argv[at + 2 :]]
    return [*argv, flag, value]


def variants(row: dict) -> dict[tuple, list[str]]:
    """The row's flags, and one set for each combination of the values its `unknown` settings may take
    (a published setup that leaves a setting unstated: every value a publisher could have run), keyed by
    the (flag, value) pairs that differ from the row's own flags. An unknown setting is a flag that takes
    one value, given at most once."""
    out: dict[tuple, list[str]] = {(): list(row["argv"])}
    for flag, values in (row.get("unknown") or {}).items():
        if row["argv"].count(flag) > 1 or flag not in valued_flags():
            raise ValueError(
                f"{row['id']}: unknown setting {flag} is not a `harness predict` flag of one value"
            )
        for key, argv in list(out.items()):
            for value in map(str, values):
                changed = with_setting(argv, flag, value)
                if changed != argv:
                    out[key + ((flag, value),)] = changed
    return out


def predicted_ratio(row: dict, tweak: Callable | None = None) -> dict:
    """Per-GPU tokens/s at n_large over n_small, nominal and its band over every combination of the inputs'
    ends (harness.predict.model.scaling_ratio), widened over the row's unknown settings (`variants`): the
    band spans every value a publisher could have run, and when one of them moves the nominal ratio more
    than any input alone, that setting is what dominates the band."""
    ratios = {}
    for key, argv in variants(row).items():
        small, large, profile = row_configs(row, tweak, argv)
        ratios[key] = scaling_ratio(small, large, profile, Calibration())
    out = dict(ratios[()])
    lowest = min(ratios, key=lambda k: ratios[k]["low"])
    highest = max(ratios, key=lambda k: ratios[k]["high"])
    out["low"], out["high"] = ratios[lowest]["low"], ratios[highest]["high"]
    out["low_at"] = {**ratios[lowest]["low_at"], "settings": dict(lowest) or "as published"}
    out["high_at"] = {**ratios[highest]["high_at"], "settings": dict(highest) or "as published"}
    if len(ratios) > 1:
        nominals = [r["nominal"] for r in ratios.values()]
        out["settings"] = {
            " ".join(f"{f} {v}" for f, v in key) or "as published": r["nominal"] for key, r in ratios.items()
        }
        spread = max(nominals) - min(nominals)
        alone = max(high - low for low, high in out["alone"].values())
        if spread > alone:
            out["dominant"] = "unknown settings (" + ", ".join(row["unknown"]) + ")"
    return out


def published_ratio(row: dict) -> float:
    return row["value_large"] / row["value_small"]


def in_product(row: dict) -> bool:
    """Whether the row's stack and version is one the product runs (rows that are not, such as 2021's
    DeepSpeed or TF1 Horovod, say why in `not_in_product`): only those fit the empirical margin."""
    return bool(row.get("stack_in_product", True))


def meets_the_target(row: dict, ratio: dict) -> bool:
    """The model's own target: nominal within RATIO_TOLERANCE and the published ratio inside its band."""
    published = published_ratio(row)
    return (
        abs(ratio["nominal"] / published - 1) <= RATIO_TOLERANCE
        and ratio["low"] <= published <= ratio["high"]
    )


def row_score(row: dict, ratio: dict) -> float:
    """The per-doubling loss below the model's band that the row's published ratio shows (margin.score)."""
    return margin.score(published_ratio(row), ratio["low"], ratio["doublings_beyond_node"])


def margins(rows: list[dict], ratios: dict[str, dict]) -> tuple[float, dict[str, float], dict[str, dict]]:
    """The margin fitted on every product row, each publisher's fitted without its rows, and each row's
    margins: in-sample (the first) and out-of-sample (fitted without the row's publisher; for a row outside
    the product, the first, which never saw it)."""
    scored = [
        {"publisher": r["publisher"], "score": row_score(r, ratios[r["id"]])} for r in rows if in_product(r)
    ]
    everything = margin.fitted([s["score"] for s in scored])
    without = margin.leave_one_publisher_out(scored)
    return (
        everything,
        without,
        {
            r["id"]: {
                "in_sample": everything,
                "out_of_sample": without[r["publisher"]] if in_product(r) else everything,
            }
            for r in rows
        },
    )


def row_result(row: dict, ratio: dict, row_margins: dict) -> dict:
    """One row's line of published_check.json: the model's ratio and band, the band with the empirical
    margin in and out of sample, and the outcomes. `meets_the_target` is held to the out-of-sample band:
    the band a prediction would state for a publisher the margin was not fitted on."""
    small, _, _ = row_configs(row)
    published, d = published_ratio(row), ratio["doublings_beyond_node"]
    low = {k: ratio["low"] * margin.factor(m, d) for k, m in row_margins.items()}
    # a row whose score is the margin sits on its band's edge: held inside up to rounding
    in_band = {
        k: bool(v <= published * (1 + 1e-9) and published <= ratio["high"])
        for k, v in {"model": ratio["low"], **low}.items()
    }
    return {
        "id": row["id"],
        "publisher": row["publisher"],
        "stack": stack_of(small),
        "label": get_backend(small.backend).label(small),
        "stack_in_product": in_product(row),
        "scaling": row["scaling"],
        "n_small": row["n_small"],
        "n_large": row["n_large"],
        "published_ratio": round(published, 6),
        "predicted_ratio": {k: round(float(ratio[k]), 6) for k in ("nominal", "low", "high")},
        "doublings_beyond_node": round(d, 6),
        "score": round(row_score(row, ratio), 6),
        "band": [round(low["out_of_sample"], 6), round(float(ratio["high"]), 6)],
        "in_band": in_band,
        "dominant": ratio["dominant"],
        "unknown": sorted(row.get("unknown") or {}),
        "meets_the_model_target": bool(meets_the_target(row, ratio)),
        "meets_the_target": bool(abs(ratio["nominal"] / published - 1) <= RATIO_TOLERANCE)
        and in_band["out_of_sample"],
    }


def coverage(results: list[dict]) -> dict:
    """How many rows each band holds: the model's, with the margin in-sample and out-of-sample; for the
    product's rows and the others apart."""
    out = {}
    for group, product in (("product_rows", True), ("other_rows", False)):
        mine = [r for r in results if r["stack_in_product"] == product]
        out[group] = {
            "rows": len(mine),
            **{
                band: sum(r["in_band"][band] for r in mine)
                for band in ("model", "in_sample", "out_of_sample")
            },
        }
    return out


def check_file(rows: list[dict], ratios: dict[str, dict]) -> dict:
    """published_check.json's content: every row's result and the empirical margin with its coverage."""
    everything, without, by_row = margins(rows, ratios)
    results = [row_result(r, ratios[r["id"]], by_row[r["id"]]) for r in rows]
    product = [r for r in rows if in_product(r)]
    return {
        "generated_by": "python -m harness.predict.published",
        "empirical_scale_loss": {
            "per_doubling": round(everything, 6),
            "method": "largest per-doubling shortfall below the model's band over the product's rows "
            "(one-sided split conformal); out of sample: leave one publisher out",
            "fitted_on": len(product),
            "publishers": sorted({r["publisher"] for r in product}),
            "left_out": {publisher: round(m, 6) for publisher, m in without.items()},
            "coverage": coverage(results),
        },
        "rows": results,
    }


def main() -> None:
    """Predict every row with the current model, fit the margin, and write published_check.json."""
    rows = load_rows()
    content = check_file(rows, {row["id"]: predicted_ratio(row) for row in rows})
    partial = CHECK_FILE.with_suffix(".partial")
    partial.write_text(json.dumps(content, indent=1) + "\n")
    partial.replace(CHECK_FILE)  # whole or not at all
    met = sum(r["meets_the_target"] for r in content["rows"])
    scale = content["empirical_scale_loss"]
    print(f"{CHECK_FILE}: {met} of {len(rows)} rows meet the target")
    per_doubling = f"{scale['per_doubling']:.2%} a doubling beyond a node"
    print(f"{margin.LABEL}: {per_doubling}; {margin.coverage_line(scale)}")


if __name__ == "__main__":
    main()
