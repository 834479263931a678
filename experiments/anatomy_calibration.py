"""Does the step's anatomy price another micro-batch better than the step per FLOP? For every stack
available here (`harness list`), 1-rank CPU runs of `tiny` at two or more micro-batches; the largest is
predicted from the others (harness.predict.calibration.calibrate, then predict_point at one rank, where
no collective is priced) two ways:

- new: the step split by its anatomy: forward+backward per FLOP, the fixed cost per step (the anatomy's
  "other"), and, where the calibration has two or more micro-batches, the fixed cost per micro-batch
  (a least-squares line of forward+backward against tokens);
- old: the step less the optimizer per FLOP, as before the anatomy (the same records, their forward and
  backward times taken out), so a stack's fixed costs scale with the tokens.

Prints, per stack, the fit, the predicted step of each beside the measured median (with its p10-p90), and
each prediction's signed error. Finished runs are read back (the newest record per stack and
micro-batch), so an interrupted study resumes; --reuse predicts from OUT without running anything.

    .venv/bin/python experiments/anatomy_calibration.py --out /tmp/anatomy-calibration \\
        [--stacks torch-ddp,...] [--micro-batches 2,8] [--steps 10]

All of it is timings: run it on a quiet machine, one stack's runs after another's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from backends import all_backends, interpreter  # noqa: E402
from core.records import load_records, run_config  # noqa: E402
from harness.analyze.metrics import summarize  # noqa: E402
from harness.predict.calibration import calibrate  # noqa: E402
from harness.predict.hardware import Profile  # noqa: E402
from harness.predict.model import predict_point  # noqa: E402

RUN = ["--gpus", "1", "--workload", "tiny", "--precision", "fp32", "--threads-per-worker", "1"]
RUN += ["--device", "cpu", "--no-trace-comm", "--quiet", "--warmup", "2", "--anatomy-steps", "5"]
# One CPU rank: no collective to price, nothing to overlap.
PROFILE = Profile("local", "one CPU rank", "cpu", None, 1, None, overlap_slowdown=[1.0, 1.0, 1.0])


def available() -> list[str]:
    """The stacks `harness list` calls available: installed under the interpreter their workers use."""
    names = []
    for b in all_backends():
        try:
            python, _ = interpreter.configured(b.name, b.framework)
        except interpreter.InterpreterError:
            continue
        if b.availability(python)[0]:
            names.append(b.name)
    return names


def newest(records: list[dict], micro: int) -> dict | None:
    found = [
        r
        for r in records
        if r["kind"] == "training" and r["status"] == "ok" and run_config(r).batch.micro_batch == micro
    ]
    return max(found, key=lambda r: r["environment"]["start_time"]) if found else None


def measure(stack: str, where: Path, micro_batches: list[int], steps: int) -> None:
    """One 1-rank run per micro-batch not yet on file."""
    for micro in micro_batches:
        have = load_records([where], kind=None) if where.exists() else []
        if newest(have, micro):
            continue
        argv = ["run", "--backend", stack, *RUN, "--steps", str(steps), "--micro-batch", str(micro)]
        done = subprocess.run(
            [sys.executable, "-m", "harness", *argv, "--out", str(where)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            print(f"{stack} micro-batch {micro}: harness run exited {done.returncode}", file=sys.stderr)
            print(done.stdout[-2000:] + done.stderr[-2000:], file=sys.stderr)


def without_anatomy(record: dict) -> dict:
    """The record as the calibration read it before the anatomy: its optimizer timed, not its forward
    and backward."""
    record = json.loads(json.dumps(record))
    for rank in record["ranks"]:
        for key in ("forward_times", "backward_times", "anatomy_step_times"):
            rank.pop(key, None)
    return record


def predicted(calibration: list[dict], target: dict) -> tuple[float, dict]:
    cfg = run_config(target)
    calib = calibrate(calibration, cfg, PROFILE)
    if not calib.seconds_per_flop:
        raise ValueError("; ".join(calib.notes) or "no calibration run")
    nominal = predict_point(cfg, PROFILE, calib, tokens=1.0, price=None)["corners"]["nominal"]
    return float(nominal["step_time_s"]), calib.fit


def compare(stack: str, where: Path, micro_batches: list[int]) -> dict | None:
    records = load_records([where], kind=None) if where.exists() else []
    found = {m: newest(records, m) for m in micro_batches}
    missing = [m for m, r in found.items() if r is None]
    if missing:
        print(f"{stack}: no ok run at micro-batch {', '.join(map(str, missing))} in {where}", file=sys.stderr)
        return None
    *calibration, target = (found[m] for m in micro_batches)
    new, fit = predicted(calibration, target)
    old, _ = predicted([without_anatomy(r) for r in calibration], target)
    step = summarize(target)["step_time_s"]
    anatomy = summarize(calibration[0]).get("anatomy") or {}
    return {
        "stack": stack,
        "calibrated_at": micro_batches[:-1],
        "target": micro_batches[-1],
        "fit": fit,
        "calibration_other_share": ((anatomy.get("parts") or {}).get("other") or {}).get("share"),
        "measured_s": step["median"],
        "measured_p10_p90_s": [step["p10"], step["p90"]],
        "new_s": new,
        "old_s": old,
        "new_error": new / step["median"] - 1,
        "old_error": old / step["median"] - 1,
        "runs": {"calibration": [r["run_id"] for r in calibration], "target": target["run_id"]},
    }


def table(rows: list[dict]) -> None:
    head = (
        f"{'stack':<14} {'from mb':>8} {'to mb':>6} {'fit':<19} {'other %':>7} {'measured ms':>18} "
        f"{'new ms':>8} {'new err':>8} {'old ms':>8} {'old err':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        low, high = (1e3 * t for t in r["measured_p10_p90_s"])
        other = r["calibration_other_share"]
        print(
            f"{r['stack']:<14} {','.join(map(str, r['calibrated_at'])):>8} {r['target']:>6} "
            f"{r['fit']['method']:<19} {'' if other is None else f'{100 * other:.1f}':>7} "
            f"{1e3 * r['measured_s']:>7.1f} ({low:.1f}-{high:.1f}) {1e3 * r['new_s']:>8.1f} "
            f"{100 * r['new_error']:>+7.1f}% {1e3 * r['old_s']:>8.1f} {100 * r['old_error']:>+7.1f}%"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stacks", help="comma-separated (default: every stack available here)")
    parser.add_argument(
        "--micro-batches",
        default="2,8",
        help="calibrate at all but the last, predict the last (default 2,8; 2,4,8 fits the line)",
    )
    parser.add_argument("--steps", type=int, default=10, help="measured steps per run")
    parser.add_argument("--reuse", action="store_true", help="predict from the records in OUT, run nothing")
    args = parser.parse_args()
    micro_batches = [int(m) for m in args.micro_batches.split(",")]
    if len(micro_batches) < 2 or len(set(micro_batches)) != len(micro_batches):
        parser.error("--micro-batches: two or more distinct sizes, the last one predicted")
    stacks = args.stacks.split(",") if args.stacks else available()
    rows = []
    for stack in stacks:
        where = args.out / stack
        if not args.reuse:
            measure(stack, where, micro_batches, args.steps)
        row = compare(stack, where, micro_batches)
        if row:
            rows.append(row)
    if not rows:
        return 1
    table(rows)
    for r in rows:
        print(f"{r['stack']}: {r['fit']['description']}")
    out = args.out / "anatomy_calibration.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"rows: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
