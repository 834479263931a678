"""The report's sections on `harness commbench` records: each stack's collectives, per device, N and dtype,
their fitted latency and bandwidth and (html) busbw against message size.

Apart from the training sections because the records are of another kind, with their own figures
(harness.analyze.collectives); a report may hold either kind, or both.
"""

from __future__ import annotations

import io

import pandas as pd

from core.records import run_config
from harness.analyze.collectives import commbench_aggregate, commbench_rows
from harness.document import Figure, Section, Table, nbytes, num, value


def commbench_sections(records: list[dict], with_figures: bool) -> list[Section]:
    """Each stack's collectives (`harness commbench` records): per device, N and dtype, a table of every
    op's fitted latency and bandwidth and its busbw at the largest size, and per op busbw against message
    size, one line per stack (log-log)."""
    agg = commbench_aggregate(commbench_rows(records))
    failed = [r for r in records if r["status"] != "ok"]
    if agg.empty and not failed:
        return []
    intro = Section(
        "Collectives (commbench)",
        2,
        [
            "Each stack's own collective API, started by its launcher: per size, the median over calls of "
            "the slowest rank's time (from a barrier to the device idle); algbw = size / time and busbw = "
            "algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all) or 1 "
            "(broadcast), as nccl-tests defines them; α and β fitted to t = α + size·busfactor/β. "
            "Repeated records: the median of their medians."
        ],
    )
    if failed:
        intro.blocks.append(
            Table(
                ["run", "stack", "N", "status", "error"],
                [
                    [
                        r["run_id"],
                        r["backend_info"]["label"],
                        str(run_config(r).topology.world_size),
                        r["status"],
                        str((r.get("error") or {}).get("message")),
                    ]
                    for r in failed
                ],
            )
        )
    sections = [intro]
    for (device, world, dtype), g in agg.groupby(["device", "world_size", "dtype"]):
        sec = Section(f"Collectives: {world} ranks · {device} · {dtype}", 3)
        rows = []
        for (label, op), h in g.groupby(["label", "op"]):
            last = h.sort_values("bytes").iloc[-1]
            rows.append(
                [
                    label,
                    op,
                    num(value(last.alpha_s) and last.alpha_s * 1e6, "{:,.1f}"),
                    num(value(last.beta_busbw_Bps) and last.beta_busbw_Bps / 1e9, "{:.3g}"),
                    nbytes(last.bytes),
                    num(last.busbw_Bps / 1e9, "{:.3g}"),
                    str(int(h["runs"].max())),
                ]
            )
        sec.blocks.append(
            Table(
                [
                    "stack",
                    "op",
                    "α µs",
                    "β GB/s (bus)",
                    "largest size",
                    "busbw GB/s there",
                    "runs",
                ],
                rows,
            )
        )
        if with_figures:
            sec.blocks.extend(busbw_figures(g))
        sections.append(sec)
    return sections


def busbw_figures(g: pd.DataFrame) -> list[Figure]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for op, h in g.groupby("op"):
        fig, ax = plt.subplots(figsize=(6.5, 3.4))
        for label, k in h.groupby("label"):
            k = k.sort_values("bytes")
            ax.plot(k["bytes"], k["busbw_Bps"] / 1e9, "o-", ms=3, label=label)
        ax.set(xscale="log", yscale="log", title=f"{op}: bus bandwidth", xlabel="message size (bytes)")
        ax.set_ylabel("busbw GB/s")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=90)
        plt.close(fig)
        out.append(Figure(f"{op}: busbw vs message size", buf.getvalue()))
    return out
