"""Does commbench price a training run's communication? For each stack at N ranks: one training run (its
collective trace gives every call's op, size and time) and one `harness commbench` of the same stack,
device and N; each traced call is priced at commbench's time for its op and size
(harness.analyze.collectives.predicted_comm), and the sums per step are set side by side. The "matched" line
holds each call, as the last rank to arrive saw it, against commbench's figure for the condition it ran in
(beside compute or not) with commbench's statistic (harness.analyze.collectives.matched_comm): the 25%
cross-check of the communication issue.

    .venv/bin/python scripts/comm_crosscheck.py --backends torch-ddp,horovod --gpus 2 --out /tmp/crosscheck

Run it on a quiet machine: the two measurements are minutes apart and both are timings.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.analyze.collectives import matched_comm, predicted_comm, traced_ranks  # noqa: E402

STACKS = {  # label -> harness flags
    "torch-ddp": ["--backend", "torch-ddp"],
    "torch-fsdp": ["--backend", "torch-fsdp"],
    "deepspeed-zero1": ["--backend", "deepspeed", "--zero-stage", "1"],
    "deepspeed-zero2": ["--backend", "deepspeed", "--zero-stage", "2"],
    "deepspeed-zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
    "horovod": ["--backend", "horovod"],
    "tf-mwms": ["--backend", "tf-mwms"],
    "paddle-fleet": ["--backend", "paddle-fleet"],
}


def newest_record(out: Path, before: set) -> dict:
    (path,) = sorted(set(out.glob("*.json")) - before)
    return json.loads(path.read_text())


def sizes_around(run: dict, asked: str) -> str:
    """`asked`, or for "traced" MIN:MAX from the power of two at or below the run's smallest traced message
    to the one at or above its largest: every traced call is priced between measured sizes."""
    if asked != "traced":
        return asked
    sizes = [c["size_bytes"] for t in traced_ranks(run) for c in t["collectives"] if c["size_bytes"]]
    if not sizes:
        return "1K:16M"
    low = 1 << max(10, math.floor(math.log2(min(sizes))))
    high = 1 << max(11, math.ceil(math.log2(max(sizes))))
    return f"{low}:{high}"


def harness(command: str, flags: list[str], out: Path) -> dict:
    before = set(out.glob("*.json")) if out.exists() else set()
    argv = [sys.executable, "-m", "harness", command, *flags, "--out", str(out)]
    subprocess.run(
        argv, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent
    )
    return newest_record(out, before)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default=",".join(STACKS), help=", ".join(STACKS))
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="measured steps of the training run")
    parser.add_argument(
        "--trace-steps", type=int, default=60, help="traced steps: each call position's median needs many"
    )
    parser.add_argument(
        "--iters", type=int, default=100, help="commbench's timed calls per op and size (its own default: 20)"
    )
    parser.add_argument(
        "--sizes",
        default="traced",
        help="commbench's message sizes; default: the powers of two around the run's traced sizes, so every "
        "traced call is priced between measured sizes and no time goes to sizes no call has",
    )
    parser.add_argument("--out", type=Path, default=Path("crosscheck"))
    args = parser.parse_args()
    print(
        "stack            op              traced ms/step (slowest rank, least waiting)  commbench ms/step  "
        "traced / commbench   (idle; under load)"
    )
    for label in args.backends.split(","):
        flags = STACKS[label]
        try:
            run = harness(
                "run",
                [
                    *flags,
                    "--gpus",
                    str(args.gpus),
                    "--steps",
                    str(args.steps),
                    "--trace-steps",
                    str(args.trace_steps),
                    "--compute-method",
                    "none",
                    "--quiet",
                ],
                args.out,
            )
            traced = sorted(
                {c["op"] for r in run["ranks"] for c in (r.get("comm_trace") or {}).get("collectives") or []}
            )  # only the ops the run issued: the others cost minutes and price nothing here
            bench = harness(
                "commbench",
                ["--backend", flags[1], "--gpus", str(args.gpus), "--sizes", sizes_around(run, args.sizes)]
                + ["--iters", str(args.iters)]
                + ["--ops", ",".join(traced)]
                + (["--under-load"] if run["config"]["device"] == "cpu" else []),  # CPU only
                args.out,
            )
        except subprocess.CalledProcessError as exc:
            print(
                f"{label:16s} failed: {' '.join(exc.cmd[2:4])} exited {exc.returncode}; see {args.out}",
                flush=True,
            )
            continue
        result = predicted_comm(run, bench)
        rows = [(op, o) for op, o in result["ops"].items()] + [
            ("all", {**result, "least_waiting_ratio": None})
        ]
        for op, o in rows:
            ratio = f"{o['ratio']:.2f}" if o["ratio"] else "n/a"
            least = f" (least waiting {o['least_waiting_ratio']:.2f})" if o.get("least_waiting_ratio") else ""
            loaded = o.get("predicted_under_load_s_per_step")
            under = f"; under load {loaded * 1e3:.2f} ms, ratio {o['ratio_under_load']:.2f}" if loaded else ""
            waiting = o["least_waiting_s_per_step"]
            print(
                f"{label:16s} {op:15s} {o['measured_s_per_step'] * 1e3:8.2f}, "
                + (f"{waiting * 1e3:8.2f}" if waiting is not None else f"{'n/a':>8s}")
                + f"{'':29s} {o['predicted_s_per_step'] * 1e3:17.2f} {ratio:>10s}{least}{under}",
                flush=True,
            )
        m = matched_comm(run, bench)
        if m and m["ratio"]:
            print(
                f"{label:16s} {'matched':15s} {m['measured_s_per_step'] * 1e3:8.2f} ms/step against "
                f"{m['predicted_s_per_step'] * 1e3:.2f}: {m['ratio']:.2f} ({m['calls_per_step']:g} calls a "
                f"step, {m['calls_beside_compute_per_step']:g} beside compute; {m['statistic']})",
                flush=True,
            )
        else:
            print(
                f"{label:16s} {'matched':15s} n/a (no traced step, the ranks' calls differ, a call has no "
                "time, or commbench has no time for one)",
                flush=True,
            )
        print(
            f"{'':16s} records {run['run_id']}, {bench['run_id']}; unpriced calls {result['unpriced_calls']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
