"""Benchmark (not a test): `harness run --backend torch-ddp` against the plain DDP loop, interleaved.

python tests/perf/ddp_overhead.py [--gpus 2] [--repeats 3] [--steps 30]
Reports (1) the adapter's median step time / the plain loop's, and (2) the harness's own work inside the
timed region (fetching the rank's batch, i.e. the recorded data wait, plus loop bookkeeping) as a fraction
of the step. Run it on a quiet machine: the two sides alternate so drift affects both.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from harness.metrics import per_step_max  # noqa: E402


def plain(gpus, steps, warmup, threads, micro) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plain.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}",
                        str(REPO / "tests/perf/plain_ddp.py"), str(out), "--steps", str(steps), "--warmup",
                        str(warmup), "--threads", str(threads), "--micro-batch", str(micro)],
                       check=True, capture_output=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        return per_step_max([{"t": t} for t in json.loads(out.read_text())["step_times"]], "t")


def harness(gpus, steps, warmup, threads, micro) -> tuple[list[float], list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "harness", "run", "--backend", "torch-ddp", "--gpus", str(gpus),
                        "--steps", str(steps), "--warmup", str(warmup), "--threads-per-worker", str(threads),
                        "--micro-batch", str(micro), "--compute-steps", "0", "--out", tmp],
                       check=True, capture_output=True, cwd=REPO)
        rec = json.loads(next(Path(tmp).glob("*.json")).read_text())
        return per_step_max(rec["ranks"], "step_times"), per_step_max(rec["ranks"], "data_wait")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=8)
    args = p.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.gpus)
    plain_t, harness_t, data_t = [], [], []
    for i in range(args.repeats):
        plain_t += plain(args.gpus, args.steps, args.warmup, threads, args.micro_batch)
        h, d = harness(args.gpus, args.steps, args.warmup, threads, args.micro_batch)
        harness_t += h; data_t += d
        print(f"repeat {i + 1}/{args.repeats}: plain {np.median(plain_t) * 1e3:.1f} ms, "
              f"harness {np.median(harness_t) * 1e3:.1f} ms", flush=True)
    ratio = np.median(harness_t) / np.median(plain_t)
    own = np.median(data_t) / np.median(harness_t)
    print(f"median step: plain {np.median(plain_t) * 1e3:.2f} ms, harness torch-ddp {np.median(harness_t) * 1e3:.2f} ms")
    print(f"adapter / plain step time: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")
    print(f"harness work inside the timed region (batch fetch): {np.median(data_t) * 1e3:.3f} ms = {own * 100:.2f}% of a step")


if __name__ == "__main__":
    main()
