"""What `harness select` shows: the ranked candidates as rows, the tables on the terminal (rich) and in the
documents (harness.document, Markdown and HTML), and the answer's first lines; in the documents too, the
parts of each stack's predicted step (the prediction's nominal timeline) and, in HTML, the Pareto front of
time against cost and those parts as plots.
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
        # where the nominal step goes, as the prediction's timeline has it (compute by phase, each term's
        # exposed communication, the overlap's slowdown, the wait for the slowest rank): they sum to it
        "step_parts": dict(c.prediction.get("timeline", {}).get("parts", {})),
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


def fastest_per_stack(rows: list[dict]) -> list[dict]:
    """Each stack's (backend's) first-ranked, fastest, candidate, in rank order."""
    first: dict[str, dict] = {}
    for r in rows:
        first.setdefault(r["backend"], r)
    return list(first.values())


def part_group(name: str) -> str:
    """A timeline part's kind: compute, exposed communication, or the step's other terms by name."""
    if name.startswith("compute"):
        return "compute"
    return "exposed comm" if name.startswith("exposed") else name


PARTS_HEADERS = ["stack", "N", "predicted step (band)", "compute", "exposed comm", "overlap slowdown"]
PARTS_HEADERS += ["stragglers (slowest of N)", "largest part beyond compute"]


def parts_table(rows: list[dict]) -> doc.Table:
    """The parts of each stack's fastest candidate's nominal step, grouped: compute, exposed communication,
    the overlap's slowdown and the stragglers, in ms and share of the step; and the largest part beyond
    compute by name."""
    cells = []
    for r in fastest_per_stack(rows):
        parts, step = r.get("step_parts") or {}, r["step_time_s"]["nominal"]
        grouped: dict[str, float] = {}
        for name, seconds in parts.items():
            grouped[part_group(name)] = grouped.get(part_group(name), 0.0) + seconds
        beyond = {k: v for k, v in parts.items() if not k.startswith("compute")}
        largest = max(beyond, key=beyond.__getitem__) if beyond else None

        def cell(seconds: float | None, step: float = step) -> str:
            return "-" if seconds is None else f"{seconds * 1e3:,.2f} ms ({seconds / step:.0%})"

        cells.append(
            [
                r["label"],
                str(r["gpus"]),
                band_ms(r["step_time_s"]),
                *(cell(grouped.get(k)) for k in ("compute", "exposed comm", "overlap slowdown")),
                cell(grouped.get("stragglers (slowest of N)")),
                f"{largest}: {cell(beyond[largest])}" if largest else "-",
            ]
        )
    return doc.Table(PARTS_HEADERS, cells)


FRONT_TEXT = (
    "Every candidate that meets the constraints, by its predicted time to train against what it costs "
    "(USD where --gpu-hour-price gave a price, else GPU-hours): the Pareto front is what no other candidate "
    "beats on both; the bars are each prediction's band over the corners of its inputs. The parts of each "
    "stack's fastest candidate's nominal step, as the prediction's timeline has them, sum to that step."
)


def plotted_cost(rows: list[dict]) -> tuple[str, str]:
    """The cost axis: USD where every row is priced, else GPU-hours (the row's key, the axis label)."""
    if rows and all(r["cost_usd"] is not None for r in rows):
        return "cost_usd", "cost (USD, nominal; band bars)"
    return "gpu_hours", "GPU-hours (nominal; band bars)"


def front_plot(rows: list[dict]):
    """Time to train against cost (or GPU-hours), a colour per stack (backend): each candidate a point with
    its band as error bars on both axes (the cost scales with the time at every corner), the Pareto front's
    points ringed and joined (gids 'front <stack>', 'candidates <stack>', 'pareto front')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key, ylabel = plotted_cost(rows)
    labels = list(dict.fromkeys(r["backend"] for r in rows))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, ax = plt.subplots(figsize=(6.2, 4.2))
    for label in labels:
        for on_front in (False, True):
            mine = [r for r in rows if r["backend"] == label and bool(r["pareto"]) == on_front]
            if not mine:
                continue
            t = [r["train_time_s"] for r in mine]
            x = [b["nominal"] / 3600 for b in t]
            xerr = [
                [(b["nominal"] - b["low"]) / 3600 for b in t],
                [(b["high"] - b["nominal"]) / 3600 for b in t],
            ]
            y = [r[key] for r in mine]
            yerr = [
                [v * (1 - b["low"] / b["nominal"]) for v, b in zip(y, t)],
                [v * (b["high"] / b["nominal"] - 1) for v, b in zip(y, t)],
            ]
            ax.errorbar(
                x,
                y,
                xerr=xerr,
                yerr=yerr,
                fmt="o",
                color=colors[label],
                ms=7 if on_front else 4,
                mec="black" if on_front else colors[label],
                alpha=1.0 if on_front else 0.4,
                elinewidth=1 if on_front else 0.6,
                capsize=2,
                label=label
                if on_front or not any(r["pareto"] for r in rows if r["backend"] == label)
                else None,
                gid=f"{'front' if on_front else 'candidates'} {label}",
            )
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["train_time_s"]["nominal"])
    if front:
        ax.plot(
            [r["train_time_s"]["nominal"] / 3600 for r in front],
            [r[key] for r in front],
            "k--",
            lw=0.8,
            label="Pareto front",
            gid="pareto front",
        )
    ax.set(
        title="Time to train against cost", xlabel="time to train (hours, nominal; band bars)", ylabel=ylabel
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def parts_plot(rows: list[dict]):
    """Each stack's fastest candidate's nominal step as a stacked horizontal bar of its parts (gid
    '<label> <part>', the candidate's label), the step's band as an error bar ('<label> band')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    shown = fastest_per_stack(rows)
    names = list(dict.fromkeys(k for r in shown for k in r.get("step_parts") or {}))
    cmap = plt.get_cmap("tab20")
    colors = {name: cmap(i % 20) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(6.2, 1.6 + 0.45 * len(shown) + 0.18 * len(names)))
    for y, r in enumerate(shown):
        left = 0.0
        for name, seconds in (r.get("step_parts") or {}).items():
            if seconds <= 0:
                continue
            ax.barh(y, seconds * 1e3, left=left, color=colors[name], gid=f"{r['label']} {name}")
            left += seconds * 1e3
        band = r["step_time_s"]
        ax.errorbar(
            [band["nominal"] * 1e3],
            [y],
            xerr=[[(band["nominal"] - band["low"]) * 1e3], [(band["high"] - band["nominal"]) * 1e3]],
            fmt="k|",
            ms=12,
            capsize=3,
            gid=f"{r['label']} band",
        )
    ax.set_yticks(range(len(shown)), [f"{r['label']} N={r['gpus']}" for r in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set(title="Predicted step of each stack's fastest candidate", xlabel="ms per step (nominal; band bar)")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3, axis="x")
    handles = [Patch(color=colors[name], label=name) for name in names]
    ax.legend(handles=handles, fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    return fig


def figures(rows: list[dict]) -> list[doc.Figure]:
    """The front and the parts, each as an embedded PNG (side by side in the HTML)."""
    import io

    import matplotlib.pyplot as plt

    out = []
    for title, fig in (
        ("Time to train against cost", front_plot(rows)),
        ("Predicted step parts", parts_plot(rows)),
    ):
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")  # the legend below
        plt.close(fig)
        out.append(doc.Figure(title, buf.getvalue()))
    return out


def document(
    header: str,
    rows: list[dict],
    excluded: list[dict],
    confirmed: list[dict] | None,
    top: int,
    with_figures: bool = False,
):
    """The selection as report's Sections, for Markdown and HTML: the answer first, then the table, the
    parts of each stack's predicted step (with `with_figures`, the Pareto front and those parts as plots),
    what was excluded and why, and predicted against measured where --confirm ran."""
    time_cost = doc.Section(
        "Time against cost, and where each stack's step goes (predicted)",
        2,
        [FRONT_TEXT, parts_table(rows), *(figures(rows) if with_figures else [])],
    )
    sections = [
        doc.Section("distbench select", 1, [*answer_lines(rows), header + "."]),
        doc.Section("Ranked (predicted, not measured)", 2, [ranked_table(rows, top)]),
        time_cost,
        doc.Section("Excluded", 2, [f"{e['label']} N={e['gpus']}: {e['why']}" for e in excluded] or ["none"]),
    ]
    if confirmed:
        sections.append(doc.Section("Confirmed (measured here, briefly)", 2, [confirmed_table(confirmed)]))
    return sections
