"""The nightly history on a data branch (harness.analyze.history_store), over simulated nights in a
temporary git repository: a week-long gap, a failed night, a re-run of one night, and a push that loses a
race. Nothing recorded is lost and nothing is counted twice; the default branch is never written."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import record_factory as factory
import yaml
from conftest import REPO

from core.records import write_json_atomic
from harness.analyze import history_store
from harness.analyze.baseline import load_all
from harness.analyze.history import history_rows
from harness.analyze.history_store import StoreError, append, export

pytestmark = [pytest.mark.unit, pytest.mark.subprocess]  # git
BRANCH = "distbench-history"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def clone(tmp_path) -> Path:
    """A clone of a repository whose default branch is `main`, as the nightly job's checkout is."""
    origin, seed = tmp_path / "origin.git", tmp_path / "seed"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(origin)], check=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(seed)], check=True)
    (seed / "README").write_text("project\n")
    git(seed, "add", "README")
    git(seed, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "project")
    git(seed, "push", "-q", str(origin), "main")
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(origin), str(work)], check=True)
    return work


def night_records(
    folder: Path, night: int, day: str, sha: str, status: str = "ok", runs: int = 3
) -> list[Path]:
    """The record files one night's measurement leaves: `runs` runs of torch-ddp tiny at commit `sha`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for j in range(runs):
        r = factory.make_record(
            step_time=0.1,
            status=status,
            run_id=f"n{night}-{status}-{j}",
            start_time=f"{day}T03:{j:02d}:00+00:00",
        )
        r["environment"]["git"] = {"commit": sha, "dirty": False}
        path = folder / f"{r['run_id']}.json"
        write_json_atomic(path, r)
        paths.append(path)
    return paths


def sha(i: int) -> str:
    return hashlib.sha1(f"commit {i}".encode()).hexdigest()


def on_branch(clone: Path, folder: str) -> list[str]:
    out = git(clone, "ls-tree", "--name-only", f"origin/{BRANCH}", f"{folder}/")
    return sorted(Path(line).name for line in out.split())


def test_nights_a_gap_a_failure_and_a_rerun_lose_nothing_and_count_nothing_twice(clone, tmp_path):
    main_before = git(clone, "rev-parse", "origin/main")
    made: list[Path] = []
    # Nights 1-3 on consecutive days, then a week with no night (the cache would be gone), then 4-6.
    days = ["2026-03-01", "2026-03-02", "2026-03-03", "2026-03-11", "2026-03-12", "2026-03-13"]
    for night, day in enumerate(days, start=1):
        status = "failed" if night == 5 else "ok"  # night 5: every run failed, still recorded
        files = night_records(tmp_path / f"night{night}", night, day, sha(night), status)
        done = append(clone, BRANCH, files, str(1000 + night), commit=sha(night),
                      outcome="failure" if status == "failed" else "success")  # fmt: skip
        assert sorted(done.added) == sorted(f.name for f in files) and done.commit
        made += files
    # Night 3 re-run: its first attempt appended again (a retried step) adds nothing and pushes nothing ...
    again = append(clone, BRANCH, [p for p in made if p.name.startswith("n3-")], "1003", commit=sha(3))
    assert again.added == [] and len(again.present) == 3 and again.commit is None
    # ... and its second attempt brings three more runs of the same commit, kept beside the first three.
    rerun = night_records(tmp_path / "night3b", 33, "2026-03-03", sha(3))
    done = append(clone, BRANCH, rerun, "1003", attempt="2", commit=sha(3))
    assert len(done.added) == 3
    made += rerun
    # A night whose measurement failed before any run: recorded with no records.
    assert append(clone, BRANCH, [], "1007", outcome="failure").commit
    git(clone, "fetch", "-q", "origin")
    assert git(clone, "rev-parse", "origin/main") == main_before  # the default branch is never written
    assert on_branch(clone, "records") == sorted(p.name for p in made)

    checkout = tmp_path / "data"
    assert export(clone, BRANCH, checkout) == len(made) == 21
    runs = load_all([checkout / "records"])
    assert sorted(r["run_id"] for r in runs) == sorted(p.stem for p in made)  # each once
    rows = history_rows(runs, "throughput_tokens_per_s")
    assert [r["commit"] for r in rows] == [sha(i)[:10] for i in range(1, 7)]
    assert [(r["runs"], r["failed"]) for r in rows] == [(3, 0), (3, 0), (6, 0), (3, 0), (3, 3), (3, 0)]
    assert rows[4]["median"] is None  # the failed night: shown, not a point
    night3 = json.loads((checkout / "nights" / "1003.json").read_text())
    assert [(a["attempt"], len(a["records"])) for a in night3["attempts"]] == [("1", 3), ("2", 3)]
    night7 = json.loads((checkout / "nights" / "1007.json").read_text())
    assert [(a["outcome"], a["records"]) for a in night7["attempts"]] == [("failure", [])]
    assert len(list((checkout / "nights").glob("*.json"))) == 7


def test_a_record_name_is_written_once(clone, tmp_path):
    (path,) = night_records(tmp_path / "a", 1, "2026-03-01", sha(1), runs=1)
    append(clone, BRANCH, [path], "1")
    record = json.loads(path.read_text())
    write_json_atomic(path, {**record, "status": "failed"})  # the same name, other content
    done = append(clone, BRANCH, [path], "2")
    assert done.kept == [path.name] and done.added == []
    kept = git(clone, "show", f"origin/{BRANCH}:records/{path.name}")
    assert json.loads(kept)["status"] == "ok"


def test_a_push_that_loses_a_race_is_rebuilt_on_the_new_tip(clone, tmp_path, monkeypatch):
    other = tmp_path / "other"
    subprocess.run(["git", "clone", "-q", git(clone, "remote", "get-url", "origin").strip(), str(other)],
                   check=True)  # fmt: skip
    first = night_records(tmp_path / "a", 1, "2026-03-01", sha(1))
    second = night_records(tmp_path / "b", 2, "2026-03-02", sha(2))
    build, raced = history_store.build_commit, []

    def racing(repo, tip, *args):
        if not raced:  # another run appends between this one's fetch and its push
            raced.append(other)
            append(other, BRANCH, second, "2")
        return build(repo, tip, *args)

    monkeypatch.setattr(history_store, "build_commit", racing)
    done = append(clone, BRANCH, first, "1")
    assert raced and done.commit and len(done.added) == 3
    git(clone, "fetch", "-q", "origin")
    assert on_branch(clone, "records") == sorted(p.name for p in first + second)
    assert on_branch(clone, "nights") == ["1.json", "2.json"]


def test_the_default_branch_and_bad_names_are_refused(clone, tmp_path):
    files = night_records(tmp_path / "a", 1, "2026-03-01", sha(1), runs=1)
    with pytest.raises(StoreError, match="'main' is the default branch"):
        append(clone, "main", files, "1")
    with pytest.raises(StoreError, match="not a branch name"):
        append(clone, "bad..name", files, "1")
    with pytest.raises(StoreError, match="not a night's name"):
        append(clone, BRANCH, files, "../x")
    assert git(clone, "ls-remote", "--heads", "origin").count("refs/heads/") == 1


def test_the_command_line_appends_and_exports(clone, tmp_path, capsys):
    folder = tmp_path / "tonight"
    night_records(folder, 1, "2026-03-01", sha(1))
    argv = ["--repo", str(clone), "--branch", BRANCH]
    assert history_store.main(["append", *argv, "--night", "42", "--commit", sha(1), str(folder)]) == 0
    assert "3 record(s) added, 0 already there; pushed" in capsys.readouterr().out
    assert history_store.main(["append", *argv, "--night", "42", str(folder)]) == 0
    assert "0 record(s) added, 3 already there; nothing new to push" in capsys.readouterr().out
    assert history_store.main(["export", *argv, "--into", str(tmp_path / "data")]) == 0
    assert "3 record(s)" in capsys.readouterr().out
    # No data branch yet: an empty history, not an error.
    assert export(clone, "no-such-branch", tmp_path / "empty") == 0
    assert history_store.main(["append", "--repo", str(clone), "--branch", "main", "--night", "1"]) == 2
    assert "is the default branch" in capsys.readouterr().err


def test_the_nightly_workflow_s_own_append_command_runs(clone, tmp_path, capsys, monkeypatch):
    """The command the workflow's `record` job runs, its variables filled in, against a clone."""
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "distbench-nightly.yml").read_text())
    (writer,) = [
        j for j in workflow["jobs"].values() if (j.get("permissions") or {}).get("contents") == "write"
    ]
    script = next(s["run"] for s in writer["steps"] if "history_store" in s.get("run", ""))
    line = script.replace("\\\n", " ").split("python -m harness.analyze.history_store", 1)[1].split("|")[0]
    night_records(tmp_path / "tonight", 1, "2026-03-01", sha(1))
    values = {"DATA_BRANCH": workflow["env"]["DATA_BRANCH"], "NIGHT": "77", "ATTEMPT": "1", "COMMIT": sha(1),
              "OUTCOME": "success", "RUNNER_TEMP": str(tmp_path)}  # fmt: skip
    for name, text in values.items():
        monkeypatch.setenv(name, text)
    argv = shlex.split(os.path.expandvars(line))
    assert history_store.main([argv[0], "--repo", str(clone), *argv[1:]]) == 0
    assert "night 77 attempt 1 (success): 3 record(s) added" in capsys.readouterr().out
    assert git(clone, "ls-remote", "--heads", "origin", values["DATA_BRANCH"]).strip()


def test_the_nightly_s_one_writing_job_installs_nothing_and_nights_do_not_interleave():
    """What the workflow's header promises of the job that holds `contents: write`, held to it: it is the
    only job that writes, it asks for that scope alone, and it installs and runs nothing but the store
    (no pip, no benchmark, only the checkout, Python and the artifact among actions); and one night's run
    waits for another's rather than interleaving."""
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "distbench-nightly.yml").read_text())
    assert workflow["permissions"] == {}
    assert workflow["concurrency"]["group"] and workflow["concurrency"]["cancel-in-progress"] is False
    writers = {
        name: job["permissions"]
        for name, job in workflow["jobs"].items()
        if "write" in (job.get("permissions") or {}).values()
    }
    assert writers == {"record": {"contents": "write"}}
    steps = workflow["jobs"]["record"]["steps"]
    actions = {s["uses"].split("@")[0] for s in steps if "uses" in s}
    assert actions == {"actions/checkout", "actions/setup-python", "actions/download-artifact"}
    scripts = "\n".join(s.get("run", "") for s in steps)
    assert not re.search(r"\bpip\b|harness run|-m harness ", scripts)
    assert scripts.count("python -m harness.analyze.history_store append") == 1
    assert all(
        s["with"]["persist-credentials"] is False
        for s in steps
        if s.get("uses", "").startswith("actions/checkout")
    )
