"""`harness report` and `harness results`: what a set of run records shows, as a report (Markdown or one
self-contained HTML file) or as the tidy table itself.

One job per module: command.py (the two commands: load the records, pick the sections, write the output),
training.py (the sections on training runs: scaling, numerics, plots), selection.py (the framework
selection, and under it where each stack's step goes at each N), contexts.py (a context's title, the
oversubscribed mark), commbench.py (the collectives of `harness commbench` records), prediction.py
(`harness predict` records, apart from every measured table). They build a harness.document Document,
which harness/document.py renders to Markdown or HTML for every verb that writes one (`harness select`
too). Every number comes from harness.analyze
(analysis, collectives, predictions); these modules only choose and format.
"""

from harness.analyze.report.command import cmd_report, cmd_results, register
from harness.analyze.report.training import build
from harness.document import render_html, render_md

__all__ = ["build", "cmd_report", "cmd_results", "register", "render_html", "render_md"]
