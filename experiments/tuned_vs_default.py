"""Tuned against default, and the collective trace's cost to the timed steps, interleaved by `harness gate`.

For each stack and shape, `harness gate --base . --head . --head-args=--tuned` launches default (base) and
tuned (head) runs in pairs, in a seeded random order within each pair, both traced (the trace runs after
the measured steps, or in a launch of its own where Backend.traces_in_own_launch says so). The table gives,
per side, the median over its runs of each run's median step, the spread of the steps inside those runs
(p10-p90 of every measured step of the side), the traced all-reduce overlap share (the median over runs;
n/a where the stack's instrument sees no compute), and the gate's paired change tuned/default with its
repeated interval. `--mode trace-cost` instead pairs --no-trace-comm (base) against the default trace
(head); with `--head REF` the head runs another commit's code (the code before a change, in a worktree).

    .venv/bin/python experiments/tuned_vs_default.py --out /tmp/tuned --pairs 3 \\
        --stacks torch-ddp,torch-fsdp,deepspeed,horovod,tf-mwms,paddle-fleet --shapes tiny,30m

Run it on a quiet machine: every launch uses the 2 CPU workers a 2-core machine has.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from harness.analyze.baseline import load_all

REPO = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": ["--workload", "tiny", "--micro-batch", "4", "--steps", "10", "--warmup", "2"],
    # ~29M parameters: 6 blocks of d 512 (18.9M) and a 16,384 x 512 tied embedding (8.4M)
    "30m": [
        *("--layers", "6", "--d-model", "512", "--heads", "8", "--seq-len", "256", "--vocab", "16384"),
        *("--micro-batch", "2", "--steps", "6", "--warmup", "2"),
    ],
}
COMMON = ["--gpus", "2", "--device", "cpu", "--compute-method", "none", "--trace-steps", "2"]


def gate(out: Path, stack: str, shape: str, pairs: int, mode: str, head: str) -> dict:
    """One gate's experiment; returns what the table needs from its pairs and verdict."""
    args = [*COMMON, "--backend", stack, *SHAPES[shape], "--max-pairs", str(pairs), "--threshold", "0.05"]
    args += ["--head-args=--tuned"] if mode == "tuned" else ["--base-args=--no-trace-comm"]
    where = out / f"{stack}-{shape}-{mode}" / ("head" if head == "." else head.replace("/", "_"))
    cmd = [sys.executable, "-m", "harness", "gate", "--base", ".", "--head", head, *args, "--out", str(where)]
    if not (where / "verdict.json").is_file():  # a finished gate is read back: rerun to redraw the table
        subprocess.run(cmd, cwd=REPO, check=False)
    verdict = json.loads((where / "verdict.json").read_text())
    rows = [json.loads(line) for line in (where / "pairs.jsonl").read_text().splitlines()]
    sides = {}
    for side in ("base", "head"):
        records = load_all([where / r[side]["record"] for r in rows])
        steps = np.concatenate([r["step_times_s"] for r in records]) if records else np.array([])
        ops: dict[str, list[float]] = {}  # per traced op, each run's overlap share
        for r in records:
            for op, m in ((r["summary"].get("comm_measured") or {}).get("ops") or {}).items():
                if m.get("overlap_fraction") is not None:
                    ops.setdefault(op, []).append(m["overlap_fraction"])
        sides[side] = {
            "median_s": float(np.median([r[side]["statistic"] for r in rows])) if rows else None,
            "p10_s": float(np.percentile(steps, 10)) if steps.size else None,
            "p90_s": float(np.percentile(steps, 90)) if steps.size else None,
            "overlap": {op: float(np.median(v)) for op, v in sorted(ops.items())},
            "runs": len(records),
        }
    what = mode if head == "." else f"{mode}, head {head}"
    return {"stack": stack, "shape": shape, "mode": what, "sides": sides, "step_time": verdict["step_time"]}


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:,.0f}"


def overlaps(shares: dict[str, float]) -> str:
    return ", ".join(f"{op} {share:.0%}" for op, share in shares.items()) or "n/a"


def table(results: list[dict]) -> str:
    lines = [
        "| stack | shape | compared | base median step [p10, p90] ms | head median step [p10, p90] ms "
        "| overlap base / head | change head/base [interval] | pairs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b, h, st = r["sides"]["base"], r["sides"]["head"], r["step_time"] or {}
        change = st.get("change")
        interval = st.get("interval")
        lines.append(
            f"| {r['stack']} | {r['shape']} | {r['mode']} "
            f"| {ms(b['median_s'])} [{ms(b['p10_s'])}, {ms(b['p90_s'])}] "
            f"| {ms(h['median_s'])} [{ms(h['p10_s'])}, {ms(h['p90_s'])}] "
            f"| {overlaps(b['overlap'])} / {overlaps(h['overlap'])} "
            f"| {'n/a' if change is None else f'{change:+.1%}'}"
            f"{'' if not interval else f' [{interval[0]:+.1%}, {interval[1]:+.1%}]'} | {b['runs']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--stacks", default="torch-ddp,torch-fsdp,deepspeed,horovod,tf-mwms,paddle-fleet")
    parser.add_argument("--shapes", default="tiny,30m")
    parser.add_argument("--mode", choices=["tuned", "trace-cost"], default="tuned")
    parser.add_argument("--head", default=".", help="the head's tree: a git ref or a directory")
    args = parser.parse_args()
    results = []
    for shape in args.shapes.split(","):
        for stack in args.stacks.split(","):
            results.append(gate(args.out, stack, shape, args.pairs, args.mode, args.head))
            (args.out / f"results-{args.mode}.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
