"""The GitHub workflows we ship pass a security audit: users copy them into their repositories to gate pull
requests, so an unpinned action, a checkout that keeps its token, or a step output expanded into shell would
be copied with them.

zizmor audits every workflow under .github/workflows/ (one added later included), offline, and any finding of
medium severity or above fails. Neither a zizmor config file nor `# zizmor: ignore[...]` comments are
honoured: an exception is granted here, in review, or not at all. zizmor rates a step output expanded inside
`run:` as informational (a step output is not attacker-controlled on its face), so that rule is checked
here directly, and so is one zizmor does not check at all: no job that a pull request's code can reach holds
a write permission.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

WORKFLOWS = REPO / ".github" / "workflows"
FAILING = ("medium", "high")  # zizmor's severities: informational, low, medium, high
PINNED = re.compile(r"(uses:\s*[\w.-]+/[\w./-]+)@[0-9a-f]{40}\b")


def workflow_files(folder: Path = WORKFLOWS) -> list[Path]:
    return sorted([*folder.glob("*.yml"), *folder.glob("*.yaml")])


def zizmor() -> str:
    """The zizmor of this interpreter's environment (the `dev` extra), else one on PATH; skip without it."""
    beside = Path(sys.executable).parent / "zizmor"
    found = str(beside) if beside.is_file() else shutil.which("zizmor")
    if found is None:
        pytest.skip("zizmor is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return found


def audit(folder: Path) -> list[dict]:
    """zizmor's findings of medium severity or above in the workflows under `folder`. A file it cannot parse
    fails the audit (`--strict-collection`) rather than being skipped with a warning."""
    proc = subprocess.run(
        [zizmor(), "--offline", "--no-config", "--no-ignores", "--strict-collection", "--no-exit-codes",
         "--format", "json", "--min-severity", "medium", str(folder)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"zizmor failed (exit {proc.returncode}):\n{proc.stderr}"
    findings = json.loads(proc.stdout)
    return [f for f in findings if f["determinations"]["severity"].lower() in FAILING]


def describe(finding: dict) -> str:
    where = finding["locations"][0]
    path = where["symbolic"]["key"]["Local"]["verbatim_path"]
    line = where["concrete"]["location"]["start_point"]["row"] + 1
    return f"{finding['determinations']['severity']} {finding['ident']} at {path}:{line}: {finding['desc']}"


@pytest.mark.unit
@pytest.mark.subprocess  # zizmor
def test_the_workflows_pass_zizmor():
    assert workflow_files(), f"no workflow in {WORKFLOWS}"
    findings = audit(WORKFLOWS)
    assert not findings, "zizmor:\n" + "\n".join(map(describe, findings))


@pytest.mark.unit
def test_every_artifact_upload_replaces_a_re_run_s_earlier_one():
    """upload-artifact v4 refuses a name that an earlier attempt of the same workflow run uploaded (409):
    a re-run's measuring job would fail, and the jobs after it would read the first attempt's artifact.
    Every upload overwrites, so a re-run's own files are what the next job downloads."""
    uploads = [
        (path.name, step)
        for path in workflow_files()
        for job in yaml.safe_load(path.read_text())["jobs"].values()
        for step in job.get("steps", [])
        if step.get("uses", "").startswith("actions/upload-artifact@")
    ]
    assert uploads
    for name, step in uploads:
        assert step["with"].get("overwrite") is True, (name, step["with"]["name"])


@pytest.mark.unit
@pytest.mark.subprocess  # zizmor
def test_the_audit_catches_an_action_pinned_to_a_tag(tmp_path):
    """The audit's failure mode, tested: one `uses:` moved from its commit SHA back to a tag is reported."""
    copy = tmp_path / ".github" / "workflows"
    shutil.copytree(WORKFLOWS, copy)
    target = copy / "distbench-regression.yml"
    text, n = PINNED.subn(r"\1@v4", target.read_text(), count=1)
    assert n == 1, "no action pinned to a commit SHA to unpin"
    target.write_text(text)
    assert "unpinned-uses" in {f["ident"] for f in audit(copy)}


@pytest.mark.unit
@pytest.mark.parametrize("path", workflow_files(), ids=lambda p: p.name)
def test_step_outputs_reach_shell_through_env(path):
    """No `${{ }}` inside a `run:` script: an expression there is pasted into the shell source before it
    runs, so a value with a quote or `$(...)` in it becomes code. Pass it as `env:` and read `"$NAME"`."""
    workflow = yaml.safe_load(path.read_text())
    expanded = [
        f"{job_id} / {step.get('name', step.get('id', index))}"
        for job_id, job in workflow.get("jobs", {}).items()
        for index, step in enumerate(job.get("steps", []))
        if "${{" in str(step.get("run", ""))
    ]
    assert not expanded, f"{path.name}: `${{{{ }}}}` inside run: in {expanded}; pass it through env:"


# ---- write permissions and pull-request code ----------------------------------------------------------
# zizmor does not flag a write permission on a job that runs a pull request's code, so that rule is here: no
# job of a workflow a pull request triggers, and no job that checks out a pull request's code in any
# workflow, holds a write permission. A job with neither a checkout nor a `run:` step may be granted one
# below, by name and with its reason (in review, as every exception here); never in a `pull_request_target`
# workflow, whose write token a fork's pull request gets too.
PR_TRIGGERS = {"pull_request", "pull_request_target", "pull_request_review", "pull_request_review_comment"}
PR_CODE = re.compile(
    r"github\.event\.pull_request|github\.head_ref|refs/pull/|github\.event\.workflow_run\.head"
    r"|github\.event\.issue\.pull_request"
)
GRANTED = {
    ("distbench-regression.yml", "comment"): "posts the gate's verdict on the pull request: it checks out "
    "nothing and runs no shell, only the pinned download-artifact and github-script, and a fork's pull "
    "request gets it read-only",
}


def triggers(workflow: dict) -> set[str]:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as true
    return {on} if isinstance(on, str) else set(on or ())


def write_scopes(permissions) -> list[str]:
    """The write scopes of a `permissions:` value; none given at all is the repository's default token,
    which may write."""
    if permissions is None:
        return ["the default token (no permissions: block)"]
    if isinstance(permissions, str):
        return [permissions] if permissions == "write-all" else []
    return [f"{scope}: write" for scope, level in permissions.items() if level == "write"]


def checks_out_pr_code(job: dict) -> bool:
    return any(
        str(step.get("uses", "")).startswith("actions/checkout@")
        and PR_CODE.search(str(step.get("with", {})))
        for step in job.get("steps", [])
    )


def write_violations(path: Path) -> list[str]:
    """Each job of `path` that holds a write permission where a pull request's code can reach it."""
    workflow = yaml.safe_load(path.read_text())
    on = triggers(workflow)
    problems = []
    for job_id, job in workflow.get("jobs", {}).items():
        scopes = write_scopes(job["permissions"] if "permissions" in job else workflow.get("permissions"))
        pr = sorted(on & PR_TRIGGERS)
        if not scopes or not (pr or checks_out_pr_code(job)):
            continue
        steps = job.get("steps", [])
        grantable = (
            "pull_request_target" not in on
            and not any("run" in s or str(s.get("uses", "")).startswith("actions/checkout@") for s in steps)
            and not checks_out_pr_code(job)
        )
        if (path.name, job_id) in GRANTED and grantable:
            continue
        why = f"triggered by {', '.join(pr)}" if pr else "checks out pull-request code"
        problems.append(f"{path.name} / {job_id}: {', '.join(scopes)}, {why}")
    return problems


@pytest.mark.unit
@pytest.mark.parametrize("path", workflow_files(), ids=lambda p: p.name)
def test_no_job_that_pull_request_code_reaches_holds_a_write_permission(path):
    assert write_violations(path) == []


@pytest.mark.unit
def test_every_grant_names_a_job_that_writes():
    for name, job_id in GRANTED:
        job = yaml.safe_load((WORKFLOWS / name).read_text())["jobs"].get(job_id)
        assert job is not None and write_scopes(job.get("permissions")), f"stale grant: {name} / {job_id}"


def planted(tmp_path: Path, name: str, plant) -> Path:
    """A copy of workflow `name` with `plant(workflow)` applied."""
    workflow = yaml.safe_load((WORKFLOWS / name).read_text())
    plant(workflow)
    tmp_path.mkdir(exist_ok=True)
    copy = tmp_path / name
    copy.write_text(yaml.safe_dump(workflow, sort_keys=False))
    return copy


@pytest.mark.unit
def test_the_rule_catches_a_planted_write_permission(tmp_path):
    """Its failure mode, tested: `contents: write` planted on the gate's job (which runs the pull request's
    code), on the comment job given a `run:` step, and a pull request's checkout planted in the nightly's
    job that holds `contents: write`, are each reported; the unplanted copies are not."""

    def on_the_gate(w):
        w["jobs"]["regression"]["permissions"]["contents"] = "write"

    def a_shell_beside_the_grant(w):
        w["jobs"]["comment"]["steps"].append({"run": "echo hello"})

    def pr_checkout_in_the_writer(w):
        (writer,) = [j for j in w["jobs"].values() if write_scopes(j.get("permissions"))]
        writer["steps"].insert(0, {"uses": "actions/checkout@" + "0" * 40,
                                   "with": {"ref": "${{ github.event.pull_request.head.sha }}"}})  # fmt: skip

    assert write_violations(planted(tmp_path / "a", "distbench-regression.yml", lambda w: None)) == []
    gate = write_violations(planted(tmp_path / "b", "distbench-regression.yml", on_the_gate))
    assert gate == ["distbench-regression.yml / regression: contents: write, triggered by pull_request"]
    shell = write_violations(planted(tmp_path / "c", "distbench-regression.yml", a_shell_beside_the_grant))
    assert shell == ["distbench-regression.yml / comment: pull-requests: write, triggered by pull_request"]
    nightly = write_violations(planted(tmp_path / "d", "distbench-nightly.yml", pr_checkout_in_the_writer))
    assert nightly == ["distbench-nightly.yml / record: contents: write, checks out pull-request code"]


@pytest.mark.unit
@pytest.mark.parametrize("path", workflow_files(), ids=lambda p: p.name)
def test_a_write_permission_is_asked_by_one_job_never_by_the_workflow(path):
    """The workflow's own `permissions:` grants no write (and is given: without it every job gets the
    repository's default token), so a write token is held only by the job that names it."""
    workflow = yaml.safe_load(path.read_text())
    assert "permissions" in workflow and write_scopes(workflow["permissions"]) == [], path.name
