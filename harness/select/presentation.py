"""What `harness select` shows: the ranked candidates as rows, the tables on the terminal (rich) and in the
documents (harness.document, Markdown and HTML), and the answer's first lines.
"""

from __future__ import annotations

import math
import sys

from rich.console import Console
from rich.table import Table

from harness import document as doc
from harness.analyze.summary import fmt_bytes
from harness.predict.command import duration
from harness.predict.hardware import CORNERS
from harness.predict.memory import ALLOCATOR_MARGIN
from harness.select.search import Candidate


def row(c: Candidate, capacity) -> dict:
    """A ranked candidate as the tables, the documents and the record read it: its configuration, its
    time and step bands over the corners, cost, MFU, memory and the headroom `capacity` leaves."""
    assert c.prediction is not None
    corners = c.prediction["corners"]
    nominal = corners["nominal"]
    times = [corners[k]["train_time_s"] for k in CORNERS]
    return {
        "label": c.label,
        "backend": c.cfg.backend,
        "variant": c.cfg.variant,
        "backend_options": c.cfg.backend_options,
        "precision": c.cfg.model.precision,
        "activation_checkpointing": c.cfg.model.activation_checkpointing,
        "gpus": c.cfg.topology.world_size,
        "nodes": c.cfg.topology.nodes,
        "micro_batch": c.cfg.batch.micro_batch,
        "grad_accum": c.cfg.batch.grad_accum,
        "train_time_s": {"nominal": times[1], "low": min(times), "high": max(times)},
        "step_time_s": {
            "nominal": corners["nominal"]["step_time_s"],
            "low": min(corners[k]["step_time_s"] for k in CORNERS),
            "high": max(corners[k]["step_time_s"] for k in CORNERS),
        },
        "cost_usd": nominal["cost_usd"],
        "gpu_hours": nominal["gpu_hours"],
        "mfu": nominal["mfu"],
        "memory": c.memory,
        "headroom_bytes": (capacity * (1 - ALLOCATOR_MARGIN) - c.memory["total"]) if capacity else None,
    }


def ranked_table(rows: list[dict], top: int) -> doc.Table:
    """The first `top` ranked candidates, one row each: what the terminal and the documents show."""
    headers = ["#", "stack", "settings", "N", "micro x accum", "ckpt", "time to train (band)", "cost USD"]
    headers += ["headroom/rank", "MFU %", "P(fastest)", "Pareto"]
    cells = []
    for i, r in enumerate(rows[:top]):
        t = r["train_time_s"]
        cells.append(
            [
                str(i + 1),
                r["label"],
                ",".join(f"{k}={v}" for k, v in r["setting"].items()) or "-",
                str(r["gpus"]),
                f"{r['micro_batch']} x {r['grad_accum']}",
                "on" if r["activation_checkpointing"] else "off",
                f"{duration(t['nominal'])} ({duration(t['low'])}–{duration(t['high'])})",
                f"{r['cost_usd']:,.0f}" if r["cost_usd"] is not None else "-",
                fmt_bytes(r["headroom_bytes"]) if r["headroom_bytes"] is not None else "-",
                f"{100 * r['mfu']:.1f}" if r["mfu"] else "-",
                f"{100 * r['p_fastest']:.0f}%" if r.get("p_fastest") is not None else "",
                "*" if r["pareto"] else "",
            ]
        )
    return doc.Table(headers, cells)


def confirmed_table(confirmed: list[dict]) -> doc.Table:
    """Predicted against measured, one row a confirmed candidate."""
    headers = ["#", "stack", "N", "predicted step (band)", "measured step", "error", "in band", "measured #"]
    return doc.Table(
        headers,
        [
            [
                str(i),
                c["label"],
                str(c["gpus"]),
                band_ms(c["predicted_step_s"]),
                f"{c['measured_step_s'] * 1e3:,.1f} ms" if c["measured_step_s"] else c["status"],
                f"{c['error']:+.0%}" if c["error"] is not None else "-",
                {True: "yes", False: "MISSED", None: "-"}[c["in_band"]],
                str(c["measured_rank"] or "-"),
            ]
            for i, c in enumerate(confirmed, 1)
        ],
    )


def print_table(title: str, table: doc.Table, stream=None) -> None:
    """A table on the terminal (rich), text columns left and figures right."""
    console = Console(file=stream or sys.stdout, width=220)
    shown = Table(title=title, title_justify="left")
    for col in table.headers:
        shown.add_column(col, justify="left" if col in ("stack", "settings") else "right")
    for row in table.rows:
        shown.add_row(*row)
    console.print(shown)


def print_answer(rows, front, excluded, header, top, stream=None) -> None:
    print_table(header, ranked_table(rows, top), stream)
    console = Console(file=stream or sys.stdout, width=220)
    console.print(
        "Pareto front (time vs cost): "
        + "; ".join(f"{r['label']} N={r['gpus']} {duration(r['train_time_s']['nominal'])}" for r in front)
    )
    console.print(f"excluded {len(excluded)}" + (":" if excluded else ""))
    for e in excluded:
        console.print(f"  {e['label']} N={e['gpus']}: {e['why']}")


def print_closest(header: str, cands: list[Candidate]) -> None:
    """Where nothing meets the constraints: the five closest (the fastest priced, else the smallest in
    memory) and what each lacks."""
    closest = (
        sorted([c for c in cands if c.prediction], key=lambda c: c.train_s)[:5]
        or sorted(cands, key=lambda c: c.memory.get("total", math.inf))[:5]
    )
    print(f"{header}\nnothing meets the constraints; the closest:")
    for c in closest:
        print(f"  {c.label} N={c.cfg.topology.world_size}: lacks {', '.join(c.lacks)} ({c.dropped})")


def print_confirmed(confirmed: list[dict], stream=None) -> None:
    print_table("CONFIRMED (measured here, briefly)", confirmed_table(confirmed), stream)


def answer_lines(rows: list[dict]) -> list[str]:
    """The first lines of a document: the answer. The fastest candidate with its band and odds; the ones
    whose bands overlap its, named as not told apart; the cheapest where a price was given."""
    first = rows[0]
    t = first["train_time_s"]

    def what(r: dict) -> str:
        setting = ",".join(f"{k}={v}" for k, v in r["setting"].items())
        ckpt = ", activation checkpointing" if r["activation_checkpointing"] else ""
        return (
            f"{r['label']}{f' ({setting})' if setting else ''} on {r['gpus']} GPU(s), micro-batch "
            f"{r['micro_batch']} x {r['grad_accum']}{ckpt}, {r['precision']}"
        )

    odds_text = f", P(fastest) {first['p_fastest']:.0%}" if first.get("p_fastest") is not None else ""
    lines = [
        f"Fastest (predicted): {what(first)}: {duration(t['nominal'])} to train "
        f"({duration(t['low'])}–{duration(t['high'])}){odds_text}."
    ]
    close = [r for r in rows[1:] if r["train_time_s"]["low"] <= t["high"]]
    if close:
        lines.append(
            f"Not told apart from it (bands overlap): {len(close)} candidate(s), first "
            f"{what(close[0])}: {duration(close[0]['train_time_s']['nominal'])}."
        )
    priced = [r for r in rows if r["cost_usd"] is not None]
    if priced:
        cheapest = min(priced, key=lambda r: r["cost_usd"])
        lines.append(f"Cheapest: {what(cheapest)}: {cheapest['cost_usd']:,.0f} USD.")
    return lines


def band_ms(band: dict) -> str:
    return f"{band['nominal'] * 1e3:,.1f} ms ({band['low'] * 1e3:,.1f}–{band['high'] * 1e3:,.1f})"


def document(header: str, rows: list[dict], excluded: list[dict], confirmed: list[dict] | None, top: int):
    """The selection as report's Sections, for Markdown and HTML: the answer first, then the table, what
    was excluded and why, and predicted against measured where --confirm ran."""
    sections = [
        doc.Section("distbench select", 1, [*answer_lines(rows), header + "."]),
        doc.Section("Ranked (predicted, not measured)", 2, [ranked_table(rows, top)]),
        doc.Section("Excluded", 2, [f"{e['label']} N={e['gpus']}: {e['why']}" for e in excluded] or ["none"]),
    ]
    if confirmed:
        sections.append(doc.Section("Confirmed (measured here, briefly)", 2, [confirmed_table(confirmed)]))
    return sections
