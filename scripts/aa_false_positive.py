"""How often does `harness compare` cry wolf, and how often does it catch a real slowdown?

Each of K rounds launches, with the same code: one run A1 (its median step time sets the injected delay,
DELAY_FRACTION of a step), then B1, S1, A2, B2, S2, ... for `--repeats` runs per side, interleaved so that
a drift of the machine lands on every side alike. S runs add a per-step sleep (`--step-delay`, test-only).
It then compares A with B (an A/A pair: any regression is a false positive) and A with S (a regression
must be reported), under each `--gate` (default: compare's defaults, median:0.03, and the noisy-machine
gate of the tests and the workflow, min:0.10). Run it on a quiet machine; on a shared one the counts
measure the neighbours too. The power of the default gate against a 5% slowdown with 6 runs a side:

    .venv/bin/python scripts/aa_false_positive.py --k 20 --repeats 6 --delay-fraction 0.05 --json aa.json

Options this script does not know are passed to `harness run` instead of RUN_ARGS (give them all).

With `--pool M` it launches M runs per side once (interleaved the same way) and draws each of the K trials
from that pool: `--repeats` runs of A against as many of B (A/A) and of S (slowdown), without replacement
within a trial. Far fewer launches (3M instead of 3 x repeats x K), at a price: the trials share runs, so
they are not independent draws and the counts are estimates of the rates, not K independent outcomes.

tests/test_regression_ci.py runs one round of the same procedure (`measure_round`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.analyze.baseline import load_all  # noqa: E402
from harness.analyze.compare import compare_runs  # noqa: E402

DELAY_FRACTION = 0.3
# Tiny, short and single-threaded: a round of 3 x 3 runs takes about a minute on 2 cores.
RUN_ARGS = (
    "--backend torch-ddp --gpus 1 --workload tiny --steps 20 --warmup 2 --threads-per-worker 1 --timeout 180"
).split()


def launch(out: Path, run_args: list[str], delay: float = 0.0) -> dict:
    """One `harness run` into `out`; returns its (trimmed) record."""
    before = set(out.glob("*.json")) if out.exists() else set()
    cmd = [
        sys.executable,
        "-m",
        "harness",
        "run",
        *run_args,
        "--out",
        str(out),
        "--step-delay",
        f"{delay:.6f}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    new = sorted(set(out.glob("*.json")) - before)
    if proc.returncode != 0 or len(new) != 1:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return load_all(new)[0]


def measure_round(
    workdir: Path,
    repeats: int = 3,
    run_args: list[str] = RUN_ARGS,
    delay_fraction: float = DELAY_FRACTION,
    settle_launches: int = 0,
) -> tuple[Path, Path, Path, float]:
    """Launch A, B (same code) and S (slowed) runs interleaved; returns their directories and the delay.
    `settle_launches` runs are launched first and dropped: the first launch after the machine idled runs
    slow (page cache, clock), which would inflate both A1, which sets the delay, and A's spread."""
    for _ in range(settle_launches):
        launch(workdir / "settle", run_args)
    a, b, s = (workdir / side for side in "abs")
    first = launch(a, run_args)
    delay = delay_fraction * float(np.median(first["step_times_s"]))
    for i in range(repeats):
        if i:
            launch(a, run_args)
        launch(b, run_args)
        launch(s, run_args, delay)
    return a, b, s, delay


def judge_pool(a: list[dict], b: list[dict], s: list[dict], settings: dict) -> dict:
    """One gate on one trial (trimmed records, as load_all returns them): is the A/A pair flagged (anything
    at all), is the slowdown caught?"""
    aa = compare_runs(a, b, **settings)
    slow = compare_runs(a, s, **settings)
    aa_tp, slow_tp = aa["comparisons"][0]["metrics"][0], slow["comparisons"][0]["metrics"][0]
    return {
        "aa_flagged": aa["result"] != "ok",
        "aa_throughput_change": aa_tp["change"],
        "aa_verdicts": [m["verdict"] for m in aa["comparisons"][0]["metrics"]],
        "slowdown_detected": slow_tp["verdict"] == "regression",
        "slowdown_throughput_change": slow_tp["change"],
        "mdc": slow_tp.get("minimum_detectable_change"),
    }


def gate(text: str) -> dict:
    """'median:0.05' -> compare settings: the per-run statistic and the throughput threshold."""
    statistic, threshold = text.split(":")
    return {"statistic": statistic, "threshold": float(threshold)}


def judge(a: Path, b: Path, s: Path, settings: dict) -> dict:
    """One gate on one round: is the A/A pair flagged (anything at all), is the slowdown caught?"""
    return judge_pool(load_all([a]), load_all([b]), load_all([s]), settings)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=20, help="rounds (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="runs per side per round (default 3)")
    p.add_argument(
        "--gate",
        type=gate,
        action="append",
        metavar="STATISTIC:THRESHOLD",
        help="compare settings to judge every round with (repeatable; default: median:0.03, the "
        "defaults, and min:0.10, the noisy-machine gate of the tests and the workflow)",
    )
    p.add_argument("--alpha", type=float, default=0.05, help="compare --alpha (default 0.05)")
    p.add_argument(
        "--memory-threshold", type=float, default=0.05, help="compare --memory-threshold (default 0.05)"
    )
    p.add_argument(
        "--delay-fraction",
        type=float,
        default=DELAY_FRACTION,
        help=f"injected sleep per step as a fraction of A1's median step time (default {DELAY_FRACTION})",
    )
    p.add_argument(
        "--pool", type=int, help="launch this many runs per side once and draw the K trials from them"
    )
    p.add_argument(
        "--settle-launches",
        type=int,
        default=1,
        help="launches run and dropped before each round or pool (default 1: the first runs slow)",
    )
    p.add_argument("--workdir", type=Path, help="keep the records here (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="write per-round results here")
    args, run_args = p.parse_known_args()
    run_args = run_args or RUN_ARGS
    gates = [
        {**g, "alpha": args.alpha, "memory_threshold": args.memory_threshold}
        for g in args.gate or [gate("median:0.03"), gate("min:0.10")]
    ]
    names = [f"{g['statistic']}:{g['threshold']}" for g in gates]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="distbench-aa-") as tmp:
        root = args.workdir or Path(tmp)
        if args.pool:
            a, b, s, delay = measure_round(
                root / "pool", args.pool, run_args, args.delay_fraction, args.settle_launches
            )
            pools = [load_all([side]) for side in (a, b, s)]
            rng = np.random.default_rng(0)
        for k in range(args.k if not args.pool else 0):
            a, b, s, delay = measure_round(
                root / f"round{k:03d}", args.repeats, run_args, args.delay_fraction, args.settle_launches
            )
            verdicts = {name: judge(a, b, s, g) for name, g in zip(names, gates)}
            rounds.append({"round": k, "delay_s": delay, "gates": verdicts})
            print(f"round {k + 1}/{args.k}: delay {delay * 1e3:.1f} ms", flush=True)
            for name, r in verdicts.items():
                print(
                    f"  {name:12s} A/A {'FLAGGED' if r['aa_flagged'] else 'ok'} (throughput "
                    f"{r['aa_throughput_change']:+.1%}, {r['aa_verdicts']}); slowdown "
                    f"{'detected' if r['slowdown_detected'] else 'MISSED'} "
                    f"({r['slowdown_throughput_change']:+.1%})",
                    flush=True,
                )
    for k in range(args.k if args.pool else 0):
        draw = [[pool[i] for i in rng.choice(len(pool), args.repeats, replace=False)] for pool in pools]
        verdicts = {name: judge_pool(*draw, g) for name, g in zip(names, gates)}
        rounds.append({"round": k, "delay_s": delay, "gates": verdicts})
        for name, r in verdicts.items():
            print(
                f"trial {k + 1}/{args.k} {name:12s} A/A {'FLAGGED' if r['aa_flagged'] else 'ok'} "
                f"({r['aa_throughput_change']:+.1%}); slowdown "
                f"{'detected' if r['slowdown_detected'] else 'MISSED'} "
                f"({r['slowdown_throughput_change']:+.1%}, "
                f"MDC {r['mdc'] if r['mdc'] is None else format(r['mdc'], '.1%')})",
                flush=True,
            )
    summary = {
        name: {
            "false_positives": sum(r["gates"][name]["aa_flagged"] for r in rounds),
            "detected": sum(r["gates"][name]["slowdown_detected"] for r in rounds),
        }
        for name in names
    }
    for name, c in summary.items():
        print(
            f"gate {name}: A/A false positives {c['false_positives']}/{args.k}; injected slowdown "
            f"({args.delay_fraction:.0%} of a step) detected {c['detected']}/{args.k}; "
            f"{args.repeats} runs per side"
            + (f", drawn from a pool of {args.pool} per side" if args.pool else "")
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "gates": dict(zip(names, gates)),
                    "repeats": args.repeats,
                    "run_args": run_args,
                    "summary": summary,
                    "rounds": rounds,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
