"""The docs stay usable: a README a newcomer reads in one sitting, links that lead somewhere, a repository
that carries everything it refers to, and a README whose CI commands are the ones CI really runs.

Links are checked as GitHub renders them: relative to the page, to a file of this repository, and an
anchor to a heading of the target page (GitHub's slug of it).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import os
import re
import sys
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


# --- Names the docs give: every path, module and flag they name exists -----------------------------------

# The folders a path the docs name starts from; the packages among them, whose dotted names are modules.
ROOTS = ("harness", "backends", "core", "workloads", "tests", "docs", "scripts", "experiments")
PACKAGES = ("harness", "backends", "core", "workloads")
# An ML framework: a module that imports one (at import time, itself or through the repository's modules)
# is read with `ast`, never imported, as this process imports none (conftest).
FRAMEWORKS = {"torch", "tensorflow", "keras", "paddle", "deepspeed", "horovod", "jax"}
PATH_NAME = re.compile(rf"(?<![\w./~$-])(?:{'|'.join(ROOTS)})/[^\s`'\"()\[\],;|]*")
MODULE_NAME = re.compile(rf"(?<![\w./~$-])(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+")
# A page named without its folder ("see DESIGN.md"): a page of this repository somewhere. (A bare module
# file name is as often another project's, such as nanoGPT's train.py.)
FILE_NAME = re.compile(r"(?<![\w./~$-])[\w-]+\.md\b")
# What precedes another project's file: "Horovod's docs/tensor-fusion.rst" is no path of this repository.
THEIRS = re.compile(r"\w's\s+$")
# A dotted name that ends in one of these is a file name, which PATH_NAME's check covers when it is a path.
FILE_SUFFIXES = {"py", "md", "json", "yaml", "yml", "toml", "sh", "txt", "csv", "html", "log", "cfg"}
SHELL_SEPARATORS = ("|", "&&", ";", ">", "<", "#", "`", "$(", ")")


def named_pages() -> list[Path]:
    """The pages whose names must hold: README.md and docs/, less the dated investigation notes, which
    record what the repository held on their date (docs/notes/README.md says so) and are not rewritten."""
    return [p for p in doc_pages() if not re.match(r"\d{4}-\d{2}-\d{2}-", p.name)]


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def docstrings():
    """(where, text) for every docstring of the product packages: a module's, a class's, a function's, and
    an attribute's (the string after a field, as core/config.py documents RunConfig's)."""
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(parsed(path)):
                if (
                    isinstance(node, ast.Expr)
                    and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                ):
                    yield f"{path.relative_to(REPO)}:{node.lineno}", node.value.value


def texts():
    """(where, text) for every page and docstring whose names must hold; a page's `where` gains the line
    of each name (`locate`)."""
    for page in named_pages():
        yield str(page.relative_to(REPO)), page.read_text(encoding="utf-8")
    yield from docstrings()


def locate(where: str, text: str, offset: int) -> str:
    if ":" in where:  # a docstring: its first line is enough
        return where
    return f"{where}:{text.count(chr(10), 0, offset) + 1}"


def missing_path(name: str) -> str | None:
    """Why a path the docs name is not in the repository, or None when it is (a glob: when it matches)."""
    name = re.sub(r"(:\d+(-\d+)?|#.*)$", "", name.rstrip(".:"))  # a sentence's end, a line, an anchor
    name = name.rstrip(".:/")
    if any(mark in name for mark in ("<", ">", "{", "}", "$", "...", "…")):
        return None  # a placeholder such as backends/<name>/worker.py
    if any(mark in name for mark in "*?"):
        return None if any(REPO.glob(name)) else "matches no file"
    return None if (REPO / name).exists() else "no such file or folder"


@functools.cache
def file_names() -> frozenset[str]:
    return frozenset(path.name for path in repository_files())


def missing_file_name(name: str) -> str | None:
    return None if name in file_names() else "no file of the repository has this name"


def module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def top_level(body):
    """The statements Python runs when it imports a module: not function bodies, not `if TYPE_CHECKING`."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from top_level(getattr(node, field, []) or [])


def imported_at_import_time(module: str) -> set[str]:
    """The modules `module` imports when it is imported, its packages' __init__ included."""
    path = module_file(module)
    out = {module.rpartition(".")[0]} - {""}
    if path is None:
        return out
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in top_level(parsed(path).body):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names if module_file(f"{base}.{alias.name}")}
    return out


@functools.cache
def imports_a_framework(module: str) -> bool:
    """Whether importing `module` imports an ML framework, through the repository's modules too."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in imported_at_import_time(current):
            if name.split(".")[0] in FRAMEWORKS:
                return True
            if name.split(".")[0] in PACKAGES:
                todo.append(name)
    return False


def defined_names(body) -> dict[str, ast.AST]:
    """The names a module or class body binds: defs, classes, assignments, imports."""
    out: dict[str, ast.AST] = {}
    for node in top_level(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = node
    return out


def missing_attribute(module: str, attributes: list[str]) -> str | None:
    """Why `module.a.b...` names nothing, or None when it does. A framework-free module is imported and
    the name looked up; a module that imports a framework is parsed: the name must be bound at its top
    level (and the next one in that class's body). Past a dataclass field or an instance's attribute the
    name cannot be followed without a value, and is taken as given."""
    if imports_a_framework(module):
        scope = defined_names(parsed(module_file(module)).body)
        for depth, name in enumerate(attributes[:2]):
            if name not in scope:
                return f"{module} binds no {'.'.join(attributes[: depth + 1])} (read, not imported)"
            node = scope[name]
            if not isinstance(node, ast.ClassDef):
                return None
            scope = defined_names(node.body)
        return None
    value = importlib.import_module(module)
    for depth, name in enumerate(attributes):
        if hasattr(value, name):
            value = getattr(value, name)
            continue
        declared = getattr(value, "__dataclass_fields__", {}) or getattr(value, "__annotations__", {})
        if isinstance(value, type) and name in declared:
            return None
        return f"{module} has no {'.'.join(attributes[: depth + 1])}"
    return None


def missing_module(name: str) -> str | None:
    """Why a dotted name of the packages names no module or module attribute, or None when it does."""
    parts = name.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None
    for cut in range(len(parts), 0, -1):
        if module_file(".".join(parts[:cut])):
            return missing_attribute(".".join(parts[:cut]), parts[cut:]) if cut < len(parts) else None
    return "no such package"


def stale_names(where: str, text: str) -> tuple[list[str], int]:
    """Every path, dotted module name and page name of `text` that names nothing, and how many it names."""
    problems, checked = [], 0
    for pattern, why in (
        (PATH_NAME, missing_path),
        (MODULE_NAME, missing_module),
        (FILE_NAME, missing_file_name),
    ):
        for match in pattern.finditer(text):
            if THEIRS.search(text[max(0, match.start() - 40) : match.start()]):
                continue
            checked += 1
            problem = why(match.group(0))
            if problem:
                problems.append(f"{locate(where, text, match.start())}: {match.group(0)}: {problem}")
    return problems, checked


def test_every_path_and_module_the_docs_and_docstrings_name_exists():
    problems, checked = [], 0
    for where, text in texts():
        found, count = stale_names(where, text)
        problems, checked = problems + found, checked + count
    assert checked > 200, f"only {checked} names found: is the scan still reading the docs?"
    assert not problems, "\n".join(problems)


def code_spans(text: str) -> list[tuple[int, str]]:
    """(offset, code) for every shell line of a fenced block (a trailing backslash joins the next) and
    every inline code span."""
    out = []
    for block in FENCE.finditer(text):
        lines = block.group(0).splitlines(keepends=True)
        offset, start, joined = block.start() + len(lines[0]), 0, ""
        for line in lines[1:-1]:
            start = start if joined else offset
            offset += len(line)
            joined += line.rstrip("\n")
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            out.append((start, joined))
            joined = ""
    for span in INLINE_CODE.finditer(FENCE.sub(lambda m: " " * len(m.group(0)), text)):
        out.append((span.start(), span.group(0).strip("`")))
    return out


def harness_commands(code: str) -> list[list[str]]:
    """The words after each `harness` (or .venv/bin/harness, python -m harness) of a shell line, up to
    the end of its command."""
    out = []
    words = code.split()
    for i, word in enumerate(words):
        before = words[i - 1] if i else "$"
        starts = before in ("$", "-m", "&&", "||", "|", ";", "(", "time") or re.fullmatch(r"\w+=\S*", before)
        if word.rsplit("/", 1)[-1] != "harness" or not starts:
            continue  # prose in a diagram ("the harness imports ..."), not a command
        command = []
        for arg in words[i + 1 :]:
            if arg == "--" or arg.startswith(SHELL_SEPARATORS):
                break
            command.append(arg)
            if arg.endswith((";", "`")):
                break
        out.append(command)
    return out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def unknown_flags(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """The flags among `words` (`harness WORDS`) that the command they follow does not take."""
    verbs = []
    for word in words:
        if word.startswith("-"):
            break
        if not re.fullmatch(r"[a-z][\w-]*", word) or not subcommands(parser):
            break  # a placeholder, or a command's positional argument
        if word not in subcommands(parser):
            return [f"harness {' '.join([*verbs, word])}: no such command"]
        verbs.append(word)
        parser = subcommands(parser)[word]
    out = []
    for word in words:
        flag = word.split("=", 1)[0].strip("[]();`")  # `[--out DIR]`: an optional flag
        if re.fullmatch(r"--[a-z][\w-]*|-[A-Za-z]", flag) and flag not in parser._option_string_actions:
            out.append(f"harness {' '.join(verbs)} {flag}: no such flag")
    return out


def test_every_cli_flag_the_docs_show_is_one_its_command_takes():
    from harness.cli import make_parser

    parser = make_parser()
    problems, shown = [], 0
    for page in named_pages():
        text = page.read_text(encoding="utf-8")
        for offset, code in code_spans(text):
            for words in harness_commands(code):
                shown += 1
                where = locate(str(page.relative_to(REPO)), text, offset)
                problems += [f"{where}: {p}" for p in unknown_flags(parser, words)]
    assert shown > 50, f"only {shown} harness commands found: is the scan still reading the docs?"
    assert not problems, "\n".join(problems)


def test_the_scan_finds_each_kind_of_stale_name():
    """What the two tests above look for, on a page written for it: the names this repository's docs once
    gave wrongly are found, their right names and another project's file are not."""
    page = """see DESIGN.md; a stack's name (backends.registry); `harness/analyze/metric.py`, and
    core.hooks.warmup_transient_bytes. Right: README.md, backends.backend_names, core.hooks.TestHooks,
    `harness/analyze/metrics.py`, docs/notes/, core/schemas/*.json, backends/<name>/worker.py,
    workloads.torch_model.GPT, Horovod's docs/tensor-fusion.rst."""
    problems, checked = stale_names("page.md", page)
    assert checked == 12
    assert [p.split(": ")[1] for p in problems] == [
        "harness/analyze/metric.py",
        "backends.registry",
        "core.hooks.warmup_transient_bytes",
        "DESIGN.md",
    ], problems
    assert "torch" not in sys.modules, "a framework's module was imported, not read"
    from harness.cli import make_parser

    [words] = harness_commands("FOO=1 .venv/bin/harness predict --gpus 8 [--tuned-too] --out=x | grep --nope")
    assert unknown_flags(make_parser(), words) == ["harness predict --tuned-too: no such flag"]
    assert unknown_flags(make_parser(), ["reports", "--gpus", "8"]) == ["harness reports: no such command"]
    assert harness_commands("the harness imports no framework") == []


DEVELOPMENT = REPO / "docs" / "development.md"
# The folders whose every module and package the layout in docs/development.md names. Each backend's own
# package is covered by the layout's "one package per backend" (the registry lists them), tests/ by its
# own pages, and docs/ and results/ hold no code.
LAID_OUT = ("workloads", "core", "backends", "harness", "experiments", "scripts")
LAYOUT_ENTRY = re.compile(r"^([\w/]+/)\s", re.MULTILINE)
NAMED_FILE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|sh))\b")


def layout_entries() -> dict[str, str]:
    """docs/development.md's layout block as {folder/: the text of its entry}."""
    text = DEVELOPMENT.read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    starts = list(LAYOUT_ENTRY.finditer(block))
    return {
        m.group(1): block[m.end() : starts[i + 1].start() if i + 1 < len(starts) else len(block)]
        for i, m in enumerate(starts)
    }


def stack_packages() -> set[str]:
    """The backends' own packages, registered in backends.ADAPTERS."""
    from backends import ADAPTERS

    return {spec.split(":")[0].split(".")[1] for spec in ADAPTERS.values()}


def laid_out_folders() -> list[Path]:
    """Every code folder under LAID_OUT, less the backends' own packages."""
    folders = []
    for top in LAID_OUT:
        for folder in [REPO / top, *sorted((REPO / top).rglob("*/"))]:
            rel = folder.relative_to(REPO)
            if not folder.is_dir() or set(rel.parts) & SKIPPED_DIRS:
                continue
            if top == "backends" and len(rel.parts) > 1 and rel.parts[1] in stack_packages():
                continue
            if any(folder.glob("*.py")) or any(folder.glob("*.sh")):
                folders.append(folder)
    return folders


def code_names(folder: Path) -> list[str]:
    """The modules, scripts and subpackages a folder holds, as the layout names them (a package's
    `__init__.py` and `__main__.py` go by the package's name)."""
    names = [
        p.name for p in sorted(folder.iterdir()) if p.suffix in (".py", ".sh") and not p.name.startswith("__")
    ]
    skipped = stack_packages() if folder == REPO / "backends" else set()
    names += [
        f"{p.name}/"
        for p in sorted(folder.iterdir())
        if (p / "__init__.py").exists() and p.name not in skipped
    ]
    return names


def test_the_layout_in_the_development_guide_names_every_module_and_nothing_gone():
    """docs/development.md's layout is how a newcomer finds a module: a module missing from it, or a name it
    keeps for a module that is gone, sends them looking in the wrong place. A folder without an entry of its
    own is described in its parent's entry."""
    entries = layout_entries()
    block = "".join(entries.values())
    problems = []
    for folder in laid_out_folders():
        key = f"{folder.relative_to(REPO)}/"
        entry = entries.get(key) or entries.get(f"{folder.parent.relative_to(REPO)}/")
        if entry is None:
            problems.append(f"{key}: no entry in the layout")
            continue
        for name in code_names(folder):
            stem = name.removesuffix("/").removesuffix(".py").removesuffix(".sh")
            named = re.search(rf"(?<![\w-]){re.escape(stem)}(?![\w-])", entry)
            if not named and f"{key}{name}" not in block and f"{key}{name}" not in entries:
                problems.append(f"{key}: {name} not named")
    for key, entry in entries.items():
        for name in NAMED_FILE.findall(entry):
            if not any((REPO / key).rglob(name)):
                problems.append(f"{key}: names {name}, which is not in {key}")
    assert not problems, "docs/development.md's layout is out of step with the tree:\n" + "\n".join(problems)
