"""Where each stack's step goes, and what finding out costs: every stack available here at 2 CPU ranks on
one shape, its step's anatomy (harness/analyze/anatomy.py: each part's median and 95% interval), and the
share of the run's wall time its anatomy steps took (the phase's elapsed time in rank 0's events, against
the whole launch's; an isolated stack's anatomy steps run in its isolated launches, counted likewise).

    .venv/bin/python experiments/anatomy_table.py --out /tmp/anatomy-tiny
    .venv/bin/python experiments/anatomy_table.py --out /tmp/anatomy-30m \\
        --shape "--layers 8 --d-model 512 --heads 8 --seq-len 256 --vocab 8192 --micro-batch 2"

Finished runs are read back from OUT (the newest record per stack), so an interrupted study resumes. All of
it is timings: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from anatomy_calibration import available  # noqa: E402

from core.events import PHASE_END, read_events  # noqa: E402
from core.records import load_records  # noqa: E402
from harness.analyze.metrics import summarize  # noqa: E402

RUN = ["--gpus", "2", "--workload", "tiny", "--device", "cpu", "--threads-per-worker", "1", "--quiet"]
PARTS = ("forward", "backward", "optimizer", "exposed_comm", "other")


def phase_seconds(log_dir: Path) -> tuple[float, float]:
    """(anatomy phase seconds, all phases' seconds) over every rank-0 event stream under a run's logs."""
    anatomy = total = 0.0
    for path in sorted(log_dir.rglob("rank0.events.jsonl")):
        for event in read_events(path):
            if event["event"] == PHASE_END:
                total += event["elapsed_s"]
                anatomy += event["elapsed_s"] if event["phase"] == "anatomy" else 0.0
    return anatomy, total


def cell(part: dict) -> str:
    if part["s"] is None:
        return "n/a"
    text = f"{part['s'] * 1e3:.1f}"
    if part["ci"]:
        text += f" [{part['ci'][0] * 1e3:.1f}, {part['ci'][1] * 1e3:.1f}]"
    return text + (" UNRESOLVED" if part["status"] == "unresolved" else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="", help="more `harness run` arguments (the shape)")
    parser.add_argument("--stacks", default=None, help="comma-separated (default: every available one)")
    args = parser.parse_args()
    stacks = args.stacks.split(",") if args.stacks else available()
    rows = []
    for stack in stacks:
        done = (
            [r for r in load_records([args.out]) if r["config"]["backend"] == stack]
            if args.out.exists()
            else []
        )
        if not done:
            argv = [
                sys.executable,
                "-m",
                "harness",
                "run",
                "--backend",
                stack,
                *RUN,
                *shlex.split(args.shape),
            ]
            subprocess.run([*argv, "--out", str(args.out)], cwd=REPO, check=False)
            done = [r for r in load_records([args.out]) if r["config"]["backend"] == stack]
        if not done:
            rows.append(f"| {stack} | no record |")
            continue
        record = done[-1]
        summary = summarize(record)
        anatomy = summary["anatomy"] or {"parts": {}}
        spent, total = phase_seconds(Path(record["launch"]["log_dir"]))
        step = summary["step_time_s"]
        rows.append(
            f"| {stack} | {step['median'] * 1e3:.1f} [{step['p10'] * 1e3:.1f}, {step['p90'] * 1e3:.1f}] | "
            + " | ".join(cell(anatomy["parts"][p]) if p in anatomy["parts"] else "n/a" for p in PARTS)
            + f" | {spent:.1f} s of {total:.1f} s ({spent / total:.0%}) |"
        )
    print(
        "| stack | step ms [p10, p90] | " + " | ".join(f"{p} ms [95%]" for p in PARTS) + " | anatomy phase |"
    )
    print("|" + "---|" * (3 + len(PARTS)))
    print("\n".join(rows))
    print(json.dumps({"shape": args.shape, "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
