"""Benchmark (not a test): `harness run --backend torch-ddp` against the plain DDP loop, interleaved.

python experiments/ddp_overhead.py [--gpus 2] [--repeats 10] [--steps 30]
Reports the adapter's median step time / the plain loop's, with a bootstrap 90% interval over launches
(identical launches differ by a few percent on a small VM, so one launch each says little), and both
sides' minor page faults per step. Both sides run with the same process settings (threads, allocator: the
ones the harness gives every worker) and alternate launches so drift affects both. Run it on a quiet
machine.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from core.process import free_port, process_settings  # noqa: E402
from harness.analyze.metrics import per_step_max  # noqa: E402


def plain(gpus, steps, warmup, threads, micro) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plain.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc-per-node={gpus}",
                f"--master-port={free_port()}",
                str(REPO / "experiments/plain_ddp.py"),
                str(out),
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--threads",
                str(threads),
                "--micro-batch",
                str(micro),
            ],
            check=True,
            capture_output=True,
            cwd=REPO,
            env={**os.environ, **process_settings(threads)},
        )
        ranks = json.loads(out.read_text())["ranks"]
        return per_step_max(ranks, "step_times"), max(r["minor_faults_per_step"] for r in ranks)


def harness(gpus, steps, warmup, threads, micro) -> tuple[list[float], float]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "harness",
                "run",
                "--backend",
                "torch-ddp",
                "--gpus",
                str(gpus),
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--threads-per-worker",
                str(threads),
                "--micro-batch",
                str(micro),
                "--compute-steps",
                "0",
                "--out",
                tmp,
            ],
            check=True,
            capture_output=True,
            cwd=REPO,
        )
        rec = json.loads(next(Path(tmp).glob("*.json")).read_text())
        return (
            per_step_max(rec["ranks"], "step_times"),
            rec["summary"]["minor_faults_per_step"],
        )


def ratio_interval(plain_runs, harness_runs, draws=2000, seed=0) -> tuple[float, float]:
    """90% bootstrap interval of median(harness steps) / median(plain steps), resampling whole launches."""
    rng = np.random.default_rng(seed)
    k = len(plain_runs)
    ratios = []
    for _ in range(draws):
        p = np.concatenate([plain_runs[i] for i in rng.integers(0, k, k)])
        h = np.concatenate([harness_runs[i] for i in rng.integers(0, k, k)])
        ratios.append(np.median(h) / np.median(p))
    return tuple(np.percentile(ratios, [5, 95]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8)
    args = p.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.gpus)
    plain_runs, harness_runs, faults = [], [], {"plain": [], "harness": []}
    shape = (args.gpus, args.steps, args.warmup, threads, args.micro_batch)
    for i in range(args.repeats):
        steps, f = plain(*shape)
        plain_runs.append(steps)
        faults["plain"].append(f)
        steps, f = harness(*shape)
        harness_runs.append(steps)
        faults["harness"].append(f)
        print(
            f"launch pair {i + 1}/{args.repeats}: plain {np.median(plain_runs[-1]) * 1e3:.1f} ms, "
            f"harness {np.median(harness_runs[-1]) * 1e3:.1f} ms",
            flush=True,
        )
    plain_t, harness_t = np.concatenate(plain_runs), np.concatenate(harness_runs)
    ratio = np.median(harness_t) / np.median(plain_t)
    low, high = ratio_interval(plain_runs, harness_runs)
    print(
        f"{args.gpus} workers x {threads} thread(s), {args.repeats} launches each x {args.steps} steps; "
        f"process settings {process_settings(threads)}"
    )
    print(
        f"median step: plain {np.median(plain_t) * 1e3:.2f} ms, "
        f"harness torch-ddp {np.median(harness_t) * 1e3:.2f} ms"
    )
    print(
        f"adapter / plain step time: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%), "
        f"90% interval over launches [{low:.4f}, {high:.4f}]"
    )
    print(
        f"minor page faults per step (median over launches): plain {np.median(faults['plain']):,.0f}, "
        f"harness {np.median(faults['harness']):,.0f}"
    )


if __name__ == "__main__":
    main()
