"""Predict each stack's 2-rank CPU run from its 1-rank runs and its commbench record, and compare with the
2-rank run measured (harness.predict.validate.predict_repeats): the table of the prediction issue's
own-runs validation.

    .venv/bin/python experiments/predict_validation.py --out /tmp/predict-validation [--cases torch-ddp,...]
        [--repeats 5] [--fixtures tests/data/predict]

Per case: `harness run --gpus 1`, then `--gpus 2` and `--gpus 1` again, `--repeats` times (fp32, 1 thread
per worker, no trace), and `harness commbench --gpus 2` of the ops the stack uses. The
prediction is set beside the median of the 2-rank launches, with their range: identical launches on a
2-core VM differ by more than the bounds. Existing records in OUT are reused with --reuse. `--fixtures`
copies each case's records (JSON only) to DIR/<case>, where tests/test_predict.py reads them.
Run it on a quiet machine: all of it is timings.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.records import load_records  # noqa: E402
from harness.predict.validate import predict_repeats  # noqa: E402

# On tiny the communication is under a fifth of the step; this shape (7.4M parameters, a 30 MB all-reduce)
# makes it a third, so the prediction is tested on the collectives and not only on the compute.
COMM_BOUND = ["--d-model", "512", "--heads", "8", "--layers", "2", "--seq-len", "32", "--micro-batch", "2"]
CASES = {  # case -> (harness flags, commbench ops, shape flags beside --workload tiny)
    "torch-ddp": (["--backend", "torch-ddp"], "allreduce", []),
    "torch-ddp-comm-bound": (["--backend", "torch-ddp"], "allreduce", COMM_BOUND),
    "torch-fsdp": (["--backend", "torch-fsdp"], "allgather,reducescatter", []),
    "deepspeed-zero1": (["--backend", "deepspeed", "--zero-stage", "1"], "allreduce,allgather", []),
    "deepspeed-zero3": (
        ["--backend", "deepspeed", "--zero-stage", "3"],
        "allreduce,allgather,reducescatter",  # its norm scalars are all-reduced
        [],
    ),
    "horovod": (["--backend", "horovod"], "allreduce", []),
    "tf-mwms": (["--backend", "tf-mwms"], "allreduce", []),
    "paddle-fleet": (["--backend", "paddle-fleet"], "allreduce", []),
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


def measure(case: str, out: Path, repeats: int) -> None:
    flags, ops, shape = CASES[case]
    # 1-rank runs either side of every 2-rank one, so the machine's drift reaches calibration and target
    for gpus in ["1"] + ["2", "1"] * repeats:
        harness("run", *flags, *RUN, *shape, "--gpus", gpus, "--out", str(out))
    backend_flags = flags[:2]  # commbench takes the backend only
    sizes = ["--sizes", "1K:64M", "--device", "cpu"]
    harness("commbench", *backend_flags, "--gpus", "2", "--ops", ops, *sizes, "--out", str(out))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of: {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=5, help="2-rank launches per case")
    parser.add_argument("--reuse", action="store_true", help="predict from the records already in OUT")
    parser.add_argument("--fixtures", type=Path, help="copy each case's records to FIXTURES/<case>")
    args = parser.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown or args.repeats < 1:
        parser.error(
            f"unknown case {unknown[0]!r}; valid: {', '.join(CASES)}" if unknown else "--repeats < 1"
        )
    rows = []
    for case in args.cases.split(","):
        folder = args.out / case
        if not args.reuse:
            measure(case, folder, args.repeats)
        rows.append({"case": case, **predict_repeats(load_records([folder], kind=None))})
        if args.fixtures:
            (args.fixtures / case).mkdir(parents=True, exist_ok=True)
            for record in folder.glob("*.json"):
                shutil.copy(record, args.fixtures / case / record.name)
    print(
        f"{'case':22} {'step pred.':>10} {'median':>8} {'launches':>15} {'error':>7} "
        f"{'exposed pred.':>13} {'median':>7} {'launches':>11} {'error pts':>9}"
    )
    for r in rows:
        s, e = r["step_time_s"], r["exposed_comm_ratio"]
        print(
            f"{r['case']:22} {s['predicted'] * 1e3:7.1f} ms {s['measured_median'] * 1e3:5.1f} ms "
            f"{min(s['measured']) * 1e3:6.1f}-{max(s['measured']) * 1e3:5.1f} ms "
            f"{100 * r['step_time_error']:+6.1f}% {100 * e['predicted']:12.1f}% "
            f"{100 * e['measured_median']:6.1f}% "
            f"{100 * min(e['measured']):5.1f}-{100 * max(e['measured']):4.1f}% "
            f"{r['exposed_error_points']:+9.1f}"
        )
    (args.out / "validation.json").write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
