"""The GitHub workflows we ship pass a security audit: users copy them into their repositories to gate pull
requests, so an unpinned action, a checkout that keeps its token, or a step output expanded into shell would
be copied with them.

zizmor audits every workflow under .github/workflows/ (one added later included), offline, and any finding of
medium severity or above fails. Neither a zizmor config file nor `# zizmor: ignore[...]` comments are
honoured: an exception is granted here, in review, or not at all. zizmor rates a step output expanded inside
`run:` as informational (a step output is not attacker-controlled on its face), so that rule is checked
here directly.
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
