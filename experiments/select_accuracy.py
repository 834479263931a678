"""How well `harness select` orders the six stacks before anything runs at 2 ranks, measured afterwards.

1. Calibrate: for each stack, a 2-rank `harness commbench` (its collectives on this machine) and a 1-rank
   training run of the shape (its compute), never a 2-rank training run.
2. Select: `harness select --hardware local --calibrate` at 2 ranks over the six stacks' default variants
   (only calibrated labels are priced), the shape at a global batch of 4 sequences; each stack's pick is its
   first ranked candidate.
3. Measure: each pick's own `harness run` arguments (run_argv), `--repeats` launches each, stacks in a
   seeded shuffled order per round, so that drift is spread over every stack.

Prints each stack's predicted step (nominal, band) and P(fastest) beside the median of its launches' median
steps (and their range), Kendall's tau between the predicted and the measured order (scipy.stats), and the
top pick's regret against the measured best. Every launch uses the 2 CPU workers of a 2-core machine: run
it on a quiet machine. Finished launches are read back, so an interrupted run resumes.

    .venv/bin/python experiments/select_accuracy.py --out /tmp/select-accuracy --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

from core.records import load_records

REPO = Path(__file__).resolve().parents[1]
STACKS = ["torch-ddp", "torch-fsdp", "deepspeed", "horovod", "tf-mwms", "paddle-fleet"]
# 27.4M parameters: 6 blocks of d 512 (18.9M), a 16,384 x 512 tied embedding (8.4M), positions and norms
SHAPE = ["--layers", "6", "--d-model", "512", "--heads", "8", "--seq-len", "256", "--vocab", "16384"]
STEPS = ["--steps", "6", "--warmup", "2", "--compute-method", "none", "--no-trace-comm"]


def harness(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, check=False)


def calibrate(out: Path) -> Path:
    calib = out / "calib"
    for stack in STACKS:
        records = load_records([calib], kind=None) if calib.exists() else []
        kinds = {(r["kind"], r["config"]["backend"]) for r in records}
        if ("commbench", stack) not in kinds:
            harness("commbench", "--backend", stack, "--gpus", "2", "--out", str(calib))
        if ("training", stack) not in kinds:
            harness("run", "--backend", stack, "--gpus", "1", "--threads-per-worker", "1", *SHAPE,
                    "--micro-batch", "2", *STEPS, "--out", str(calib))  # fmt: skip
    return calib


def select(out: Path, calib: Path) -> dict:
    where = out / "select"
    if not where.exists():
        harness("select", "--hardware", "local", "--calibrate", str(calib), *SHAPE, "--gpus", "2",
                "--global-batch", "4", "--precision", "fp32", "--stacks", ",".join(STACKS), "--top", "40",
                "--out", str(where))  # fmt: skip
    (path,) = where.glob("select-*.json")
    return json.loads(path.read_text())


def measure(out: Path, picks: dict[str, dict], repeats: int) -> dict[str, list[float]]:
    steps: dict[str, list[float]] = {stack: [] for stack in picks}
    for rep in range(repeats):
        order = list(picks)
        random.Random(rep).shuffle(order)
        for stack in order:
            where = out / "sweep" / stack / f"rep{rep}"
            if not where.exists():
                harness("run", *picks[stack]["run_argv"], *STEPS, "--out", str(where))
            records = [r for r in load_records([where]) if r["status"] == "ok"]
            if records:
                steps[stack].append(records[0]["summary"]["step_time_s"]["median"])
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    selection = select(args.out, calibrate(args.out))
    picks: dict[str, dict] = {}
    for row in selection["ranked"]:  # ranked fastest first: each stack's first is its pick
        picks.setdefault(row["backend"], row)
    for stack in set(STACKS) - set(picks):
        why = {x["label"]: x["why"] for x in selection["excluded"] if x["label"].startswith(stack)}
        print(f"{stack}: not selectable: {why}")
    steps = measure(args.out, picks, args.repeats)
    measured = {s: float(np.median(v)) for s, v in steps.items() if v}
    stacks = [s for s in picks if s in measured]
    predicted = {s: picks[s]["step_time_s"]["nominal"] for s in stacks}
    print("| stack (pick) | predicted step s (band) | P(fastest) | measured s: median (range) | error |")
    print("|---|---|---|---|---|")
    for s in sorted(stacks, key=predicted.__getitem__):
        p, m, band = predicted[s], measured[s], picks[s]["step_time_s"]
        odds = picks[s].get("p_fastest")
        print(
            f"| {picks[s]['label']} ({picks[s]['micro_batch']} x {picks[s]['grad_accum']}) | {p:.3f} "
            f"({band['low']:.3f}–{band['high']:.3f}) | {'-' if odds is None else f'{odds:.0%}'} | {m:.3f} "
            f"({min(steps[s]):.3f}–{max(steps[s]):.3f}, {len(steps[s])} launches) | "
            f"{100 * (p / m - 1):+.1f}% |"
        )
    tau = kendalltau([predicted[s] for s in stacks], [measured[s] for s in stacks])
    top = min(stacks, key=predicted.__getitem__)
    best = min(stacks, key=measured.__getitem__)
    print(f"Kendall tau (predicted vs measured order, {len(stacks)} stacks): {tau.statistic:.2f}")
    # The measurement's own uncertainty: every way of taking one launch of each stack, how often each
    # stack is the fastest (the measured counterpart of P(fastest)) and the tau each gives.
    combos = list(itertools.product(*[steps[s] for s in stacks]))
    won = Counter(stacks[int(np.argmin(c))] for c in combos)
    taus = [kendalltau([predicted[s] for s in stacks], c).statistic for c in combos]
    print("fastest over one launch of each: " + ", ".join(f"{s} {won[s] / len(combos):.0%}" for s in stacks))
    spread = f"p10 {np.percentile(taus, 10):.2f}, p90 {np.percentile(taus, 90):.2f}"
    share = np.mean(np.asarray(taus) >= 0.7)
    print(f"tau over them: median {np.median(taus):.2f} ({spread}); >= 0.7 in {share:.0%}")
    print(f"top pick {top}, measured best {best}: regret {100 * (measured[top] / measured[best] - 1):.1f}%")
    (args.out / "summary.json").write_text(
        json.dumps(
            {"predicted": predicted, "measured": steps, "tau": tau.statistic, "top": top, "best": best}
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
