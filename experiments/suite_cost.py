"""What the test suite costs, and where: the CPU seconds of every Python process it starts (pytest's own,
each `harness` command, each launcher, each rank), by test and by kind of process, against the wall time.

    .venv/bin/python experiments/suite_cost.py [--out /tmp/suite-cost] [--since REV] [-- PYTEST ARGS]
    .venv/bin/python experiments/suite_cost.py --report /tmp/suite-cost [--since REV]

Why: the suite is CPU-bound (a rank's start-up, its framework's import, is most of a short run's work), so
its wall time on C cores can go no lower than its CPU seconds over C, however the tests are scheduled. The
floor tells whether a target time needs less work (fewer launches, fewer claims) or more cores.

How: a `sitecustomize` on PYTHONPATH makes every Python process append its own user and system CPU time
(os.times) and the test that started it (PYTEST_CURRENT_TEST, which children inherit) to a JSON-lines
file when it exits. A process killed by a signal or ended by os._exit writes nothing (the fault tests'
victims), nor do non-Python processes (a compiler, mpirun's orted): the tables are a lower bound. The
floor takes the suite's whole CPU time from the kernel (getrusage of every descendant pytest waited for).
`--since REV` splits the tests into those collected at REV and those added after it (by test id).
Measure on a quiet machine: nothing else beside the suite.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = """
import atexit, json, os, sys, time

_started = time.monotonic()


def _account():
    times = os.times()
    line = {
        "argv": list(getattr(sys, "orig_argv", sys.argv))[:8],
        "user_s": times.user,
        "system_s": times.system,
        "wall_s": time.monotonic() - _started,
        "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
    }
    with open(os.environ["DISTBENCH_SUITE_COST_LOG"], "a") as log:
        log.write(json.dumps(line) + "\\n")


atexit.register(_account)
"""


def run_suite(out: Path, pytest_args: list[str]) -> float:
    """Run the suite with every Python process accounted into out/processes.jsonl; its wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = out / "processes.jsonl"
    log.unlink(missing_ok=True)
    env = dict(os.environ, DISTBENCH_SUITE_COST_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(out), env.get("PYTHONPATH", "")) if p)
    started = time.monotonic()
    with open(out / "pytest.log", "w") as shown:
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
            cwd=REPO,
            env=env,
            stdout=shown,
            stderr=subprocess.STDOUT,
        )
    wall = time.monotonic() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # every descendant waited for, Python or not
    facts = {"wall_s": wall, "cpu_s": children.ru_utime + children.ru_stime}
    (out / "wall.json").write_text(json.dumps({**facts, "cores": len(os.sched_getaffinity(0))}))
    return wall


def kind(argv: list[str]) -> str:
    """What a process was: a rank, a `harness` command, a launcher (`python -m X`), pytest, or a script."""
    text = " ".join(argv)
    if "backends/worker.py" in text:
        return "rank (backends/worker.py)"
    if "-m" in argv[:4]:
        module = argv[argv.index("-m") + 1 :]
        if module[:1] == ["harness"] and len(module) > 1:
            return f"harness {module[1]}"
        return f"-m {module[0]}" if module else "other"
    if "xdist" in text or "execnet" in text or (len(argv) > 2 and argv[1:3] == ["-u", "-c"]):
        return "pytest worker (in-process tests)"
    return Path(argv[1]).name if len(argv) > 1 and not argv[1].startswith("-") else "other"


def test_of(current: str) -> str:
    """The test id in PYTEST_CURRENT_TEST ('tests/x.py::name[id] (call)'), without the phase."""
    return re.sub(r" \((setup|call|teardown)\)$", "", current)


def collected(rev: str) -> set[str]:
    """The test ids pytest collects at git revision `rev` (in a temporary worktree)."""
    with tempfile.TemporaryDirectory() as tree:
        add = ["git", "worktree", "add", "--detach", tree, rev]
        subprocess.run(add, cwd=REPO, check=True, capture_output=True)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
                cwd=tree,
                capture_output=True,
                text=True,
            )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, capture_output=True)
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def report(out: Path, since: str | None) -> None:
    rows = [json.loads(line) for line in (out / "processes.jsonl").read_text().splitlines() if line]
    facts = json.loads((out / "wall.json").read_text()) if (out / "wall.json").exists() else {}
    cpu = [r["user_s"] + r["system_s"] for r in rows]
    total = sum(cpu)
    cores = facts.get("cores") or len(os.sched_getaffinity(0))
    print(f"{len(rows)} Python processes accounted: {total:,.0f} CPU-s")
    if facts:  # the whole suite's CPU, from the kernel: the accounted processes and everything else
        whole, wall = facts["cpu_s"], facts["wall_s"]
        busy = whole / wall
        print(f"the suite in all: {whole:,.0f} CPU-s, wall {wall:,.0f} s on {cores} cores ({busy:.0%} busy)")
        total = whole
    print(f"floor on {cores} cores: {total / cores:,.0f} s (every core busy from start to end)\n")

    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    by_test: collections.Counter[str] = collections.Counter()
    by_module: collections.Counter[str] = collections.Counter()
    for row, seconds in zip(rows, cpu, strict=True):
        by_kind[kind(row["argv"])].append(seconds)
        test = test_of(row["test"])
        by_test[test or "(outside any test: pytest's own processes)"] += seconds
        by_module[test.split("::")[0] or "(outside any test)"] += seconds
    print("| process | count | CPU-s | CPU-s each (median) |\n|---|---|---|---|")
    for name, times in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"| {name} | {len(times)} | {sum(times):,.0f} | {sorted(times)[len(times) // 2]:.2f} |")
    print("\n| test module | CPU-s | share of the suite's |\n|---|---|---|")
    for name, seconds in by_module.most_common(15):
        print(f"| {name} | {seconds:,.0f} | {seconds / total:.0%} |")
    print("\n| test | CPU-s |\n|---|---|")
    for name, seconds in by_test.most_common(20):
        print(f"| {name} | {seconds:,.0f} |")
    if since:
        before = collected(since)
        tests = {t: s for t, s in by_test.items() if "::" in t}
        old = sum(s for t, s in tests.items() if t in before)
        added = sum(tests.values()) - old
        print(f"\ntests collected at {since}: {old:,.0f} CPU-s; tests added since: {added:,.0f} CPU-s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "suite-cost")
    parser.add_argument("--report", type=Path, help="report a folder an earlier call wrote; run nothing")
    parser.add_argument("--since", help="split the CPU: tests collected at this git revision, and later ones")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args()
    if args.report:
        report(args.report, args.since)
        return
    run_suite(args.out, args.pytest_args)
    report(args.out, args.since)


if __name__ == "__main__":
    main()
