"""The fault table: inject each fault into a 2-rank torch-ddp run and report what the record says and how
long it took from the fault to the harness's exit (record written, every process gone).

    .venv/bin/python experiments/fault_table.py [--backend torch-ddp] [--out /tmp/fault-table]

Time to detect = harness exit - the unix time the faulty rank printed just before faulting (for the
harness stopped by SIGTERM: from the signal; for the full filesystem: from filling it). Run it on a
quiet machine: start-up and step times stretch on a busy one, detection does not depend on them much.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.run.child import Child, start_child  # noqa: E402

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


def harness_run(args, options: list[str], out: Path, env: dict | None = None) -> Child:
    """A 2-rank CPU `harness run` of this checkout into `out`, started (harness.run.child): `options` after
    the table's own, `env` on top of this process's."""
    argv = ["run", "--backend", args.backend, "--gpus", "2", "--steps", "5", "--warmup", "1"]
    argv += ["--compute-method", "none", "--threads-per-worker", "1", "--device", "cpu", *options]
    return start_child(argv, out, cwd=REPO, env=env)


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
    start = time.time()
    done = harness_run(args, options, args.out).finish()
    end = time.time()
    record = done.record
    if record is None:
        return f"| {label} | {done.status} | | | {end - start:.1f} |"
    logs = " ".join(
        f.read_text(errors="replace") for f in Path(record["launch"]["log_dir"]).glob("rank*.log")
    )
    injected = re.findall(r"injecting fault '\w+' at step \d+ \(unix time ([0-9.]+)\)", logs)
    detect = f"{end - float(injected[0]):.1f}" if injected else "fault not reached"
    return (
        f"| {label} | {record['status']} | {(record['error'] or {}).get('rank')} | {detect} | "
        f"{end - start:.1f} |"
    )


def scheduler_stop_row(args) -> str:
    """What a scheduler's time limit does to the harness (Slurm: SIGTERM, SIGKILL after KillWait):
    SIGTERM once the ranks are stepping; time to detect = SIGTERM to the harness's exit, record written."""
    start = time.time()
    old = set(args.out.glob("logs/*"))
    run = harness_run(args, ["--steps", "400", "--step-delay", "0.05"], args.out, {"SLURM_JOB_ID": "4242"})
    wait_for_steps(args.out, run.proc, old)
    sent = time.time()
    run.signal(signal.SIGTERM)
    record = run.finish().record
    end = time.time()
    if record is None:
        return "| harness stopped by SIGTERM (a Slurm time limit, scancel) | no record | | | |"
    return (
        f"| harness stopped by SIGTERM (a Slurm time limit, scancel) | {record['status']} "
        f"({record['error']['message'].split(' by ', 1)[1].split(';')[0]}) | "
        f"{record['error'].get('rank')} | {end - sent:.1f} | {end - start:.1f} |"
    )


def full_filesystem_row(args) -> str:
    """The results folder on a 2 MiB tmpfs that fills while the run is under way (needs root to mount)."""
    mount = Path(tempfile.mkdtemp(prefix="fault-table-fs."))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)]).returncode:
        return "| results filesystem fills up | not measured (cannot mount a tmpfs here) | | | |"
    try:
        start = time.time()
        run = harness_run(args, ["--steps", "400", "--step-delay", "0.05"], mount)
        wait_for_steps(mount, run.proc, set())
        filled = time.time()
        subprocess.run(["dd", "if=/dev/zero", f"of={mount / 'filler'}", "bs=64k"], capture_output=True)
        done = run.finish()
        end = time.time()
        said = done.output.strip().splitlines()[-1] if done.output.strip() else ""
        half = [p.name for p in mount.rglob("*.tmp")]
        return (
            f"| results filesystem fills up | exit {done.returncode}: `{said}`; half-written files: "
            f"{len(half)} | | {end - filled:.1f} | {end - start:.1f} |"
        )
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch-ddp")
    p.add_argument("--out", type=Path, default=Path("/tmp/fault-table"))
    args = p.parse_args()
    args.out = args.out.resolve()  # the runs' --out and the records looked for in it, one folder
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
