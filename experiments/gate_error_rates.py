"""How often does `harness gate` decide right, and what does it cost? A/A, 5% and 10% injected slowdowns.

The configuration is `tiny` at 2 ranks (RUN_ARGS; options this script does not know go to `harness run`
instead, give them all). First `--calibration-runs` runs measure the step time (the median of their
per-run median step); a slowdown of F is injected as `--step-delay F x step time` on the head side only,
so the head's step time grows by F. Then, for each case (A/A: no delay; 5%; 10%):

- **gates** (the default): `--gates` real `harness gate --base REF --head REF` runs (the same commit on both
  sides, one worktree), each with its own --out and order seed and the gate's default budget unless
  `--max-pairs` / `--max-minutes` say otherwise; the cases take turns gate by gate, so a drift of the
  machine lands on all three alike. Each gate is what a pull request would get: independent outcomes.
- **`--pool M`**: M runs of each of A, B (the same code), S5 and S10 (slowed), launched once, round by round
  in a shuffled order; each of the `--gates` trials of a case draws its pairs from the pool without
  replacement (A with B for A/A, A with S5, A with S10) and feeds their log-ratios, pair by pair, to the
  gate's own decision (harness.analyze.sequential.decide) until it decides or the budget is spent. Far
  fewer launches (4M), at a price: the trials share runs, so they are not independent draws, and the
  counts estimate the rates rather than being independent outcomes; with M below --max-pairs a trial's
  budget is M pairs. Minutes per verdict: the pairs' own run times.

With `--pool` it also prints, from the A and B runs, the spread of the A/A log-ratio of each per-run
statistic (median, min, mean, trimmed mean, and the median step's process CPU time, the companion): the
data the gate's default statistic is chosen from.

It prints, per case, the REGRESSION / NO REGRESSION / INCONCLUSIVE counts against the targets (A/A:
REGRESSION at most 1 in 20, NO REGRESSION at least 16 in 20; 5%: REGRESSION at least 18 in 20; 10%: 20 in
20), the median pairs and minutes per verdict, and what the default budget costs in minutes here. Run it on
a quiet machine; on a shared one the counts measure the neighbours too:

    .venv/bin/python experiments/gate_error_rates.py --gates 20 --json gate-rates.json
    .venv/bin/python experiments/gate_error_rates.py --pool 60 --gates 20 --json gate-pool.json

Rerun with the same --workdir, it resumes: finished gates (their verdict.json) are read back, an
interrupted gate resumes from its recorded pairs, and pool runs already recorded are kept.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from statistics import median

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.analyze.baseline import load_all, trim  # noqa: E402
from harness.analyze.samples import STATISTICS  # noqa: E402
from harness.analyze.sequential import CONTINUE, Design, decide  # noqa: E402
from harness.gate.command import DEFAULT_MAX_PAIRS, DEFAULT_THRESHOLD  # noqa: E402
from harness.gate.pairs import DEFAULT_MAX_MINUTES, DEFAULT_STATISTIC  # noqa: E402
from harness.gate.verdict import VERDICT_FILE  # noqa: E402
from harness.run.child import run_child  # noqa: E402

RUN_ARGS = "--backend torch-ddp --gpus 2 --workload tiny".split()
CASES = {"aa": 0.0, "5": 0.05, "10": 0.10}
NAMES = {"aa": "A/A", "5": "5% slower", "10": "10% slower"}
VERDICTS = ("REGRESSION", "NO REGRESSION", "INCONCLUSIVE")
# The targets for 20 gates: (verdict, at least / at most, count)
TARGETS = {
    "aa": [("REGRESSION", "at most", 1), ("NO REGRESSION", "at least", 16)],
    "5": [("REGRESSION", "at least", 18)],
    "10": [("REGRESSION", "at least", 20)],
}


def one_run(out: Path, run_args: list[str], delay: float = 0.0) -> tuple[dict, float]:
    """One `harness run` of this checkout into `out`, its output in out/last-run.log; its trimmed record and
    its wall time."""
    extra = ["--step-delay", f"{delay:.6f}"] if delay else []
    done = run_child(["run", *run_args, *extra], out, cwd=REPO, log=out / "last-run.log")
    if done.returncode != 0 or done.record is None:
        raise RuntimeError(f"harness run exited {done.returncode}; see {out / 'last-run.log'}")
    return trim(done.record), done.seconds


def step_time(workdir: Path, run_args: list[str], runs: int, statistic: str) -> float:
    """The median over `runs` launches of each run's statistic of its step times (what --step-delay is
    sized from); runs already recorded there count."""
    folder = workdir / "calibration"
    have = load_all([folder]) if folder.is_dir() and any(folder.glob("*.json")) else []
    while len(have) < runs:
        have.append(one_run(folder, run_args)[0])
    return float(median(STATISTICS[statistic](r["step_times_s"]) for r in have[:runs]))


def gate_command(ref: str, run_args: list[str], out: Path, seed: int, delay: float, args) -> list[str]:
    cmd = ["gate", "--base", ref, "--head", ref, *run_args, "--out", str(out), "--order-seed", str(seed)]
    cmd += ["--threshold", str(args.threshold), "--max-pairs", str(args.max_pairs)]
    cmd += ["--max-minutes", str(args.max_minutes), "--statistic", args.statistic]
    if delay:
        cmd += ["--head-args", f"--step-delay {delay:.6f}"]
    return cmd


def run_gates(args, run_args: list[str], delays: dict[str, float]) -> dict[str, list[dict]]:
    """`--gates` real gates per case, the cases taking turns; a gate already decided is read back."""
    results: dict[str, list[dict]] = {case: [] for case in args.cases}
    for g in range(args.gates):
        for case in args.cases:
            out = args.workdir / "gates" / case / f"gate{g:03d}"
            if not (out / VERDICT_FILE).is_file():
                out.mkdir(parents=True, exist_ok=True)
                cmd = gate_command(args.ref, run_args, out, g, delays[case], args)
                run_child(cmd, None, cwd=REPO, log=out.parent / f"gate{g:03d}.log")
            if not (out / VERDICT_FILE).is_file():
                raise RuntimeError(f"gate {out} wrote no verdict; see {out.parent / f'gate{g:03d}.log'}")
            verdict = json.loads((out / VERDICT_FILE).read_text())
            step = verdict.get("step_time") or {}
            row = {
                "gate": g,
                "verdict": verdict["verdict"],
                "pairs": step.get("pairs", verdict.get("pairs_run")),
                "minutes": verdict["minutes"],
                "change": step.get("change"),
                "line": verdict["line"],
            }
            results[case].append(row)
            print(f"{NAMES[case]:10s} gate {g + 1}/{args.gates}: {row['line']}", flush=True)
    return results


def run_pool(args, run_args: list[str], delays: dict[str, float]) -> dict[str, list[dict]]:
    """The pool: M runs of each side launched once (shuffled within each round), then `--gates` sequential
    trials per case drawn from it."""
    sides = {"A": 0.0, "B": 0.0, "S5": delays.get("5", 0.0), "S10": delays.get("10", 0.0)}
    times_path = args.workdir / "pool" / "times.json"
    times: dict[str, dict[str, float]] = json.loads(times_path.read_text()) if times_path.is_file() else {}
    pool: dict[str, list[tuple[dict, float]]] = {}
    for side in sides:
        folder = args.workdir / "pool" / side
        records = load_all([folder]) if folder.is_dir() and any(folder.glob("*.json")) else []
        pool[side] = [(r, times.get(side, {}).get(r["run_id"], math.nan)) for r in records]
    rng = np.random.default_rng(args.seed)
    for m in range(args.pool):
        order = list(sides)
        rng.shuffle(order)
        for side in order:
            if len(pool[side]) > m:
                continue
            record, took = one_run(args.workdir / "pool" / side, run_args, sides[side])
            pool[side].append((record, took))
            times.setdefault(side, {})[record["run_id"]] = took
            times_path.write_text(json.dumps(times, indent=1))
        print(f"pool round {m + 1}/{args.pool} done", flush=True)
    design = Design(threshold=args.threshold, max_pairs=args.max_pairs)
    stat = STATISTICS[args.statistic]
    against = {"aa": "B", "5": "S5", "10": "S10"}
    results: dict[str, list[dict]] = {case: [] for case in args.cases}
    for case in args.cases:
        for t in range(args.gates):
            draw = np.random.default_rng([args.seed, t, list(CASES).index(case)])
            a = [pool["A"][i] for i in draw.permutation(args.pool)]
            x = [pool[against[case]][i] for i in draw.permutation(args.pool)]
            ratios, minutes = [], 0.0
            decision = decide([], design)
            for (ra, ta), (rx, tx) in zip(a, x):
                ratios.append(math.log(stat(rx["step_times_s"]) / stat(ra["step_times_s"])))
                minutes += (ta + tx) / 60
                last = len(ratios) == args.pool or minutes + minutes / len(ratios) > args.max_minutes
                decision = decide(ratios, design, exhausted=last)
                if decision.verdict != CONTINUE:
                    break
            row = {
                "gate": t,
                "verdict": decision.verdict.upper(),
                "pairs": decision.pairs,
                "minutes": minutes,
                "change": decision.change,
            }
            results[case].append(row)
            print(
                f"{NAMES[case]:10s} trial {t + 1}/{args.gates}: {row['verdict']} after {row['pairs']} pairs "
                f"({minutes:.1f} min), step time {decision.change:+.1%}",
                flush=True,
            )
    return results


def statistic_spread(workdir: Path) -> dict[str, dict[str, float]]:
    """Which per-run statistic is least noisy here: from the pool's A and B runs (the same code), the
    standard deviation of log(stat(B_i) / stat(A_i)) for each of the gate's statistics and for the median
    of the steps' process CPU time, pairing the runs of one round (launched minutes apart, as a gate's pair
    is) and, for contrast, runs of different rounds. The smaller the spread, the fewer pairs a gate needs:
    the pairs to decide grow with its square."""
    runs = {side: load_all([workdir / "pool" / side]) for side in ("A", "B")}
    n = min(len(runs["A"]), len(runs["B"]))
    order = {side: sorted(runs[side], key=lambda r: r["run_id"])[:n] for side in runs}
    measures = {name: (lambda r, f=f: f(r["step_times_s"])) for name, f in STATISTICS.items()}
    measures["cpu median (companion)"] = lambda r: float(np.median(r.get("step_cpu_times_s") or [math.nan]))
    out = {}
    for name, measure in measures.items():
        a = np.array([measure(r) for r in order["A"]])
        b = np.array([measure(r) for r in order["B"]])
        same = np.log(b / a)
        other = np.log(np.roll(b, 1) / a)
        out[name] = {
            "same_round_sd": float(np.nanstd(same, ddof=1)),
            "other_round_sd": float(np.nanstd(other, ddof=1)),
        }
        print(
            f"{name:24s} A/A log-ratio sd: {out[name]['same_round_sd']:.4f} same round, "
            f"{out[name]['other_round_sd']:.4f} rounds apart ({n} pairs)",
            flush=True,
        )
    return out


def summarize(results: dict[str, list[dict]], args) -> dict:
    summary = {}
    for case, rows in results.items():
        counts = {v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}
        per_verdict = {
            v: {
                "median_pairs": median(r["pairs"] for r in rows if r["verdict"] == v),
                "median_minutes": median(r["minutes"] for r in rows if r["verdict"] == v),
            }
            for v in VERDICTS
            if counts[v]
        }
        scale = 20 / len(rows) if rows else 0
        targets = [
            {
                "verdict": v,
                "target": f"{how} {n} of 20",
                "scaled_count": counts[v] * scale,
                "met": (counts[v] * scale <= n) if how == "at most" else (counts[v] * scale >= n),
            }
            for v, how, n in TARGETS[case]
        ]
        summary[case] = {"gates": len(rows), "counts": counts, "per_verdict": per_verdict, "targets": targets}
        print(
            f"{NAMES[case]}: "
            + ", ".join(f"{v} {counts[v]}/{len(rows)}" for v in VERDICTS)
            + "; "
            + "; ".join(
                f"{v}: median {p['median_pairs']:g} pairs, {p['median_minutes']:.1f} min"
                for v, p in per_verdict.items()
            )
            + "; targets: "
            + ", ".join(f"{t['verdict']} {t['target']}: {'met' if t['met'] else 'NOT met'}" for t in targets)
        )
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gates", type=int, default=20, help="gates (or pool trials) per case (default 20)")
    p.add_argument("--cases", default="aa,5,10", help="comma-separated, of aa, 5, 10 (default all)")
    p.add_argument(
        "--pool", type=int, help="launch this many runs per side once and draw the trials from them"
    )
    p.add_argument("--ref", default="HEAD", help="the commit both sides run (default HEAD)")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    p.add_argument("--max-pairs", type=int, default=DEFAULT_MAX_PAIRS)
    p.add_argument("--max-minutes", type=float, default=DEFAULT_MAX_MINUTES)
    p.add_argument("--statistic", default=DEFAULT_STATISTIC, choices=list(STATISTICS))
    p.add_argument("--calibration-runs", type=int, default=3, help="runs that measure the step time (3)")
    p.add_argument("--seed", type=int, default=0, help="the pool's launch order and draws")
    p.add_argument(
        "--workdir", type=Path, default=Path("results/gate-error-rates"), help="records, resumable"
    )
    p.add_argument("--json", type=Path, help="write every gate's outcome and the summary here")
    args, run_args = p.parse_known_args()
    run_args = run_args or RUN_ARGS
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {', '.join(unknown)}; valid: {', '.join(CASES)}")
    args.workdir = args.workdir.resolve()
    t_step = step_time(args.workdir, run_args, args.calibration_runs, args.statistic)
    delays = {case: fraction * t_step for case, fraction in CASES.items()}
    print(
        f"step time ({args.statistic} of {args.calibration_runs} run(s)): {t_step * 1e3:.1f} ms; injected "
        + ", ".join(f"{NAMES[c]} {delays[c] * 1e3:.2f} ms/step" for c in args.cases if delays[c]),
        flush=True,
    )
    results = run_pool(args, run_args, delays) if args.pool else run_gates(args, run_args, delays)
    summary = summarize(results, args)
    spread = statistic_spread(args.workdir) if args.pool else None
    pair_minutes = [
        r["minutes"] / r["pairs"] for rows in results.values() for r in rows if r["pairs"] and r["minutes"]
    ]
    budget = args.max_pairs * median(pair_minutes) if pair_minutes else math.nan
    mode = f"a pool of {args.pool} runs a side, trials not independent" if args.pool else "independent gates"
    print(
        f"the budget ({args.max_pairs} pairs) costs about {budget:.1f} min here "
        f"(median {median(pair_minutes) if pair_minutes else math.nan:.2f} min a pair); {mode}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "mode": "pool" if args.pool else "gates",
                    "pool": args.pool,
                    "run_args": run_args,
                    "step_time_s": t_step,
                    "delays_s": delays,
                    "settings": {
                        "threshold": args.threshold,
                        "max_pairs": args.max_pairs,
                        "max_minutes": args.max_minutes,
                        "statistic": args.statistic,
                    },
                    "budget_minutes": budget,
                    "statistic_spread": spread,
                    "summary": summary,
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
