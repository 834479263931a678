"""How every verb that writes a document names it (`harness report`, `harness select`): `--markdown FILE`
and `--html FILE`, either or both, each once; FILE `-` writes that document to standard output. The kind
is named by the flag, never guessed from the file's name (a CI job's step summary, $GITHUB_STEP_SUMMARY,
has no suffix), and both kinds come from one list of harness.document Sections. A verb given neither
prints what it prints otherwise (`harness report`: the Markdown)."""

from __future__ import annotations

import sys
from pathlib import Path

from core.records import write_atomic
from harness.arguments.flags import add_flags
from harness.usage import UsageError

DOCUMENT_FLAGS = ("--markdown", "--html")
STDOUT = "-"


def add_document_arguments(parser) -> None:
    """--markdown FILE and --html FILE, as every verb that writes a document takes them."""
    add_flags(parser, *DOCUMENT_FLAGS)


def documents_asked(args) -> dict[str, str]:
    """kind ("markdown", "html") -> where, for each document asked for; at most one on standard output."""
    asked = {kind: str(getattr(args, kind)) for kind in ("markdown", "html") if getattr(args, kind, None)}
    if list(asked.values()).count(STDOUT) > 1:
        raise UsageError("--markdown - and --html -: only one document can go to standard output")
    return asked


def write_documents(args, sections: list, label: str = "document") -> None:
    """Render `sections` (harness.document) into every document asked for, each file written whole or not
    at all, and say where each went ("LABEL: FILE", on standard error where the document itself went to
    standard output)."""
    from harness.document import render_html, render_md

    renderers = {"markdown": render_md, "html": render_html}
    asked = documents_asked(args)
    for kind, where in asked.items():
        text = renderers[kind](sections)
        if where == STDOUT:
            sys.stdout.write(text)
            continue
        write_atomic(Path(where), lambda tmp, text=text: tmp.write_text(text))
        print(f"{label}: {where}", file=sys.stderr if STDOUT in asked.values() else sys.stdout)
