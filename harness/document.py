"""A document as distbench writes one: Sections of paragraphs, Tables and Figures, the formatting of a cell
('n/a' for a figure not measured), and the rendering of the whole to Markdown (PR comment, terminal) or one
self-contained HTML file (plots embedded as PNG, opens offline).

Its own module because `harness report` and `harness select` both write documents, and the prediction may
not import the analysis's report (pyproject.toml's import contracts): each says what to show, and both
formats render every section alike.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field

from harness.analyze.summary import fmt_bytes


# ------------------------------------------------------------------------------------------- document model
@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    title: str
    png: bytes


@dataclass
class Section:
    """A heading and its blocks (paragraph strings, Tables, Figures), rendered alike to md and html."""

    title: str
    level: int = 2
    blocks: list = field(default_factory=list)


def value(x):
    """None for a missing figure (None or NaN), so formatting has one case for 'not measured'."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def pct(x, digits: int = 0) -> str:
    x = value(x)
    return "n/a" if x is None else f"{x:.{digits}%}"


def num(x, spec: str = "{:,.0f}") -> str:
    x = value(x)
    return "n/a" if x is None else spec.format(x)


def nbytes(x) -> str:
    return fmt_bytes(value(x))


# ------------------------------------------------------------------------------------------------ rendering
def render_md(sections: list[Section]) -> str:
    def cell(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    out = []
    for sec in sections:
        out.append("#" * sec.level + " " + sec.title + "\n")
        for block in sec.blocks:
            if isinstance(block, Table):
                out.append("| " + " | ".join(map(cell, block.headers)) + " |")
                out.append("|" + "---|" * len(block.headers))
                out.extend("| " + " | ".join(map(cell, row)) + " |" for row in block.rows)
                out.append("")
            elif isinstance(block, Figure):
                continue  # plots are in the HTML report
            else:
                out.append(block + "\n")
    return "\n".join(out)


CSS = (
    "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}\n"
    "table{border-collapse:collapse;margin:1em 0;font-size:0.85em}"
    "th,td{border:1px solid #ccc;padding:3px 7px;text-align:left}\n"
    "th{background:#f0f0f0}figure{display:inline-block;margin:0.5em}figcaption{font-size:0.8em;color:#555}"
)


def render_html(sections: list[Section]) -> str:
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        "<html lang='en'><head><meta charset='utf-8'><title>distbench report</title>",
        f"<style>{CSS}</style></head><body>",
    ]
    for sec in sections:
        out.append(f"<h{sec.level}>{e(sec.title)}</h{sec.level}>")
        for block in sec.blocks:
            if isinstance(block, Table):
                head = "".join(f"<th>{e(h)}</th>" for h in block.headers)
                body = "".join(
                    "<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in row) + "</tr>" for row in block.rows
                )
                out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            elif isinstance(block, Figure):
                data = base64.b64encode(block.png).decode("ascii")
                out.append(
                    f"<figure><img alt='{e(block.title)}' src='data:image/png;base64,{data}'>"
                    f"<figcaption>{e(block.title)}</figcaption></figure>"
                )
            else:
                out.append(f"<p>{e(block)}</p>")
    out.append("</body></html>")
    return "\n".join(out)
