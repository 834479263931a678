"""One `harness run` of one side of a pair, and duet placement: both sides of a pair at once, each on its
own half of the node."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.records import RecordError
from harness.analyze.baseline import trim
from harness.gate.trees import SIDES, Tree
from harness.run.child import run_child
from harness.run.devices import query_gpus, visible_mask
from harness.usage import EXIT_FAILED, EXIT_USAGE, UsageError


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


def launch_run(
    tree: Tree, args: list[str], out: Path, log: Path, place: Placement | None = None
) -> RunOutcome:
    """`harness run ARGS --out OUT` from the tree's own harness (harness.run.child: a SIGTERM the gate got
    is passed on, a Ctrl-C leaves the run time to write its record); its output goes to `log`. `place`: the
    devices or cores of a duet run's half."""
    assert tree.path is not None
    try:
        done = run_child(
            ["run", *args],
            out,
            tree=tree.path,
            log=log,
            env=place.env if place else None,
            prefix=place.prefix if place else (),
        )
    except RecordError as exc:
        raise UsageError(f"--{tree.side}: cannot read its run's record: {exc}") from None
    if done.record is None:
        if done.returncode == EXIT_USAGE:  # the harness refused the arguments
            return RunOutcome(done.returncode, None, None, done.why, done.seconds)
        return RunOutcome(done.returncode or EXIT_FAILED, None, None, f"no record ({done.why})", done.seconds)
    record = trim(done.record)
    commit = ((record.get("environment") or {}).get("git") or {}).get("commit")
    if tree.kind == "ref" and commit and commit != tree.commit:  # a directory's commit may move meanwhile
        raise UsageError(
            f"--{tree.side} {tree.spec}: its run reports commit {commit[:10]}, not the tree's "
            f"{str(tree.commit)[:10]}: another harness than the tree's was imported"
        )
    return RunOutcome(done.returncode, record, done.path, done.why, done.seconds)


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
