"""Does commbench price a training run's communication? For each stack at N ranks: one training run (its
collective trace gives every call's op, size and time) and one `harness commbench` of the same stack,
device and N; each traced call is priced at commbench's time for its op and size (`predicted_comm`), and
the sums per step are set side by side. The "matched" line holds each call, as the last rank to arrive saw
it, against commbench's figure with commbench's statistic (`matched_comm`): the 25% cross-check of the
communication issue.

    .venv/bin/python experiments/comm_crosscheck.py --backends torch-ddp,horovod --gpus 2 \\
        --out /tmp/crosscheck

Run it on a quiet machine: the two measurements are minutes apart and both are timings.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.analyze.collectives import call_time  # noqa: E402
from harness.run.child import run_child  # noqa: E402

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


def traced_ranks(run: dict) -> list[dict]:
    """The collective traces of a run's ranks that have one (Horovod's timeline: rank 0's only)."""
    return [
        r["comm_trace"] for r in run["ranks"] if (r.get("comm_trace") or {}).get("collectives") is not None
    ]


def aligned_calls(calls: list[list[dict]]) -> list[tuple] | None:
    """Each rank's traced calls side by side, call k of every rank together: ranks issue the same
    collectives in the same order. None where their (op, size) sequences differ, since pairing them by
    position would then pair different calls."""
    sequences = [[(c["op"], c["size_bytes"]) for c in rank] for rank in calls]
    return list(zip(*calls)) if all(seq == sequences[0] for seq in sequences) else None


def predicted_comm(run: dict, bench: dict) -> dict:
    """A training run's traced collectives priced by a commbench record of the same stack, device and N.
    Per op: the traced time per step (the slowest rank's), the same with each call's time taken from the
    rank that waited least in it (the last to arrive: ranks call the same collectives in the same order),
    commbench's time for each traced call's op and size summed, and the ratios. Calls commbench did not
    measure (an op it lacks) are counted, not priced."""
    traces = traced_ranks(run)
    steps = traces[0]["steps"]
    out, unpriced = {}, 0
    for op in sorted({c["op"] for t in traces for c in t["collectives"]}):
        calls = [[c for c in t["collectives"] if c["op"] == op] for t in traces]
        slowest_rank = max(sum(c["time_s"] or 0 for c in rank_calls) for rank_calls in calls)
        together = aligned_calls(calls)
        least_waiting = (
            sum(min(c["time_s"] or 0 for c in same) for same in together) if together is not None else None
        )
        predicted, priced = 0.0, {}
        for c in calls[0]:
            size = c["size_bytes"]
            if size not in priced:  # a step repeats its sizes: each priced once
                priced[size] = call_time(bench["summary"], op, size)
            unpriced += priced[size] is None
            predicted += priced[size] or 0.0
        out[op] = {
            "measured_s_per_step": slowest_rank / steps,
            "least_waiting_s_per_step": least_waiting / steps if least_waiting is not None else None,
            "predicted_s_per_step": predicted / steps,
            "ratio": slowest_rank / predicted if predicted else None,
            "least_waiting_ratio": least_waiting / predicted
            if predicted and least_waiting is not None
            else None,
        }

    def total(key):
        return sum(o[key] or 0.0 for o in out.values())

    keys = ("measured_s_per_step", "least_waiting_s_per_step", "predicted_s_per_step")
    totals = {key: total(key) for key in keys}
    return {
        "ops": out,
        **totals,
        "ratio": totals["measured_s_per_step"] / totals["predicted_s_per_step"]
        if totals["predicted_s_per_step"]
        else None,
        "unpriced_calls": unpriced,
    }


def matched_comm(run: dict, bench: dict) -> dict | None:
    """A training run's traced collectives against commbench under the conditions commbench times them.

    - Each call as the last rank to arrive saw it (the least time over ranks): commbench starts every call
      from a barrier, so a rank's wait for a late peer is no part of its figure.
    - Where every traced step repeats one sequence of calls, each position in the step is measured with
      commbench's statistic, the median over steps; where the sequence varies from step to step (Horovod
      fuses what each cycle finds ready), the mean over steps.
    None where no step was traced, the ranks' calls differ, a call has no time on any rank, or commbench
    has no time for a call."""
    traces = traced_ranks(run)
    steps = traces[0]["steps"] if traces else 0
    calls = aligned_calls([t["collectives"] for t in traces]) if steps else None  # [call][rank]
    if not calls:
        return None
    sequence = [(same[0]["op"], same[0]["size_bytes"]) for same in calls]
    per_step = len(calls) // steps
    repeats = per_step > 0 and len(calls) == per_step * steps and sequence == sequence[:per_step] * steps
    # the groups of calls measured together: each position in the step, or each call on its own
    groups = [calls[k::per_step] for k in range(per_step)] if repeats else [[same] for same in calls]
    measured = predicted = 0.0
    for group in groups:
        price = call_time(bench["summary"], group[0][0]["op"], group[0][0]["size_bytes"])
        if price is None:
            return None
        known = [[c["time_s"] for c in same if c["time_s"] is not None] for same in group]
        if not all(known):
            return None
        last_arrival = [min(times) for times in known]
        statistic = np.median if repeats else np.mean
        measured += float(statistic(last_arrival)) * len(group)
        predicted += price * len(group)
    measured, predicted = measured / steps, predicted / steps
    return {
        "statistic": "each call position's median over steps" if repeats else "mean over steps",
        "calls_per_step": len(calls) / steps,
        "measured_s_per_step": float(measured),
        "predicted_s_per_step": float(predicted),
        "ratio": float(measured / predicted) if predicted else None,
    }


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
    """`harness COMMAND FLAGS --out OUT` of this checkout (harness.run.child), its output captured; its
    record. CalledProcessError where it exits non-zero or writes no record."""
    done = run_child([command, *flags], out, cwd=REPO)
    if done.returncode != 0 or done.record is None:
        raise subprocess.CalledProcessError(done.returncode, [command, *flags], done.output)
    return done.record


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
    args.out = args.out.resolve()  # the runs' --out and the records looked for in it, one folder
    print(
        "stack            op              traced ms/step (slowest rank, least waiting)  commbench ms/step  "
        "traced / commbench"
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
                + ["--ops", ",".join(traced)],
                args.out,
            )
        except subprocess.CalledProcessError as exc:
            print(
                f"{label:16s} failed: harness {exc.cmd[0]} exited {exc.returncode}; see {args.out}",
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
            waiting = o["least_waiting_s_per_step"]
            print(
                f"{label:16s} {op:15s} {o['measured_s_per_step'] * 1e3:8.2f}, "
                + (f"{waiting * 1e3:8.2f}" if waiting is not None else f"{'n/a':>8s}")
                + f"{'':29s} {o['predicted_s_per_step'] * 1e3:17.2f} {ratio:>10s}{least}",
                flush=True,
            )
        m = matched_comm(run, bench)
        if m and m["ratio"]:
            print(
                f"{label:16s} {'matched':15s} {m['measured_s_per_step'] * 1e3:8.2f} ms/step against "
                f"{m['predicted_s_per_step'] * 1e3:.2f}: {m['ratio']:.2f} ({m['calls_per_step']:g} calls a "
                f"step; {m['statistic']})",
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
