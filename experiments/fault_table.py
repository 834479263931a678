"""The fault table: inject each fault into a 2-rank torch-ddp run and report what the record says and how
long it took from the fault to the harness's exit (record written, every process gone).

    .venv/bin/python experiments/fault_table.py [--backend torch-ddp] [--out /tmp/fault-table]

Time to detect = harness exit - the unix time the faulty rank printed just before faulting (for the
harness stopped by SIGTERM: from the signal; for the full filesystem: from filling it). Run it on a
quiet machine: start-up and step times stretch on a busy one, detection does not depend on them much.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
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


def harness_run(args, options: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "harness", "run", "--backend", args.backend, "--gpus", "2", "--steps", "5"]
    argv += ["--warmup", "1", "--compute-method", "none", "--threads-per-worker", "1", "--device", "cpu"]
    return subprocess.Popen(
        [*argv, "--out", str(out), *options],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def wait_for_steps(out: Path, proc: subprocess.Popen, old: set, timeout_s: float = 90) -> None:
    """Until the run `proc` started (a run dir under OUT/logs not in `old`) has logged a step."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if any(
            "step" in p.read_text(errors="replace")
            for d in set(out.glob("logs/*")) - old
            for p in d.glob("rank0.events.jsonl")
        ):
            return
        time.sleep(0.2)


def injected_row(args, label: str, options: list[str]) -> str:
    before = set(args.out.glob("*.json"))
    start = time.time()
    harness_run(args, options, args.out).communicate()
    done = time.time()
    record = json.loads(sorted(set(args.out.glob("*.json")) - before)[0].read_text())
    logs = " ".join(
        f.read_text(errors="replace") for f in Path(record["launch"]["log_dir"]).glob("rank*.log")
    )
    injected = re.findall(r"injecting fault '\w+' at step \d+ \(unix time ([0-9.]+)\)", logs)
    detect = f"{done - float(injected[0]):.1f}" if injected else "fault not reached"
    return (
        f"| {label} | {record['status']} | {(record['error'] or {}).get('rank')} | {detect} | "
        f"{done - start:.1f} |"
    )


def scheduler_stop_row(args) -> str:
    """What a scheduler's time limit does to the harness (Slurm: SIGTERM, SIGKILL after KillWait):
    SIGTERM once the ranks are stepping; time to detect = SIGTERM to the harness's exit, record written."""
    before = set(args.out.glob("*.json"))
    start = time.time()
    old = set(args.out.glob("logs/*"))
    proc = harness_run(
        args, ["--steps", "400", "--step-delay", "0.05"], args.out, {**os.environ, "SLURM_JOB_ID": "4242"}
    )
    wait_for_steps(args.out, proc, old)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.communicate()
    done = time.time()
    record = json.loads(sorted(set(args.out.glob("*.json")) - before)[0].read_text())
    return (
        f"| harness stopped by SIGTERM (a Slurm time limit, scancel) | {record['status']} "
        f"({record['error']['message'].split(' by ', 1)[1].split(';')[0]}) | "
        f"{record['error'].get('rank')} | {done - sent:.1f} | {done - start:.1f} |"
    )


def full_filesystem_row(args) -> str:
    """The results folder on a 2 MiB tmpfs that fills while the run is under way (needs root to mount)."""
    mount = Path(tempfile.mkdtemp(prefix="fault-table-fs."))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]).returncode:
        return "| results filesystem fills up | not measured (cannot mount a tmpfs here) | | | |"
    try:
        start = time.time()
        proc = harness_run(args, ["--steps", "400", "--step-delay", "0.05"], mount)
        wait_for_steps(mount, proc, set())
        filled = time.time()
        subprocess.run(["dd", "if=/dev/zero", f"of={mount / 'filler'}", "bs=64k"], capture_output=True)
        text, _ = proc.communicate()
        done = time.time()
        said = text.strip().splitlines()[-1] if text.strip() else ""
        half = [p.name for p in mount.rglob("*.tmp")]
        return (
            f"| results filesystem fills up | exit {proc.returncode}: `{said}`; half-written files: "
            f"{len(half)} | | {done - filled:.1f} | {done - start:.1f} |"
        )
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch-ddp")
    p.add_argument("--out", type=Path, default=Path("/tmp/fault-table"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("| fault | recorded status | culprit rank | time to detect (s) | run wall time (s) |")
    print("|---|---|---|---|---|")
    for label, options in FAULTS:
        print(injected_row(args, label, options), flush=True)
    print(scheduler_stop_row(args), flush=True)
    print(full_filesystem_row(args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
