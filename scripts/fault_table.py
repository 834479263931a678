"""The fault table: inject each fault into a 2-rank torch-ddp run and report what the record says and how
long it took from the fault to the harness's exit (record written, every process gone).

    .venv/bin/python scripts/fault_table.py [--backend torch-ddp] [--out /tmp/fault-table]

Time to detect = harness exit - the unix time the faulty rank printed just before faulting. Run it on a
quiet machine: start-up and step times stretch on a busy one, detection does not depend on them much.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAULTS = [  # (label, harness options)
    ("rank raises", ["--inject-fault", "1:2:raise", "--timeout", "120"]),
    ("rank killed (SIGKILL)", ["--inject-fault", "1:2:sigkill", "--timeout", "120"]),
    ("rank out of memory (RLIMIT_AS)", ["--inject-fault", "1:2:oom", "--timeout", "120"]),
    (
        "rank hangs, --collective-timeout 5",
        ["--inject-fault", "1:2:hang", "--collective-timeout", "5", "--timeout", "120"],
    ),
    ("rank hangs, --timeout 30", ["--inject-fault", "1:2:hang", "--timeout", "30"]),
    (
        "rank stopped (SIGSTOP), --collective-timeout 5",
        ["--inject-fault", "1:2:sigstop", "--collective-timeout", "5", "--timeout", "120"],
    ),
    ("rank stopped (SIGSTOP), --timeout 30", ["--inject-fault", "1:2:sigstop", "--timeout", "30"]),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch-ddp")
    p.add_argument("--out", type=Path, default=Path("/tmp/fault-table"))
    args = p.parse_args()
    print("| fault | recorded status | culprit rank | time to detect (s) | run wall time (s) |")
    print("|---|---|---|---|---|")
    for label, options in FAULTS:
        before = set(args.out.glob("*.json"))
        start = time.time()
        subprocess.run(
            [
                sys.executable,
                "-m",
                "harness",
                "run",
                "--backend",
                args.backend,
                "--gpus",
                "2",
                "--steps",
                "5",
                "--warmup",
                "1",
                "--compute-method",
                "none",
                "--threads-per-worker",
                "1",
                "--device",
                "cpu",
                "--out",
                str(args.out),
                *options,
            ],
            cwd=REPO,
            capture_output=True,
        )
        done = time.time()
        record = json.loads(sorted(set(args.out.glob("*.json")) - before)[0].read_text())
        logs = " ".join(
            f.read_text(errors="replace") for f in Path(record["launch"]["log_dir"]).glob("rank*.log")
        )
        injected = re.findall(r"injecting fault '\w+' at step \d+ \(unix time ([0-9.]+)\)", logs)
        detect = f"{done - float(injected[0]):.1f}" if injected else "fault not reached"
        print(
            f"| {label} | {record['status']} | {(record['error'] or {}).get('rank')} | "
            f"{detect} | {done - start:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
