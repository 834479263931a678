"""The nightly history kept in git: every night's records appended to a data branch of the repository.

A cache is evicted when unused for a week; a branch is not. The nightly workflow
(.github/workflows/distbench-nightly.yml) appends each night's records here, and `harness history` reads
the branch's checkout. The branch holds two folders:

- `records/NAME.json`: every record, under the name the runner gave its file (the run id, unique per run).
  A name is written once: a record already on the branch is never rewritten, so running the same append
  again (a re-run of the job, a retried push) adds nothing and loses nothing.
- `nights/RUN.json`: one file per workflow run (the run id, which a re-run keeps), listing each attempt's
  outcome and the names of the records it brought; a night whose measurement failed outright is recorded
  here with no records, so the page can say that it happened.

The branch is built with git's plumbing (a temporary index, `commit-tree`), never a checkout: the working
tree and the default branch are left alone, and the default branch is refused as the data branch. A push
rejected because the branch moved (another run appended first) is retried on top of the new tip; it never
forces. Only git and the standard library are used, so the job that holds the write token installs
nothing.

    python -m harness.analyze.history_store append --repo DIR --branch B --night RUN [--attempt N]
        [--commit SHA] [--outcome success|failure|...] RECORD.json...
    python -m harness.analyze.history_store export --repo DIR --branch B --into DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DATA_BRANCH = "distbench-history"
RECORDS = "records"
NIGHTS = "nights"
PUSH_TRIES = 5
# Who the data branch's commits are by: the job, not whoever configured git on the runner.
IDENTITY = {
    "GIT_AUTHOR_NAME": "distbench nightly",
    "GIT_AUTHOR_EMAIL": "distbench-nightly@users.noreply.github.com",
    "GIT_COMMITTER_NAME": "distbench nightly",
    "GIT_COMMITTER_EMAIL": "distbench-nightly@users.noreply.github.com",
}


class StoreError(Exception):
    """A data branch that cannot be written or read as asked: one line for the job's log."""


@dataclass
class Appended:
    """What one append did: the records it added, those the branch already held (by name), and the
    commit it pushed (None when there was nothing new)."""

    added: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # a name on the branch with other content: not rewritten
    commit: str | None = None


def git(repo: Path, *args: str, stdin: bytes | None = None, env: dict | None = None, check=True) -> str:
    proc = subprocess.run(
        ["git", "-C", str(repo), *args],
        input=stdin,
        capture_output=True,
        env={**os.environ, **(env or {})},
    )
    if check and proc.returncode != 0:
        raise StoreError(f"git {' '.join(args[:2])}: {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout.decode()


def default_branch(repo: Path, remote: str) -> str | None:
    """The remote's default branch (what its HEAD names), or None where the remote does not say."""
    out = git(repo, "ls-remote", "--symref", remote, "HEAD", check=False)
    for line in out.splitlines():
        if line.startswith("ref: refs/heads/") and line.endswith("\tHEAD"):
            return line.removeprefix("ref: refs/heads/").removesuffix("\tHEAD")
    return None


def check_branch(repo: Path, remote: str, branch: str) -> None:
    if (
        not branch
        or branch.startswith("-")
        or git(repo, "check-ref-format", "--branch", branch, check=False) == ""
    ):
        raise StoreError(f"'{branch}' is not a branch name")
    if branch == default_branch(repo, remote):
        raise StoreError(f"'{branch}' is the default branch: the history goes to a data branch of its own")


def fetch_tip(repo: Path, remote: str, branch: str) -> str | None:
    """The branch's commit on the remote, fetched here; None where the branch does not exist yet."""
    if not git(repo, "ls-remote", "--heads", remote, f"refs/heads/{branch}").strip():
        return None
    local = f"refs/distbench/{branch}"
    git(repo, "fetch", "--quiet", "--no-tags", remote, f"+refs/heads/{branch}:{local}")
    return git(repo, "rev-parse", local).strip()


def blob_at(repo: Path, tip: str | None, path: str) -> str | None:
    """The blob id of `path` in `tip`, None where it has none."""
    if tip is None:
        return None
    out = git(repo, "ls-tree", tip, "--", path).strip()
    return out.split()[2] if out else None


def night_entry(attempt: str, commit: str | None, outcome: str, names: list[str]) -> dict:
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    return {
        "attempt": attempt,
        "commit": commit,
        "outcome": outcome,
        "records": sorted(names),
        "recorded_at": now,
    }


def merged_night(old: dict | None, night: str, entry: dict) -> dict:
    """The night's file with this attempt's entry merged in: its records are the union of every time this
    attempt appended (an append repeated adds nothing, one that brings more keeps what was there)."""
    attempts = {a["attempt"]: a for a in (old or {}).get("attempts", [])}
    before = attempts.get(entry["attempt"])
    if before is not None:
        entry = {
            **before,
            **{k: v for k, v in entry.items() if v is not None},
            "records": sorted(set(before["records"]) | set(entry["records"])),
            "recorded_at": before.get("recorded_at", entry["recorded_at"]),
        }
    attempts[entry["attempt"]] = entry
    ordered = sorted(attempts.values(), key=lambda a: (len(str(a["attempt"])), str(a["attempt"])))
    return {"night": night, "attempts": ordered}


def build_commit(
    repo: Path, tip: str | None, files: list[Path], night: str, entry: dict, result: Appended
) -> str | None:
    """A commit on `tip` that adds the records not yet on it and the night's file; None if it adds nothing."""
    result.added, result.present, result.kept = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(repo, "read-tree", *([tip] if tip else ["--empty"]), env=env)
        for path in files:
            target = f"{RECORDS}/{path.name}"
            blob = git(repo, "hash-object", "-w", "--", str(path)).strip()
            there = blob_at(repo, tip, target)
            if there is None:
                git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{target}", env=env)
                result.added.append(path.name)
            else:
                (result.present if there == blob else result.kept).append(path.name)
        night_path = f"{NIGHTS}/{night}.json"
        there = blob_at(repo, tip, night_path)
        old = json.loads(git(repo, "cat-file", "blob", there)) if there else None
        text = json.dumps(merged_night(old, night, entry), indent=1, sort_keys=True) + "\n"
        blob = git(repo, "hash-object", "-w", "--stdin", stdin=text.encode()).strip()
        git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{night_path}", env=env)
        tree = git(repo, "write-tree", env=env).strip()
    if tip is not None and tree == git(repo, "rev-parse", f"{tip}^{{tree}}").strip():
        return None
    message = f"night {night} attempt {entry['attempt']}: {len(result.added)} record(s), {entry['outcome']}"
    return git(repo, "commit-tree", tree, *(["-p", tip] if tip else []), "-m", message, env=IDENTITY).strip()


def append(
    repo: Path,
    branch: str,
    files: list[Path],
    night: str,
    *,
    attempt: str = "1",
    commit: str | None = None,
    outcome: str = "success",
    remote: str = "origin",
    tries: int = PUSH_TRIES,
) -> Appended:
    """Add `files` (record files) and the night's entry to `branch` on `remote`, creating the branch with
    the first night. A push that loses a race is rebuilt on the new tip and tried again, never forced."""
    repo, files = Path(repo), [Path(f) for f in files]
    check_branch(repo, remote, branch)
    if not night or "/" in night or night.startswith("."):
        raise StoreError(f"'{night}' is not a night's name (the workflow's run id)")
    for f in files:
        if f.suffix != ".json" or not f.is_file():
            raise StoreError(f"{f}: not a record file")
    entry = night_entry(str(attempt), commit, outcome, [f.name for f in files])
    result = Appended()
    for _ in range(tries):
        tip = fetch_tip(repo, remote, branch)
        new = build_commit(repo, tip, files, night, entry, result)
        if new is None:
            return result
        push = subprocess.run(
            ["git", "-C", str(repo), "push", "--quiet", remote, f"{new}:refs/heads/{branch}"],
            capture_output=True,
        )
        if push.returncode == 0:
            result.commit = new
            return result
    raise StoreError(f"could not push to {branch} after {tries} tries: {push.stderr.decode().strip()}")


def export(repo: Path, branch: str, into: Path, *, remote: str = "origin") -> int:
    """The branch's files written under `into` (records/, nights/); the number of records. A branch that
    does not exist yet is an empty history, not an error."""
    into = Path(into)
    (into / RECORDS).mkdir(parents=True, exist_ok=True)
    (into / NIGHTS).mkdir(parents=True, exist_ok=True)
    tip = fetch_tip(Path(repo), remote, branch)
    if tip is None:
        return 0
    archive = subprocess.run(["git", "-C", str(repo), "archive", tip], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.split("/")[0] in (RECORDS, NIGHTS)]
        tar.extractall(into, members=members, filter="data")
    return len(list((into / RECORDS).glob("*.json")))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m harness.analyze.history_store", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="verb", required=True)
    for verb in ("append", "export"):
        s = sub.add_parser(verb)
        s.add_argument("--repo", type=Path, default=Path("."), help="a clone of the repository")
        s.add_argument("--remote", default="origin")
        s.add_argument("--branch", default=DATA_BRANCH, help=f"the data branch (default {DATA_BRANCH})")
    a = sub.choices["append"]
    a.add_argument("--night", required=True, help="the night's name: the workflow's run id")
    a.add_argument("--attempt", default="1", help="the workflow run's attempt")
    a.add_argument("--commit", help="the commit measured")
    a.add_argument("--outcome", default="success", help="how the measurement ended (the job's result)")
    a.add_argument("records", nargs="*", type=Path, help="record files (*.json); directories are searched")
    sub.choices["export"].add_argument("--into", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.verb == "export":
            n = export(args.repo, args.branch, args.into, remote=args.remote)
            print(f"{args.branch}: {n} record(s) in {args.into}")
            return 0
        files = [q for r in args.records for q in (sorted(r.glob("*.json")) if r.is_dir() else [r])]
        done = append(
            args.repo, args.branch, files, args.night,
            attempt=args.attempt, commit=args.commit, outcome=args.outcome, remote=args.remote,
        )  # fmt: skip
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.branch}: night {args.night} attempt {args.attempt} ({args.outcome}): "
        f"{len(done.added)} record(s) added, {len(done.present)} already there"
        + (f", {len(done.kept)} kept as recorded (same name, other content)" if done.kept else "")
        + (f"; pushed {done.commit[:10]}" if done.commit else "; nothing new to push")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
