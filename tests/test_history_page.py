"""`harness history --html PAGE`: one self-contained page of every configuration's history, on records made
by tests/record_factory.py over commits of a temporary git repository: what history meets (an older
schema, a failed night, changed arguments, two records of one commit, a rewritten branch), change points
marked, and every string from records or git inert on the page."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import record_factory as factory
from browser import CHROMIUM, headless
from conftest import REPO

from core.records import write_json_atomic
from harness.analyze import changepoints
from harness.analyze.history_page import NOT_IN_HISTORY
from harness.cli import main

pytestmark = [pytest.mark.unit, pytest.mark.subprocess]  # git

SCRIPT = "<script>document.body.setAttribute('data-pwned','yes')</script>"
needs_otava = pytest.mark.skipif(
    importlib.util.find_spec("otava") is None, reason=f"Apache Otava is not installed: {changepoints.INSTALL}"
)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def repository(path: Path, subjects: list[str]) -> list[str]:
    """A git repository with one commit per subject; their full hashes, oldest first."""
    subprocess.run(["git", "init", "-q", "-b", "main", str(path)], check=True)
    shas = []
    for i, subject in enumerate(subjects):
        (path / "file").write_text(f"{i}\n")
        git(path, "add", "file")
        git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", subject)
        shas.append(git(path, "rev-parse", "HEAD").strip())
    return shas


def run(folder: Path, sha: str, day: int, j: int = 0, *, scale: float = 1.0, status: str = "ok",
        run_id: str | None = None, micro_batch: int = 8, peak: int = 400 << 20) -> dict:  # fmt: skip
    """One run of torch-ddp tiny at `sha`, on day `day` of March, written to `folder`."""
    r = factory.make_record(
        step_time=0.1 * scale, status=status, micro_batch=micro_batch, peak_rss=peak,
        run_id=run_id or f"run-{sha[:6]}-{micro_batch}-{j}-{status}",
        start_time=f"2026-03-{day:02d}T03:{j:02d}:00+00:00",
    )  # fmt: skip
    r["environment"]["git"] = {"commit": sha, "dirty": False}
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / f"{hashlib.sha1(r['run_id'].encode()).hexdigest()[:12]}.json", r)
    return r


def page(tmp_path: Path, records: Path, repo: Path | None = None, *extra: str) -> str:
    out = tmp_path / "page.html"
    argv = ["history", str(records), "--html", str(out), "--git", str(repo or REPO), *extra]
    assert main(argv) == 0
    return out.read_text()


def section(text: str, title_part: str) -> str:
    """The HTML from the heading that contains `title_part` to the next heading of its level."""
    start = text.index(title_part)
    end = text.find("<h2>", start)
    return text[start : end if end != -1 else len(text)]


def rows(html: str) -> list[list[str]]:
    return [re.findall(r"<td>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", html) if "<td>" in tr]


@pytest.fixture
def nightly(tmp_path):
    """Eight nights of one configuration, two runs a night, the fifth night failed; one commit's subject
    and one run's id hold a script."""
    repo = tmp_path / "repo"
    shas = repository(repo, [f"change {i}" for i in range(7)] + [f"tidy {SCRIPT}"])
    records = tmp_path / "records"
    for i, sha in enumerate(shas):
        for j in range(2):
            status = "failed" if i == 4 else "ok"
            run(
                records,
                sha,
                i + 1,
                j,
                status=status,
                run_id=f"{SCRIPT}-{i}-{j}" if i == 7 and j == 0 else None,
            )
    return repo, records, shas


def test_the_page_is_self_contained_and_a_script_from_git_or_a_record_is_text(tmp_path, nightly):
    repo, records, shas = nightly
    text = page(tmp_path, records, repo)
    assert "<script" not in text.lower() and "<link" not in text.lower()
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:)?//""", text)  # nothing from the network
    assert text.count("src='data:image/png;base64,") == 1
    escaped = (
        "&lt;script&gt;document.body.setAttribute(&#x27;data-pwned&#x27;,&#x27;yes&#x27;)&lt;/script&gt;"
    )
    assert f"tidy {escaped}" in text  # the commit subject, from git
    assert f"{escaped}-7-0" in text  # the run id, from the record


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_the_page_renders_in_a_browser_with_the_script_inert(tmp_path, nightly):
    repo, records, _ = nightly
    page(tmp_path, records, repo)
    browser = headless(tmp_path / "profile")
    url = (tmp_path / "page.html").as_uri()
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert "<h1>distbench history</h1>" in dom and "<img" in dom
    assert "data-pwned" in dom  # as text ...
    assert 'data-pwned="yes"' not in dom and "<script" not in dom  # ... never run
    shot = tmp_path / "page.png"
    subprocess.run([*browser, f"--screenshot={shot}", "--window-size=1300,1800", url], capture_output=True,
                   timeout=120)  # fmt: skip
    assert shot.is_file() and shot.stat().st_size > 10_000


def test_a_failed_night_is_shown_not_a_point(tmp_path, nightly):
    repo, records, shas = nightly
    table = rows(section(page(tmp_path, records, repo), "N=1"))
    by_commit = {r[0]: r for r in table}
    failed = by_commit[shas[4][:10]]
    assert failed[1] == "change 4" and failed[3] == "2 (2)" and failed[4] == "n/a"
    assert [r[0] for r in table] == [s[:10] for s in reversed(shas)]  # newest first, every night
    assert by_commit[shas[3][:10]][3] == "2 (0)" and by_commit[shas[3][:10]][4] != "n/a"


def test_two_records_of_one_commit_are_one_row_with_their_spread(tmp_path):
    records = tmp_path / "records"
    sha = hashlib.sha1(b"one").hexdigest()
    run(records, sha, 1, 0, scale=1.0)
    run(records, sha, 1, 1, scale=1.25)
    table = rows(section(page(tmp_path, records), "N=1"))
    assert len(table) == 1 and table[0][3] == "2 (0)"
    assert table[0][1] == ""  # a repository that holds none of the commits gives no subjects
    tokens = factory.tokens_per_step(1)
    low, high = tokens / 0.125, tokens / 0.1
    assert table[0][4] == f"{np.median([low, high]):,.0f} [{low:,.0f}–{high:,.0f}] ±11.1%"


def test_a_record_that_does_not_know_its_start_is_placed_by_its_end(tmp_path):
    """`harness collect` rebuilds a record without node 0's marker with no start time (the schema allows
    null): the page and `history` place it by its end time instead of failing on it."""
    records = tmp_path / "records"
    sha = hashlib.sha1(b"one").hexdigest()
    run(records, sha, 1, 0)
    rebuilt = run(records, sha, 1, 1, run_id="rebuilt")
    rebuilt["environment"]["start_time"] = None
    write_json_atomic(records / f"{hashlib.sha1(b'rebuilt').hexdigest()[:12]}.json", rebuilt)
    table = rows(section(page(tmp_path, records), "N=1"))
    assert len(table) == 1 and table[0][3] == "2 (0)"
    assert main(["history", str(records), "--backend", "torch-ddp", "--workload", "tiny", "--gpus", "1"]) == 0


def test_changed_arguments_start_a_new_series(tmp_path):
    records = tmp_path / "records"
    shas = [hashlib.sha1(f"c{i}".encode()).hexdigest() for i in range(6)]
    for i, sha in enumerate(shas):
        # from the fourth commit the job runs a smaller micro-batch: another configuration, not a jump
        run(records, sha, i + 1, micro_batch=8 if i < 3 else 4)
    text = page(tmp_path, records)
    titles = re.findall(r"<h2>(torch-ddp[^<]*)</h2>", text)
    assert len(titles) == 2 and text.count("src='data:image/png;base64,") == 2
    first, second = (rows(section(text, t)) for t in titles)
    assert {len(first), len(second)} == {3}
    assert {r[0] for r in first} | {r[0] for r in second} == {s[:10] for s in shas}


def test_a_record_of_an_older_schema_is_on_the_page(tmp_path, nightly):
    repo, records, _ = nightly
    shutil.copy(REPO / "tests" / "data" / "schema1" / "v1-ddp-n1.json", records / "v1-ddp-n1.json")
    text = page(tmp_path, records, repo)
    found = [r for r in rows(text) if r[0] == "aaaa457478"]  # in its own configuration's table
    assert len(found) == 1 and found[0][1] == NOT_IN_HISTORY and found[0][3] == "1 (0)"
    assert found[0][6] == "20261130T080628-torch-ddp-tiny-n1-0a37f9" and found[0][4] != "n/a"


def test_commits_a_rewrite_took_out_of_the_branch_keep_their_recorded_place(tmp_path):
    repo = tmp_path / "repo"
    old = repository(repo, ["one", "two", "three"])
    records = tmp_path / "records"
    for i, sha in enumerate(old):
        run(records, sha, i + 1)
    git(repo, "reset", "-q", "--hard", old[0])  # a force-push drops two and three ...
    (repo / "file").write_text("rewritten\n")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "two, rebased")
    new = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "reflog", "expire", "--expire=now", "--all")
    run(records, new, 4)  # ... and the next night measures the rewritten one
    table = rows(section(page(tmp_path, records, repo), "N=1"))
    assert [r[0] for r in table] == [s[:10] for s in (new, old[2], old[1], old[0])]  # recorded order
    assert [r[1] for r in table] == ["two, rebased", NOT_IN_HISTORY, NOT_IN_HISTORY, "one"]


def test_a_data_branch_checkout_shows_its_nights(tmp_path, nightly):
    from harness.analyze.history_store import NIGHTS, RECORDS

    repo, records, _ = nightly
    data = tmp_path / "data"
    shutil.copytree(records, data / RECORDS)
    (data / NIGHTS).mkdir()
    attempt = {
        "attempt": "1",
        "outcome": "failure",
        "records": [],
        "commit": None,
        "recorded_at": "2026-03-09",
    }
    write_json_atomic(data / NIGHTS / "99.json", {"night": "99", "attempts": [attempt]})
    text = page(tmp_path, data, repo)
    assert rows(section(text, "Nights, newest first")) == [["99", "1", "2026-03-09", "", "failure", "0"]]


@needs_otava
def test_change_points_are_marked_and_listed_newest_first(tmp_path):
    rng = np.random.default_rng(5)
    records = tmp_path / "records"
    repo = tmp_path / "repo"
    shas = repository(repo, [f"commit {i}" for i in range(16)])
    for i, sha in enumerate(shas):
        for j in range(2):
            # throughput falls 10% at commit 8; peak memory grows 20% at commit 5
            run(records, sha, i + 1, j, scale=(1.1 if i >= 8 else 1.0) * rng.lognormal(0, 0.01),
                peak=int((400 << 20) * (1.2 if i >= 5 else 1.0)))  # fmt: skip
    text = page(tmp_path, records, repo)
    table = rows(section(text, "Change points, newest first"))
    assert [(r[2], r[3], r[4], r[5], r[9]) for r in table] == [
        ("throughput_tokens_per_s", shas[8][:10], "commit 8", shas[7][:10], "regression"),
        ("peak_rss_bytes", shas[5][:10], "commit 5", shas[4][:10], "regression"),
    ]
    assert table[0][6].startswith("-") and table[1][6] == "+20.0%"


def test_without_html_the_configuration_is_still_required(tmp_path, nightly, capsys):
    _, records, _ = nightly
    assert main(["history", str(records)]) == 2
    assert "--backend, --workload, --gpus required" in capsys.readouterr().err


def test_one_run_under_two_file_names_counts_once(tmp_path):
    records = tmp_path / "records"
    sha = hashlib.sha1(b"one").hexdigest()
    r = run(records, sha, 1)
    write_json_atomic(records / "copy-of-a-run.json", r)  # the same run id, another file
    text = page(tmp_path, records)
    assert [row[3] for row in rows(section(text, "N=1"))] == ["1 (0)"]
    assert "1 record(s), 1 configuration(s)" in text


def test_without_otava_the_page_is_written_and_says_why_no_change_points(tmp_path, nightly, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "otava.analysis", None)  # import raises ImportError
    repo, records, _ = nightly
    text = page(tmp_path, records, repo)
    assert "No change point in any configuration. Change points not computed: --detect needs Apache" in text
    assert "throughput_tokens_per_s: no change points (--detect needs Apache Otava" in text
