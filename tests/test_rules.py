"""The project's written rules hold: the import layering (import-linter contracts in pyproject.toml), the
lint and format rules (ruff), and that what the harness knows of a stack comes from its adapter: no code
outside backends/ names a backend."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from backends import backend_names

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["lint-imports"],
        ["ruff", "check", "--no-cache", "."],
        ["ruff", "format", "--check", "--no-cache", "."],
    ],
    ids=["import-layers", "ruff-check", "ruff-format"],
)
def test_rule_holds(command):
    proc = subprocess.run(
        [str(BIN / command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


# Packages whose code must learn about stacks through the registry (backends/), never by a backend's name
NAME_FREE_PACKAGES = ("harness", "core", "workloads")
# file (relative to the repository) -> why it may hold a backend's name as a string; keep it short
NAME_ALLOWED: dict[str, str] = {}


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and its functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def backend_name_literals(source: str, names) -> list[tuple[int, str]]:
    """(line, text) of each string constant of `source` that is one of `names`, docstrings aside: a name in
    code is an if-chain or a table on backend names, where the adapter should hold the knowledge. Help
    text and messages that mention a backend in a sentence are no such constant."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in names
        and id(node) not in skip
    )


@pytest.mark.unit
def test_backend_name_literals_finds_a_name_in_code_and_not_in_docstrings_or_sentences():
    source = '''"""Module text: torch-ddp."""
def f(cfg):
    """torch-ddp"""
    help = "for backends whose launcher reaches the hosts (horovod)"
    if cfg.backend == "horovod":
        return {"tf-mwms": 1}
'''
    names = {"torch-ddp", "horovod", "tf-mwms"}
    assert backend_name_literals(source, names) == [(5, "horovod"), (6, "tf-mwms")]


@pytest.mark.unit
def test_no_code_outside_backends_names_a_backend():
    """Every stack's knowledge is in its package (issue 27): the harness, core and the workloads find it
    through the registry, so a stack registered from elsewhere gets the same treatment as a shipped one."""
    names = set(backend_names())
    found = []
    for package in NAME_FREE_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            where = str(path.relative_to(REPO))
            if where in NAME_ALLOWED:
                continue
            literals = backend_name_literals(path.read_text(), names)
            found += [f"{where}:{line}: {text!r}" for line, text in literals]
    rule = "backend names in code outside backends/ (give the adapter an attribute or a hook)"
    assert not found, rule + ":\n" + "\n".join(found)


# What a file written for one particular borrowed GPU machine, and the way files reach it, says; the product
# (code, docs, tests, scripts, experiments) speaks of the user's GPU node and of the development VM instead.
FOREIGN_MACHINE = re.compile(
    r"device[ -]tool|\blent (?:gpu|machine|h200|node)|\bborrowed (?:gpu|machine)|\bworkplace\b"
    r"|(?<!no-)\bsandbox"  # not Chromium's --no-sandbox (tests/browser.py)
    r"|(?-i:\$OUT\b)|\bcarry=\[|device-wheels|/wo"
    r"rk/\.device",
    re.IGNORECASE,
)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".json", ""}


def product_text_files() -> list[Path]:
    skip = {".git", ".venv", ".venvs", "results", "reports", "data", "__pycache__", "node_modules"}
    out = []
    for path in REPO.rglob("*"):
        parts = set(path.relative_to(REPO).parts)
        if parts & skip or any(p.endswith(".egg-info") or p.startswith(".gpu") for p in parts):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES and path != Path(__file__).resolve():
            out.append(path)
    return out


@pytest.mark.unit
def test_the_product_speaks_only_of_itself():
    """No file is written for a particular borrowed machine or how files travel to it (issue: a check
    written for one machine is a second harness no user can run)."""
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}"
        for path in product_text_files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if FOREIGN_MACHINE.search(line)
    ]
    assert not found, "\n".join(found)


# A product module does one job (docs/development.md); past this many lines one has grown a second
MODULE_LINES_MAX = 500
PRODUCT_PACKAGES = ("core", "workloads", "backends", "harness")


@pytest.mark.unit
def test_no_product_module_grows_past_its_limit():
    """A module that passes the limit is split where its jobs part, not let grow (issue 49)."""
    long = {
        str(path.relative_to(REPO)): n
        for package in PRODUCT_PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MODULE_LINES_MAX
    }
    assert not long, f"modules over {MODULE_LINES_MAX} lines (split each where its jobs part): {long}"
