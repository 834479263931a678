"""The docs stay usable: a README a newcomer reads in one sitting, links that lead somewhere, a repository
that carries everything it refers to, and a README whose CI commands are the ones CI really runs.

Links are checked as GitHub renders them: relative to the page, to a file of this repository, and an
anchor to a heading of the target page (GitHub's slug of it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.unit

README = REPO / "README.md"
CI_SCRIPT = REPO / ".ci" / "run"
MAX_README_LINES = 150
# Directories that are not the repository's content: environments, caches, build and run outputs.
SKIPPED_DIRS = {
    ".git",
    ".venv",
    ".venvs",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "results",
    "reports",
    "wheels",
    "profiler_log",
    "coverage-backends",
    "node_modules",
}
SCANNED_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml"}
# Paths outside the repository that a file must not depend on; spelled in pieces so this file does not
# match itself.
OUTSIDE_REFERENCES = ("../" + "shared", "/" + "work/")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def doc_pages() -> list[Path]:
    return [README, *sorted((REPO / "docs").rglob("*.md"))]


def prose(text: str) -> str:
    """The page without its code: links inside code blocks and inline code are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    slugs: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug, n = github_slug(heading), 1
        base = slug
        while slug in slugs:  # GitHub numbers repeated headings
            slug, n = f"{base}-{n}", n + 1
        slugs.add(slug)
    return slugs


def broken_links(page: Path) -> list[str]:
    """Every relative link of `page` that leads to no file of the repository (or to no heading of it)."""
    problems = []
    for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file of ours
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(REPO)}: ({target})"
        if not resolved.is_relative_to(REPO):
            problems.append(f"{where} leads outside the repository")
        elif not resolved.is_file():
            problems.append(f"{where} is no file of the repository")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: {resolved.relative_to(REPO)} has no heading #{anchor}")
    return problems


def repository_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIPPED_DIRS
            and not d.endswith(".egg-info")
            and not (Path(root) / d / "pyvenv.cfg").exists()  # any virtual environment
        ]
        for name in files:
            path = Path(root) / name
            if path.suffix in SCANNED_SUFFIXES or path == CI_SCRIPT:
                yield path


def commands(lines) -> list[str]:
    """Shell lines with their comments and blank lines dropped."""
    out = []
    for line in lines:
        command = line.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            out.append(command)
    return out


def ci_commands() -> list[str]:
    """What .ci/run runs, less the lines that only set the shell up (options, directory)."""
    return [c for c in commands(CI_SCRIPT.read_text().splitlines()) if not c.startswith(("set ", "cd "))]


def test_readme_is_at_most_150_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines; at most {MAX_README_LINES} (move the rest to docs/)"
    )


def test_every_relative_link_in_the_docs_leads_to_a_file_of_the_repository():
    pages = doc_pages()
    assert len(pages) > 1, "no docs/ pages found"
    problems = [p for page in pages for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_no_file_refers_to_a_path_outside_the_repository():
    offenders = []
    for path in repository_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            for reference in OUTSIDE_REFERENCES:
                if reference in line:
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {reference!r}: {line.strip()[:90]}")
    assert not offenders, "\n".join(offenders)


def test_the_readme_shows_the_commands_ci_runs():
    expected = ci_commands()
    assert expected, f"no command found in {CI_SCRIPT}"
    blocks = [commands(m.group(0).splitlines()[1:-1]) for m in FENCE.finditer(README.read_text())]
    assert expected in blocks, (
        f"README.md has no code block of exactly .ci/run's commands {expected}; its blocks: {blocks}"
    )
