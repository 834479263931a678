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
from harness.predict.hardware import Profile, load_profile
from harness.predict.model import Calibration, scaling_ratio
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


def meets_the_target(row: dict, ratio: dict) -> bool:
    published = published_ratio(row)
    return (
        abs(ratio["nominal"] / published - 1) <= RATIO_TOLERANCE
        and ratio["low"] <= published <= ratio["high"]
    )


def row_result(row: dict, ratio: dict) -> dict:
    """One row's line of published_check.json."""
    small, _, _ = row_configs(row)
    return {
        "id": row["id"],
        "publisher": row["publisher"],
        "stack": stack_of(small),
        "label": get_backend(small.backend).label(small),
        "scaling": row["scaling"],
        "n_small": row["n_small"],
        "n_large": row["n_large"],
        "published_ratio": round(published_ratio(row), 6),
        "predicted_ratio": {k: round(float(ratio[k]), 6) for k in ("nominal", "low", "high")},
        "dominant": ratio["dominant"],
        "unknown": sorted(row.get("unknown") or {}),
        "meets_the_target": bool(meets_the_target(row, ratio)),
    }


def main() -> None:
    """Predict every row with the current model and write published_check.json."""
    rows = [row_result(row, predicted_ratio(row)) for row in load_rows()]
    text = json.dumps({"generated_by": "python -m harness.predict.published", "rows": rows}, indent=1)
    partial = CHECK_FILE.with_suffix(".partial")
    partial.write_text(text + "\n")
    partial.replace(CHECK_FILE)  # whole or not at all
    met = sum(r["meets_the_target"] for r in rows)
    print(f"{CHECK_FILE}: {met} of {len(rows)} rows meet the target")


if __name__ == "__main__":
    main()
