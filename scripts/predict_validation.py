"""Predict each stack's 2-rank CPU run from its 1-rank run and its commbench record, and compare with the
2-rank run measured (harness.predict.validate): the table of the prediction issue's own-runs validation.

    .venv/bin/python scripts/predict_validation.py --out /tmp/predict-validation [--backends torch-ddp,...]

Per stack: `harness run --gpus 1` (twice) and `--gpus 2` (tiny, fp32, 1 thread per worker, no trace) and
`harness commbench --gpus 2 --under-load` of the ops it uses; existing records in OUT are reused (--reuse).
Run it on a quiet machine: all three are timings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.records import load_records  # noqa: E402
from harness.predict.validate import predict_measured  # noqa: E402

STACKS = {  # label -> (harness flags, commbench ops)
    "torch-ddp": (["--backend", "torch-ddp"], "allreduce"),
    "torch-fsdp": (["--backend", "torch-fsdp"], "allgather,reducescatter"),
    "deepspeed-zero1": (["--backend", "deepspeed", "--zero-stage", "1"], "allreduce,allgather"),
    "deepspeed-zero3": (["--backend", "deepspeed", "--zero-stage", "3"], "allreduce,allgather,reducescatter"),
    "horovod": (["--backend", "horovod"], "allreduce"),
    "tf-mwms": (["--backend", "tf-mwms"], "allreduce"),
    "paddle-fleet": (["--backend", "paddle-fleet"], "allreduce"),
}
RUN = ["--workload", "tiny", "--precision", "fp32", "--threads-per-worker", "1", "--no-trace-comm", "--quiet"]
RUN += ["--steps", "15", "--device", "cpu"]


def harness(*argv: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "harness", *argv],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )


def measure(label: str, out: Path) -> None:
    flags, ops = STACKS[label]
    for gpus in ("1", "2", "1"):  # 1-rank runs either side of the 2-rank one (calibration: their median)
        harness("run", *flags, *RUN, "--gpus", gpus, "--out", str(out))
    backend_flags = flags[:2]  # commbench takes the backend only
    sizes = ["--sizes", "1K:64M", "--device", "cpu", "--under-load"]  # as calls run beside compute
    harness("commbench", *backend_flags, "--gpus", "2", "--ops", ops, *sizes, "--out", str(out))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backends", default=",".join(STACKS))
    parser.add_argument("--reuse", action="store_true", help="predict from the records already in OUT")
    args = parser.parse_args()
    rows = []
    for label in args.backends.split(","):
        folder = args.out / label
        if not args.reuse:
            measure(label, folder)
        records = load_records([folder], kind=None)
        (target,) = [r for r in records if r["kind"] == "training" and r["config"]["world_size"] == 2]
        rows.append(predict_measured(target, records))
    print(
        f"{'stack':18} {'step measured':>14} {'predicted':>10} {'error':>7} {'exposed meas.':>14} "
        f"{'predicted':>10} {'error pts':>9}"
    )
    for r in rows:
        s, e = r["step_time_s"], r["exposed_comm_ratio"]
        print(
            f"{r['label']:18} {s['measured'] * 1e3:11.1f} ms {s['predicted'] * 1e3:7.1f} ms "
            f"{100 * r['step_time_error']:+6.1f}% {100 * e['measured']:13.1f}% {100 * e['predicted']:9.1f}% "
            f"{r['exposed_error_points']:+9.1f}"
        )
    (args.out / "validation.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
