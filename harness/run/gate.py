"""`harness gate --base REF|DIR --head REF|DIR [run arguments]`: a gate that runs its own experiment.

It launches `harness run` with the run arguments given (the same for both sides, plus `--base-args` or
`--head-args` for one side only) in pairs, base and head one after the other in a random order within each
pair (seeded, the seed recorded), and takes one paired log-ratio per pair, log(stat_head / stat_base), of a
per-run statistic of the step times (`--statistic`; the fastest step by default): a drift of the machine
lands on both runs of a pair and cancels in their ratio. After every pair a sequential test
(harness.analyze.sequential) decides between "no slowdown" and "a slowdown of at least `--threshold`", with
its error rates holding although it looks after every pair; the gate stops as soon as it decides, or when
`--max-pairs` or `--max-minutes` runs out.

Each side is a git ref (checked out with `git worktree add --detach` into a temporary folder, removed at the
end, interrupted or not) or a directory holding a distbench tree; each side's runs import that tree's own
harness (its folder first on sys.path; the gate checks it). It only shells out to `harness run`, so it works
alike on a CPU runner, a GPU node (`--gpus`, `--device` pass through) and inside a Slurm allocation.

Besides the step time: communication bytes per step and model-state bytes per rank are deterministic, so
any change between the sides is reported as one, and growth fails the gate, with no statistics; peak memory
per rank is gated as `harness compare` gates it (`--memory-threshold`).

Everything lands in `--out` (default results/gate-<hash of the configuration>): the runs' records under base/
and head/ (so `harness compare OUT/base OUT/head` reads them), one line per finished pair in pairs.jsonl
(rewritten atomically after each pair), failed pairs in failures.jsonl, the configuration in gate.json, the
verdict in verdict.json and, as a pull request's comment shows it, in OUT/verdict.md. Run again with the same
arguments and `--out`, it resumes from the recorded pairs; another configuration there is refused.

Exit codes: 0 NO REGRESSION; 1 REGRESSION (a slowdown, exact growth, peak memory over its threshold, or a
head run failing where the base ran); 2 bad input (a ref that does not exist, a tree whose harness cannot
run the arguments, runs failing on the base side or on both, a budget too small to decide, another gate's
--out); `--inconclusive-exit` (default 3) INCONCLUSIVE; 130 interrupted (the pairs recorded stay).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.stats import trim_mean

from core.records import now_iso, write_atomic, write_json_atomic
from harness.analyze.baseline import InputError, load_all
from harness.analyze.compare import DEFAULT_MEMORY_THRESHOLD, compare_memory, memory_field
from harness.analyze.sequential import (
    CONTINUE,
    INCONCLUSIVE,
    NO_REGRESSION,
    REGRESSION,
    Decision,
    Design,
    decide,
    estimate,
)
from harness.analyze.summary import fmt_bytes
from harness.run.devices import query_gpus, visible_gpus, visible_mask
from harness.run.launch import stop_on_sigterm, stopped
from harness.run.options import add_run_arguments
from harness.usage import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Parser,
    UsageError,
    fraction,
    int_at_least,
    seconds,
)

DEFAULT_THRESHOLD = 0.05
DEFAULT_MAX_PAIRS = 40
# The calibration's cost grows with the square of the looks (about ten seconds at 100); a budget beyond it
# is better spent on a quieter machine or a higher threshold.
MAX_PAIRS_LIMIT = 100
DEFAULT_MAX_MINUTES = 60.0
EXIT_INCONCLUSIVE = 3
EXIT_INTERRUPTED = 130
# The per-run statistic whose paired log-ratios are tested. The median is the default until the spread of
# the candidates has been measured on a quiet machine; min is steadier under contention but blind to
# slowdowns that hit only some steps (harness.analyze.compare says why).
STATISTICS: dict[str, Callable] = {
    "median": np.median,
    "min": np.min,
    "mean": np.mean,
    "trimmed-mean": lambda v: trim_mean(v, 0.1),  # 10% cut at each end
}
# Chosen from the A/A spread of each per-run statistic (docs/ci-gate.md, "Which statistic"): the fastest
# step's was the lowest, and contention, a shared runner's noise, only adds time.
DEFAULT_STATISTIC = "min"
SIDES = ("base", "head")
PAIRS_FILE, FAILURES_FILE, CONFIG_FILE, VERDICT_FILE, VERDICT_MARKDOWN = (
    "pairs.jsonl",
    "failures.jsonl",
    "gate.json",
    "verdict.json",
    "verdict.md",
)
# Exact metrics: (label, path in a record's summary). Deterministic for one configuration, so a change is
# a change; growth fails the gate.
EXACT_METRICS = (
    ("comm bytes per step", ("comm_bytes_per_rank_per_step",)),
    ("measured comm bytes per step", ("comm_measured", "bytes_per_rank_per_step")),
    ("model-state bytes per rank", ("model_state_bytes_per_rank",)),
)
# `python -c BOOTSTRAP TREE ARGS...` runs TREE's `harness ARGS...` with TREE first on sys.path, so that its
# modules, not those of an editable install, are imported; the working directory stays the caller's, so a
# relative path in the run arguments (--data, --python) means the same file for both sides.
BOOTSTRAP = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('harness', run_name='__main__', alter_sys=True)"
)
PROBE = "import sys; sys.path.insert(0, sys.argv[1]); import harness; print(harness.__file__)"
PROBE_TIMEOUT_S = 120


# ---- the two trees ------------------------------------------------------------------------------------


def git(*args: str, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@dataclass
class Tree:
    """One side's code: a git ref, checked out for the gate, or a directory taken as it is."""

    side: str
    spec: str  # as given
    kind: str  # "ref" | "dir"
    commit: str | None
    path: Path | None = None  # the folder its runs import from (a ref's once checked out)
    dirty: bool = False

    def describe(self) -> dict:
        """What identifies the code of this side (gate.json's, compared on resume)."""
        out = {"kind": self.kind, "spec": self.spec, "commit": self.commit}
        if self.kind == "dir":
            out["path"] = str(self.path)
        return out

    def text(self) -> str:
        commit = f"{self.commit[:10]}{', dirty' if self.dirty else ''}" if self.commit else "not a git tree"
        return f"{self.spec} ({commit})"


def repository() -> Path | None:
    """The git work tree the gate is started in, where refs are looked up."""
    try:
        found = git("rev-parse", "--show-toplevel")
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(found.stdout.strip()) if found.returncode == 0 and found.stdout.strip() else None


def resolve_tree(side: str, spec: str, repo: Path | None) -> Tree:
    """--base/--head: an existing directory is a tree taken as it is; anything else must be a commit of the
    repository the gate is started in."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        if not (folder / "harness" / "__main__.py").is_file():
            raise UsageError(
                f"--{side} {spec}: a directory without a distbench harness (no harness/__main__.py)"
            )
        head = git("rev-parse", "HEAD", cwd=folder)
        commit = head.stdout.strip() if head.returncode == 0 else None
        dirty = bool(commit) and bool(git("status", "--porcelain", "--untracked-files=no", cwd=folder).stdout)
        return Tree(side, spec, "dir", commit, folder.resolve(), dirty)
    if repo is None:
        raise UsageError(
            f"--{side} {spec}: no such directory, and no git repository here to find it as a ref in; "
            "valid: a branch, tag or commit of this repository, or a directory holding a distbench tree"
        )
    found = git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}", cwd=repo)
    if found.returncode != 0 or not found.stdout.strip():
        raise UsageError(
            f"--{side} {spec}: not a directory, nor a commit of the git repository {repo}; "
            "valid: a branch, tag or commit, or a directory holding a distbench tree"
        )
    return Tree(side, spec, "ref", found.stdout.strip())


@contextmanager
def checked_out(trees: list[Tree], repo: Path | None) -> Iterator[None]:
    """Each ref tree checked out (`git worktree add --detach`) into one temporary folder, both sides sharing
    one worktree when they are the same commit; removed on the way out, interrupted or not. The
    repository's `.venvs` (per-stack environments, untracked) is linked into each, so a worktree's runs pick
    the same worker interpreters as the repository's own would."""
    refs = [t for t in trees if t.kind == "ref"]
    if not refs:
        yield
        return
    assert repo is not None
    root = Path(tempfile.mkdtemp(prefix="distbench-gate-"))
    made: dict[str, Path] = {}
    try:
        for tree in refs:
            if tree.commit not in made:
                path = root / tree.side
                added = git("worktree", "add", "--detach", str(path), str(tree.commit), cwd=repo)
                if added.returncode != 0:
                    raise UsageError(
                        f"--{tree.side} {tree.spec}: git worktree add failed: "
                        f"{(added.stderr.strip().splitlines() or ['?'])[-1]}"
                    )
                if (repo / ".venvs").is_dir() and not (path / ".venvs").exists():
                    (path / ".venvs").symlink_to(repo / ".venvs")
                made[str(tree.commit)] = path
            tree.path = made[str(tree.commit)]
        yield
    finally:
        for path in made.values():
            git("worktree", "remove", "--force", str(path), cwd=repo)
        shutil.rmtree(root, ignore_errors=True)
        git("worktree", "prune", cwd=repo)


def harness_command(tree: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", BOOTSTRAP, str(tree), *args]


def last_line(text: str) -> str:
    """What a harness's output says went wrong: its last error line (without the prefix, which the gate's
    own line carries), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [
        line.removeprefix("harness: error:").strip() for line in lines if line.startswith("harness: error:")
    ]
    return (errors or lines or ["(no output)"])[-1]


def probe_tree(tree: Tree, run_args: list[str]) -> None:
    """Before anything launches: the tree's own harness is the one imported, and it takes the run
    arguments (`harness plan ARGS`, its dry run, validates them; a tree without `plan` is asked for
    `harness run --help` and must list every flag). Raises UsageError, one line."""
    assert tree.path is not None
    name = f"--{tree.side} {tree.spec}"
    found = subprocess.run(
        [sys.executable, "-c", PROBE, str(tree.path)], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
    imported = Path(found.stdout.strip()).resolve() if found.returncode == 0 else None
    if imported is None or tree.path.resolve() not in imported.parents:
        raise UsageError(
            f"{name}: its harness package is not the one imported "
            f"({imported or last_line(found.stderr)}); expected one under {tree.path}"
        )
    plan = subprocess.run(
        harness_command(tree.path, "plan", *run_args), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
    if plan.returncode == 0:
        return
    if "invalid choice: 'plan'" not in plan.stderr:
        raise UsageError(f"{name}: its harness refuses the run arguments: {last_line(plan.stderr)}")
    helped = subprocess.run(
        harness_command(tree.path, "run", "--help"), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
    if helped.returncode != 0:
        raise UsageError(
            f"{name}: its harness is too old to gate (no `harness run`): {last_line(helped.stderr)}"
        )
    missing = [
        a.split("=")[0] for a in run_args if a.startswith("--") and a.split("=")[0] not in helped.stdout
    ]
    if missing:
        raise UsageError(f"{name}: its harness is too old: `harness run` does not take {', '.join(missing)}")


# ---- one run, one pair ---------------------------------------------------------------------------------


@dataclass
class RunOutcome:
    """One `harness run` of one side: its exit code, its record (trimmed, as compare reads it) and, for a
    failed run, one line saying why."""

    returncode: int
    record: dict | None
    path: Path | None
    message: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.record is not None and self.record["status"] == "ok"


Runner = Callable[[str, int], RunOutcome]  # (side, pair index) -> outcome


def wait_for(proc: subprocess.Popen) -> int:
    """Wait for a run, passing on a SIGTERM the gate got; on Ctrl-C (which the run got too) give it time
    to write its record, then stop it."""
    told = False
    try:
        while True:
            try:
                return proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                if stopped() and not told:
                    proc.send_signal(signal.SIGTERM)
                    told = True
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def launch_run(
    tree: Tree, args: list[str], out: Path, log: Path, place: Placement | None = None
) -> RunOutcome:
    """`harness run ARGS --out OUT` from the tree's own harness; its output goes to `log`. `place`: the
    devices or cores of a duet run's half."""
    assert tree.path is not None
    out.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.json"))
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            (place.prefix if place else []) + harness_command(tree.path, "run", *args, "--out", str(out)),
            env={**os.environ, **place.env} if place else None,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        code = wait_for(proc)
    took = time.monotonic() - start
    new = sorted(set(out.glob("*.json")) - before)
    if code == EXIT_USAGE and not new:
        return RunOutcome(code, None, None, last_line(log.read_text(errors="replace")), took)
    if len(new) != 1:
        return RunOutcome(code or EXIT_FAILED, None, None, f"no record ({last_line(log.read_text())})", took)
    try:
        (record,) = load_all(new)
    except InputError as exc:
        raise UsageError(f"--{tree.side}: cannot read its run's record: {exc}") from None
    commit = ((record.get("environment") or {}).get("git") or {}).get("commit")
    if tree.kind == "ref" and commit and commit != tree.commit:  # a directory's commit may move meanwhile
        raise UsageError(
            f"--{tree.side} {tree.spec}: its run reports commit {commit[:10]}, not the tree's "
            f"{str(tree.commit)[:10]}: another harness than the tree's was imported"
        )
    message = (
        "" if record["status"] == "ok" else ((record.get("error") or {}).get("message") or record["status"])
    )
    return RunOutcome(code, record, new[0], message, took)


@dataclass(frozen=True)
class Placement:
    """Where one duet run goes: its half of the GPUs (CUDA_VISIBLE_DEVICES) or of the cores (taskset)."""

    half: tuple[str, ...]
    env: dict = field(default_factory=dict)
    prefix: list = field(default_factory=list)


@dataclass(frozen=True)
class Duet:
    """Duet benchmarking (Bulej et al., ICPE 2020): base and head run at the same time, each on its own
    half of the node, so whatever disturbs the node in that minute disturbs both runs of the pair; the
    halves swap every pair, so a difference between the halves themselves cancels over pairs."""

    kind: str  # "cuda" | "cpu"
    halves: tuple[tuple[str, ...], tuple[str, ...]]

    def placement(self, side: str, pair: int) -> Placement:
        half = self.halves[(pair + SIDES.index(side)) % 2]
        if self.kind == "cuda":
            return Placement(half, env={"CUDA_VISIBLE_DEVICES": ",".join(half)})
        return Placement(half, prefix=["taskset", "--cpu-list", ",".join(half)])

    def to_dict(self) -> dict:
        return {"kind": self.kind, "halves": [list(h) for h in self.halves]}


def plan_duet(device: str, ranks: int, threads: int | None, nodes: int) -> Duet:
    """The two halves of this node for `ranks` ranks a side: on GPUs, 2 x ranks of the visible ones; on a
    CPU, 2 x ranks x threads of the cores this process may run on, pinned with taskset. UsageError (one
    line) where the node has no room for both sides."""
    if nodes > 1:
        raise UsageError("--duet runs both sides on one node: it takes no --nodes")
    if device == "cuda":
        ids = visible_mask() or [str(i) for i in range(len(query_gpus()))]
        if len(ids) < 2 * ranks:
            raise UsageError(
                f"--duet needs 2 x {ranks} GPUs (one half a side); {len(ids)} visible: "
                f"use --gpus <= {len(ids) // 2} or leave out --duet"
            )
        return Duet("cuda", (tuple(ids[:ranks]), tuple(ids[ranks : 2 * ranks])))
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_side = ranks * (threads or 1)
    if len(cores) < 2 * per_side or not shutil.which("taskset"):
        raise UsageError(
            f"--duet on a CPU needs 2 x {per_side} cores (ranks x threads a side) and taskset; "
            f"{len(cores)} here{'' if shutil.which('taskset') else ', no taskset'}: leave out --duet"
        )
    half = len(cores) // 2
    return Duet("cpu", (tuple(map(str, cores[:half])), tuple(map(str, cores[half : 2 * half]))))


def order_of(seed: int, pair: int) -> tuple[str, str]:
    """Which side runs first in pair `pair`: a coin flip of a generator seeded by (seed, pair), so a resumed
    gate draws the orders the uninterrupted one would have."""
    return SIDES if np.random.default_rng([seed, pair]).random() < 0.5 else SIDES[::-1]


# ---- the gate -----------------------------------------------------------------------------------------


@dataclass
class Settings:
    design: Design
    statistic: str = DEFAULT_STATISTIC
    memory_threshold: float = DEFAULT_MEMORY_THRESHOLD
    max_minutes: float | None = DEFAULT_MAX_MINUTES
    inconclusive_exit: int = EXIT_INCONCLUSIVE
    order_seed: int | None = None  # None: drawn for a new gate, the recorded one on resume
    duet: Duet | None = None  # both sides of a pair at once, each on its half of the node
    match: dict = field(default_factory=dict)  # what identifies the experiment (gate.json), checked on resume


def per_run(record: dict, statistic: str) -> float:
    return float(STATISTICS[statistic](record["step_times_s"]))


def where(run: RunOutcome, out: Path) -> str | None:
    """A run's record, relative to --out (the folder can move between an interruption and the resume)."""
    return os.path.relpath(run.path, out) if run.path is not None else None


def paired_run(run: RunOutcome, out: Path, statistic: str) -> dict:
    """What pairs.jsonl keeps of one ok run of a pair: the gated statistic, and the median of its steps'
    process CPU time (None where the run did not measure it), the companion."""
    assert run.record is not None and run.path is not None
    cpu = run.record.get("step_cpu_times_s") or []
    return {
        "record": where(run, out),
        "statistic": per_run(run.record, statistic),
        "cpu_median_s": float(np.median(cpu)) if cpu else None,
        "steps": len(run.record["step_times_s"]),
        "seconds": run.seconds,
    }


def read_pairs(out: Path) -> list[dict]:
    path = out / PAIRS_FILE
    if not path.is_file():
        return []
    pairs = []
    for k, line in enumerate(path.read_text().splitlines(), 1):
        try:
            pair = json.loads(line)
            if not (math.isfinite(pair["log_ratio"]) and pair["base"]["record"] and pair["head"]["record"]):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise UsageError(
                f"{path}: line {k} is not a recorded pair; move the file away to start over"
            ) from None
        pairs.append(pair)
    return pairs


def write_lines(path: Path, rows: list[dict]) -> None:
    write_atomic(
        path, lambda tmp: tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    )


def check_config(out: Path, settings: Settings) -> int:
    """A fresh --out gets gate.json; one holding another experiment (or another --order-seed) is refused.
    Returns the order seed: the one given, else a new one, else (resuming) the recorded one."""
    path = out / CONFIG_FILE
    if not path.is_file():
        if (out / PAIRS_FILE).is_file():
            raise UsageError(f"--out {out}: holds {PAIRS_FILE} but no {CONFIG_FILE}; give another --out")
        seed = settings.order_seed if settings.order_seed is not None else secrets.randbelow(2**31)
        write_json_atomic(path, {"match": settings.match, "order_seed": seed, "created": now_iso()})
        return seed
    try:
        recorded = json.loads(path.read_text())
        match, seed = recorded["match"], int(recorded["order_seed"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"--out {out}: {CONFIG_FILE} is unreadable; give another --out") from None
    mine = json.loads(json.dumps(settings.match, sort_keys=True, default=str))
    if differs := first_difference(match, mine):
        raise UsageError(
            f"--out {out} holds the pairs of another gate ({differs}); give another --out, or the same "
            "arguments to resume"
        )
    if settings.order_seed is not None and settings.order_seed != seed:
        raise UsageError(
            f"--out {out}: its pairs were ordered with --order-seed {seed}, not {settings.order_seed}; "
            "give another --out, or drop --order-seed to resume"
        )
    return seed


def first_difference(there, here, name: str = "") -> str | None:
    """'key.sub: X there, Y here' for the first setting that differs, or None."""
    if isinstance(there, dict) and isinstance(here, dict):
        for key in sorted(set(there) | set(here)):
            if found := first_difference(there.get(key), here.get(key), f"{name}.{key}" if name else key):
                return found
        return None
    return None if there == here else f"{name}: {json.dumps(there)} there, {json.dumps(here)} here"


def fmt_change(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def fmt_interval(interval) -> str:
    return "" if not interval else f" [{interval[0]:+.1%}, {interval[1]:+.1%}]"


def progress(k: int, design: Design, pair: dict, decision: Decision) -> str:
    order = pair["order"][0]
    b, h = pair["base"]["statistic"], pair["head"]["statistic"]
    return (
        f"pair {k + 1}/{design.max_pairs} ({order} first): base {b * 1e3:.1f} ms, head {h * 1e3:.1f} ms, "
        f"{math.expm1(pair['log_ratio']):+.1%}; so far {fmt_change(decision.change)}"
        f"{fmt_interval(decision.interval)} ({pair['seconds']:.0f} s)"
    )


def summary_value(record: dict, path: tuple[str, ...]):
    value = record.get("summary") or {}
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def exact_changes(base: list[dict], head: list[dict]) -> list[dict]:
    """Each exact metric both sides measured: unchanged, changed (grew: a regression) or not deterministic
    within a side (reported, not gated)."""
    out = []
    for label, path in EXACT_METRICS:
        vb = [v for r in base if (v := summary_value(r, path)) is not None]
        vh = [v for r in head if (v := summary_value(r, path)) is not None]
        if not vb or not vh:
            continue
        if len(set(vb)) > 1 or len(set(vh)) > 1:
            spread = "; ".join(
                f"{s}: {', '.join(f'{v:,.0f}' for v in sorted(set(vs)))}"
                for s, vs in (("base", vb), ("head", vh))
            )
            out.append(
                {
                    "metric": label,
                    "verdict": "varies",
                    "line": f"{label} varies within a side ({spread}): not gated",
                }
            )
            continue
        b, h = vb[0], vh[0]
        if b == h:
            out.append(
                {
                    "metric": label,
                    "verdict": "unchanged",
                    "base": b,
                    "head": h,
                    "line": f"{label}: unchanged ({b:,.0f})",
                }
            )
            continue
        change = f" ({h / b - 1:+.1%})" if b else ""
        out.append(
            {
                "metric": label,
                "verdict": "regression" if h > b else "changed",
                "base": b,
                "head": h,
                "line": f"{label} changed: {b:,.0f} -> {h:,.0f}{change}",
            }
        )
    return out


def memory_lines(base: list[dict], head: list[dict], threshold: float) -> list[dict]:
    """Peak memory per rank, by harness compare's rule (median per side, relative growth over the
    threshold)."""
    field_name, label = memory_field(base + head)
    m = compare_memory(base, head, field_name, label, threshold)
    if m["change"] is None:
        return []
    m["line"] = (
        f"{label}: {fmt_bytes(m['baseline'])} -> {fmt_bytes(m['candidate'])} ({m['change']:+.1%}; "
        f"threshold {threshold:.0%}): {m['verdict']}"
    )
    return [m]


@dataclass
class Outcome:
    verdict: str  # REGRESSION | NO REGRESSION | INCONCLUSIVE (capitals), or "ERROR"
    exit_code: int
    line: str
    decision: Decision | None = None
    details: list[dict] = field(default_factory=list)


def load_recorded(out: Path, pairs: list[dict], side: str, cache: dict[str, dict]) -> list[dict]:
    runs = []
    for pair in pairs:
        rel = pair[side]["record"]
        if rel not in cache:
            try:
                (cache[rel],) = load_all([out / rel])
            except (InputError, ValueError):
                continue  # a record moved away: the pair's statistic is recorded, the exact metrics are not
        runs.append(cache[rel])
    return runs


def run_gate(settings: Settings, out: Path, runner: Runner, say=print, clock=time.monotonic) -> Outcome:
    """Pairs until the design decides or the budget runs out, resuming from those recorded in `out`; the
    verdict also goes to out/verdict.json."""
    design = settings.design
    out.mkdir(parents=True, exist_ok=True)
    seed = check_config(out, settings)
    pairs = read_pairs(out)
    cache: dict[str, dict] = {}
    say(f"order seed {seed}; runs, pairs and verdict in {out}")
    if pairs:
        say(f"resuming from {len(pairs)} pair(s) recorded in {out}")
    budget_s = settings.max_minutes * 60 if settings.max_minutes else math.inf
    outcome: Outcome | None = None
    while True:
        spent = sum(p["seconds"] for p in pairs)
        per_pair = spent / len(pairs) if pairs else 0.0
        exhausted = spent + per_pair > budget_s
        decision = decide([p["log_ratio"] for p in pairs], design, exhausted=exhausted)
        if decision.verdict != CONTINUE:
            break
        k = len(pairs)
        order = order_of(seed, k)
        start = clock()
        runs: dict[str, RunOutcome] = {}
        if settings.duet:  # both at once, each on its half; a SIGTERM reaches both through wait_for
            with ThreadPoolExecutor(max_workers=2) as both:
                started = {side: both.submit(runner, side, k) for side in order}
                runs = {side: started[side].result() for side in order}
        else:
            for side in order:
                if not stopped():
                    runs[side] = runner(side, k)
        took = clock() - start
        if why := stopped():  # a run it stopped is no evidence either way: the pair is run again on resume
            say(f"gate: stopped by {why}; {len(pairs)} pair(s) recorded in {out}: the same command resumes")
            raise KeyboardInterrupt
        for side in order:
            if runs[side].returncode == EXIT_USAGE and runs[side].record is None:
                raise UsageError(f"--{side}: its harness refused the run: {runs[side].message}")
        if not (runs["base"].ok and runs["head"].ok):
            outcome = failed_pair(out, k, order, runs)
            break
        pair = {
            "pair": k,
            "order": list(order),
            "seconds": took,
            "finished": now_iso(),
            **(
                {"duet": {side: list(settings.duet.placement(side, k).half) for side in SIDES}}
                if settings.duet
                else {}
            ),
            **{side: paired_run(runs[side], out, settings.statistic) for side in SIDES},
        }
        pair["log_ratio"] = math.log(pair["head"]["statistic"] / pair["base"]["statistic"])
        cache.update({pair[side]["record"]: runs[side].record for side in SIDES if runs[side].record})
        pairs.append(pair)
        write_lines(out / PAIRS_FILE, pairs)
        say(progress(k, design, pair, decide([p["log_ratio"] for p in pairs], design)))
    minutes = sum(p["seconds"] for p in pairs) / 60
    if outcome is None:
        used = pairs[: decision.pairs]
        base = load_recorded(out, used, "base", cache)
        head = load_recorded(out, used, "head", cache)
        details = exact_changes(base, head) + (
            memory_lines(base, head, settings.memory_threshold) if base and head else []
        )
        cpu = cpu_companion(used, design)
        if cpu is not None:
            details.append(
                {
                    "metric": "CPU time per step",
                    "verdict": "companion",
                    **cpu,
                    "line": f"CPU time per step (companion, not gated): {fmt_change(cpu['change'])}"
                    f"{fmt_interval(cpu['interval'])}",
                }
            )
        outcome = verdict_of(decision, details, settings, minutes)
    outcome_json = {
        "verdict": outcome.verdict,
        "exit_code": outcome.exit_code,
        "line": outcome.line,
        "step_time": None
        if outcome.decision is None
        else {**outcome.decision.to_dict(), "statistic": settings.statistic, "threshold": design.threshold},
        "pairs_run": len(pairs),
        # the spread that sets what a gate on this machine costs (docs/ci-gate.md: a budget for a runner)
        "log_ratio_sd": float(np.std([p["log_ratio"] for p in pairs], ddof=1)) if len(pairs) > 1 else None,
        "minutes": minutes,
        "details": outcome.details,
        "design": design.to_dict(),
        "order_seed": seed,
        "match": settings.match,
        "finished": now_iso(),
    }
    write_json_atomic(out / VERDICT_FILE, outcome_json)
    write_atomic(out / VERDICT_MARKDOWN, lambda tmp: tmp.write_text(verdict_markdown(outcome_json)))
    return outcome


def verdict_markdown(verdict: dict) -> str:
    """The verdict as a pull-request comment or job summary shows it: the verdict, the step time's change
    with its repeated interval, the pairs and minutes spent, what those pairs could detect, and the exact
    and memory metrics."""
    step = verdict.get("step_time") or {}
    design = verdict["design"]
    rows = [
        (
            "step time, head against base",
            f"{fmt_change(step.get('change'))}{fmt_interval(step.get('interval'))}",
        ),
        ("interval", f"repeated {step['interval_coverage']:.0%}, valid at every look" if step else "n/a"),
        (
            "threshold",
            f"a slowdown of {design['threshold']:.0%} ({step.get('statistic', 'median')} step a run)",
        ),
        ("pairs", f"{verdict['pairs_run']} of at most {design['max_pairs']} ({verdict['minutes']:.1f} min)"),
        (
            "smallest slowdown these pairs detect",
            "n/a"
            if step.get("detectable") is None
            else f"{step['detectable']:.1%} (power {1 - design['beta']:.0%})",
        ),
        ("order seed", str(verdict["order_seed"])),
    ]
    lines = [f"### distbench gate: {verdict['verdict']}", "", verdict["line"], "", "| | |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += [f"| {d['metric']} | {d['line']} |" for d in verdict["details"]]
    return "\n".join(lines) + "\n"


def failed_pair(out: Path, k: int, order: tuple[str, str], runs: dict[str, RunOutcome]) -> Outcome:
    """A pair with a failed run ends the gate: a head failing where the base ran is a regression (as in
    compare); a base failing (alone or with the head) leaves nothing to gate against."""
    rows = read_failures(out)
    rows.append(
        {
            "pair": k,
            "order": list(order),
            "finished": now_iso(),
            **{
                side: {
                    "ok": runs[side].ok,
                    "returncode": runs[side].returncode,
                    "record": where(runs[side], out),
                    "message": runs[side].message,
                }
                for side in SIDES
            },
        }
    )
    write_lines(out / FAILURES_FILE, rows)
    b, h = runs["base"], runs["head"]
    if b.ok:
        return Outcome(
            "REGRESSION", EXIT_FAILED, f"REGRESSION: a head run failed where the base ran: {h.message}"
        )
    if h.ok:
        line = f"harness: error: a base run failed where the head ran ({b.message}): nothing to gate against"
    else:
        line = f"harness: error: runs failed on both sides (base: {b.message}; head: {h.message})"
    return Outcome("ERROR", EXIT_USAGE, line)


def read_failures(out: Path) -> list[dict]:
    path = out / FAILURES_FILE
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def cpu_companion(pairs: list[dict], design: Design) -> dict | None:
    """The head's process CPU time per step against the base's, over the pairs that measured it on both
    sides: its change and repeated interval, as the step time's are read. Reported, never gated: CPU time
    is blind to waiting (a slower collective or a stall adds step time and no CPU time), but where the
    step time moves and the CPU time does not, the change is in waiting, not in work."""
    x = [
        math.log(p["head"]["cpu_median_s"] / p["base"]["cpu_median_s"])
        for p in pairs
        if (p["head"].get("cpu_median_s") or 0) > 0 and (p["base"].get("cpu_median_s") or 0) > 0
    ]
    if len(x) < 2:
        return None
    change, interval, _ = estimate(np.asarray(x), design)
    return {"change": change, "interval": list(interval) if interval else None, "pairs": len(x)}


def verdict_of(decision: Decision, details: list[dict], settings: Settings, minutes: float) -> Outcome:
    design = settings.design
    spent = f"{decision.pairs} pair(s), {minutes:.1f} min"
    step = f"step time {fmt_change(decision.change)}{fmt_interval(decision.interval)}"
    grew = [d for d in details if d["verdict"] == "regression"]
    if decision.verdict == REGRESSION or grew:
        reasons = (
            [f"{step} (repeated {decision.coverage:.0%} interval)"] if decision.verdict == REGRESSION else []
        )
        reasons += [d["line"] for d in grew]
        return Outcome(
            "REGRESSION", EXIT_FAILED, f"REGRESSION: {'; '.join(reasons)} ({spent})", decision, details
        )
    if decision.verdict == NO_REGRESSION:
        return Outcome(
            "NO REGRESSION",
            EXIT_OK,
            f"NO REGRESSION: {step} rules out a slowdown of {design.threshold:.0%} or more ({spent})",
            decision,
            details,
        )
    assert decision.verdict == INCONCLUSIVE
    which = "--max-pairs" if decision.pairs >= design.max_pairs else "--max-minutes"
    could = (
        f"these pairs could have detected a slowdown of {decision.detectable:.1%} or more"
        if decision.detectable is not None
        else "too few pairs to estimate what they could detect"
    )
    return Outcome(
        "INCONCLUSIVE",
        settings.inconclusive_exit,
        f"INCONCLUSIVE: {step} after {spent}: the budget ({which}) ran out; {could}",
        decision,
        details,
    )


# ---- command line -------------------------------------------------------------------------------------


def add_gate_options(p: argparse.ArgumentParser) -> None:
    """The gate's own options; every other option is a run argument, passed to both sides' `harness run`."""
    p.add_argument(
        "--base", required=True, metavar="REF|DIR", help="the code to gate against: a git ref or a directory"
    )
    p.add_argument(
        "--head", required=True, metavar="REF|DIR", help="the code under test: a git ref or a directory"
    )
    p.add_argument(
        "--threshold",
        type=fraction,
        default=DEFAULT_THRESHOLD,
        help="the slowdown of the step time that counts, e.g. 0.05 or 5%% "
        f"(default {DEFAULT_THRESHOLD:.0%}%)",
    )
    p.add_argument(
        "--max-pairs",
        type=pairs_budget,
        default=DEFAULT_MAX_PAIRS,
        help=f"most pairs to run, {Design().min_pairs} to {MAX_PAIRS_LIMIT}; the design is calibrated for "
        f"this many looks (default {DEFAULT_MAX_PAIRS})",
    )
    p.add_argument(
        "--max-minutes",
        type=seconds,
        default=DEFAULT_MAX_MINUTES,
        help="minutes of pairs to spend at most; no pair starts that would end past it "
        f"(default {DEFAULT_MAX_MINUTES:g})",
    )
    p.add_argument("--base-args", default="", metavar="'ARGS'", help="run arguments for the base side only")
    p.add_argument(
        "--head-args",
        default="",
        metavar="'ARGS'",
        help="run arguments for the head side only, e.g. --head-args '--step-delay 0.01' (one flag alone: "
        "--head-args=--tf32)",
    )
    p.add_argument(
        "--order-seed", type=int, help="seed of the order within each pair (default: drawn, recorded)"
    )
    p.add_argument(
        "--out", type=Path, help="where the runs and pairs go, and resume from (default: results/gate-<hash>)"
    )
    p.add_argument(
        "--statistic",
        choices=list(STATISTICS),
        default=DEFAULT_STATISTIC,
        help=f"per-run statistic of the step times (default {DEFAULT_STATISTIC}: the least noisy measured; "
        "docs/ci-gate.md)",
    )
    p.add_argument(
        "--memory-threshold",
        type=fraction,
        default=DEFAULT_MEMORY_THRESHOLD,
        help=f"relative growth of peak memory per rank that counts (default {DEFAULT_MEMORY_THRESHOLD:.0%}%)",
    )
    p.add_argument(
        "--duet",
        action="store_true",
        help="run base and head of each pair at the same time, each on its own half of the node's GPUs "
        "(or of its cores, pinned, on a CPU), the halves swapped every pair; needs room for 2 x --gpus",
    )
    p.add_argument(
        "--inconclusive-exit",
        type=exit_code,
        default=EXIT_INCONCLUSIVE,
        help=f"exit code of INCONCLUSIVE (default {EXIT_INCONCLUSIVE}; 0 lets it pass, 1 fails it)",
    )


def pairs_budget(text: str) -> int:
    """--max-pairs: from the design's first look (fewer could never decide) to MAX_PAIRS_LIMIT."""
    lowest = Design().min_pairs
    what = f"a number of pairs from {lowest} (the first look) to {MAX_PAIRS_LIMIT}"
    value = int_at_least(lowest, what)(text)
    if value > MAX_PAIRS_LIMIT:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def exit_code(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an exit code 0-125, got '{text}'") from None
    if not 0 <= value <= 125:
        raise argparse.ArgumentTypeError(f"expected an exit code 0-125, got {value}")
    return value


def split_args(text: str, flag: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"{flag} '{text}': {exc}") from None


def run_tokens(argv: list[str]) -> list[str]:
    """The run arguments as given: the command line less the gate's own options."""
    own = Parser(add_help=False, allow_abbrev=False)
    add_gate_options(own)
    for action in own._actions:
        action.required = False
    _, rest = own.parse_known_args(argv)
    return rest


def cmd_gate(args, runner: Runner | None = None) -> int:
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    tokens = run_tokens(argv[1:] if argv and argv[0] == "gate" else argv)
    side_args = {
        "base": split_args(args.base_args, "--base-args"),
        "head": split_args(args.head_args, "--head-args"),
    }
    design = Design(threshold=args.threshold, max_pairs=args.max_pairs)
    duet = None
    if args.duet:
        device = args.device if args.device != "auto" else ("cuda" if visible_gpus() else "cpu")
        ranks = args.gpus_per_node or args.gpus or 1
        duet = plan_duet(device, ranks, args.threads_per_worker, args.nodes or 1)
    repo = repository()
    trees = {"base": resolve_tree("base", args.base, repo), "head": resolve_tree("head", args.head, repo)}
    match = {
        "base": trees["base"].describe(),
        "head": trees["head"].describe(),
        "run_args": tokens,
        "base_args": side_args["base"],
        "head_args": side_args["head"],
        "statistic": args.statistic,
        "design": design.to_dict(),
        **({"duet": duet.to_dict()} if duet else {}),
    }
    digest = hashlib.sha256(json.dumps(match, sort_keys=True).encode()).hexdigest()[:10]
    out = Path(args.out) if args.out else Path("results") / f"gate-{digest}"
    settings = Settings(
        design,
        args.statistic,
        args.memory_threshold,
        args.max_minutes,
        args.inconclusive_exit,
        args.order_seed,
        match=match,
        duet=duet,
    )
    with checked_out(list(trees.values()), repo):
        if runner is None:
            for side in SIDES:
                probe_tree(trees[side], tokens + side_args[side])

            def runner(side: str, k: int) -> RunOutcome:
                return launch_run(
                    trees[side],
                    tokens + side_args[side],
                    out / side,
                    out / "logs" / f"pair-{k:03d}-{side}.log",
                    duet.placement(side, k) if duet else None,
                )

        p_alpha, _ = design.levels
        print(
            f"gate: base {trees['base'].text()} vs head {trees['head'].text()}; a slowdown of "
            f"{design.threshold:.0%} or more in the per-run {args.statistic} step time, "
            f"alpha {design.alpha}, beta {design.beta} (nominal level per look {p_alpha:.4f}); "
            f"at most {design.max_pairs} pairs / {args.max_minutes:g} min",
            flush=True,
        )
        if duet:
            a, b = (",".join(h) for h in duet.halves)
            print(f"duet: base and head at once, on {duet.kind} {a} and {b}, swapped every pair", flush=True)
        stop_on_sigterm()
        try:
            outcome = run_gate(settings, out, runner, say=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            print(
                f"gate: interrupted; the pairs recorded in {out} stay: the same command resumes", flush=True
            )
            raise
    if outcome.verdict == "ERROR":
        print(outcome.line, file=sys.stderr)
        return outcome.exit_code
    for detail in outcome.details:
        print(detail["line"])
    print(outcome.line)
    return outcome.exit_code


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "gate",
        help="regression gate that runs its own experiment: base and head in pairs until it decides",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",  # the gate's --out (pairs and records) replaces the run's
        allow_abbrev=False,
    )
    p.add_argument("--backend", required=True, help="run argument: the backend both sides run")
    p.add_argument("--gpus", type=int_at_least(1, "a positive integer"), help="run argument: ranks in all")
    add_run_arguments(p)
    add_gate_options(p)
    p.set_defaults(func=cmd_gate)
