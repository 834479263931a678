"""The two sides' code for `harness gate`: a git ref checked out as a temporary worktree, or a directory
taken as it is, and the probe that checks, before anything launches, that a tree's own harness is the one
imported and takes the run arguments."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from harness.run.child import harness_argv, last_line
from harness.usage import UsageError

SIDES = ("base", "head")
# A gate's ref sides are checked out under tempdir/TEMP_PREFIX*/, which holds LOCK_FILE, locked while the
# gate runs: a later gate removes the worktrees of a folder whose lock nobody holds (remove_left_behind).
TEMP_PREFIX = "distbench-gate-"
LOCK_FILE = "gate.lock"
PROBE = "import sys; sys.path.insert(0, sys.argv[1]); import harness; print(harness.__file__)"
PROBE_TIMEOUT_S = 120


def git(*args: str, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def worktrees(repo: Path) -> list[Path]:
    """The worktrees registered in `repo` (`git worktree list`), the repository's own first."""
    listed = git("worktree", "list", "--porcelain", cwd=repo)
    return [
        Path(line.removeprefix("worktree "))
        for line in listed.stdout.splitlines()
        if line.startswith("worktree ")
    ]


@dataclass
class Tree:
    """One side's code: a git ref, checked out for the gate, or a directory taken as it is."""

    side: str
    spec: str  # as given
    kind: str  # "ref" | "dir"
    commit: str | None
    path: Path | None = None  # the folder its runs import from (a ref's once checked out)
    dirty: bool = False
    changes: str | None = None  # a digest of a dirty directory's uncommitted changes to tracked files

    def describe(self) -> dict:
        """What identifies the code of this side (gate.json's, compared on resume, and in the default
        --out's name): a dirty directory's uncommitted changes too, so pairs of code since edited again are
        never resumed as this code's."""
        out = {"kind": self.kind, "spec": self.spec, "commit": self.commit}
        if self.kind == "dir":
            out["path"] = str(self.path)
        if self.changes:
            out["changes"] = self.changes
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
        changes = None
        if dirty:
            diff = git("diff", "HEAD", "--binary", cwd=folder).stdout
            changes = hashlib.sha256(diff.encode()).hexdigest()[:16]
        return Tree(side, spec, "dir", commit, folder.resolve(), dirty, changes)
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
    remove_left_behind(repo)
    root = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    lock = open(root / LOCK_FILE, "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # held while this gate runs; its process's end, however, releases it
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
        lock.close()


def remove_left_behind(repo: Path) -> None:
    """The worktrees a killed gate left registered in `repo` (a SIGKILL skips checked_out's clean-up, and
    `git worktree prune` forgets only a worktree whose folder is gone): those in a gate's temporary folder
    whose lock no running gate holds are removed with their folder, then the registrations of any folder
    gone are pruned."""
    temp = Path(tempfile.gettempdir()).resolve()
    listed = worktrees(repo)
    for root in sorted({path.parent for path in listed}):
        if root.resolve().parent != temp or not root.name.startswith(TEMP_PREFIX) or held(root / LOCK_FILE):
            continue
        for path in (p for p in listed if p.parent == root):
            git("worktree", "remove", "--force", str(path), cwd=repo)
        shutil.rmtree(root, ignore_errors=True)
    git("worktree", "prune", cwd=repo)


def held(lock: Path) -> bool:
    """Whether a running gate holds the lock file `lock` (an flock, which ends with its holder's process)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # which releases the lock where it was taken here
    return False


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
        harness_argv("plan", *run_args, tree=tree.path),
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT_S,
    )
    if plan.returncode == 0:
        return
    if "invalid choice: 'plan'" not in plan.stderr:
        raise UsageError(f"{name}: its harness refuses the run arguments: {last_line(plan.stderr)}")
    helped = subprocess.run(
        harness_argv("run", "--help", tree=tree.path), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
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
