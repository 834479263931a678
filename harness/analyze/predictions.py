"""Prediction records (`harness predict --out`) as tables and plots, kept apart from measurements: their own
rows, their own section, dashed lines; a measured point is drawn beside a prediction only when it ran the
same label, workload, precision and batch on the profile's device, and never enters a prediction's row.
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd

from core.records import batch_name, run_config
from harness.analyze.analysis import aggregate, runs_table

CORNERS = ("fast", "nominal", "slow")
KEYS = ["label", "workload", "precision", "batch", "hardware", "device"]


def prediction_rows(records: list[dict]) -> pd.DataFrame:
    """One row per prediction record (one configuration at one N): nominal figures and their band."""
    rows = []
    for r in records:
        corners, cfg, hw = r["summary"]["corners"], run_config(r), r["inputs"]["hardware"]

        def band(key, corners=corners):
            values = [corners[c][key] for c in CORNERS]
            if any(v is None for v in values):
                return np.nan, np.nan, np.nan
            return values[1], min(values), max(values)

        row = {
            "run_id": r["run_id"],
            "label": r["backend_info"]["label"],
            "workload": cfg.model.workload,
            "precision": cfg.model.precision,
            "batch": batch_name(cfg),
            "hardware": hw["name"],
            "device": hw.get("device_name") or hw.get("device"),
            "world_size": cfg.topology.world_size,
            "nodes": cfg.topology.nodes,
            "compute": corners["nominal"]["compute_method"],
            "memory_bytes": corners["nominal"]["memory"]["total"],
            "fits": r["summary"]["fits"]["verdict"],
        }
        for key, column in (
            ("step_time_s", "t_step_s"),
            ("per_device_tokens_per_s", "per_device_throughput"),
            ("throughput_tokens_per_s", "throughput"),
            ("scaling_efficiency", "efficiency"),
            ("exposed_comm_ratio", "exposed_comm_ratio"),
            ("mfu", "mfu"),
        ):
            row[column], row[column + "_low"], row[column + "_high"] = band(key)
        rows.append(row)
    table = pd.DataFrame(rows)
    return table.sort_values([*KEYS, "world_size"]).reset_index(drop=True) if len(table) else table


def measured_beside(predicted: pd.DataFrame, training: list[dict]) -> pd.DataFrame:
    """The measured groups (label x N, median over repeats) of the contexts some prediction covers."""
    if not training or predicted.empty:
        return pd.DataFrame()
    agg = aggregate(runs_table(training))
    keys = predicted[["label", "workload", "precision", "batch", "device"]].drop_duplicates()
    return agg.merge(keys, on=["label", "workload", "precision", "batch", "device"])


def prediction_figures(predicted: pd.DataFrame, measured: pd.DataFrame) -> list[tuple[str, bytes]]:
    """Per-device throughput and scaling efficiency against N (log scale): each prediction dashed with its
    band shaded, the measured medians of the same context as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for (workload, precision, batch, hardware), g in predicted.groupby(
        ["workload", "precision", "batch", "hardware"], sort=True
    ):
        for column, ylabel in (
            ("per_device_throughput", "tokens/s per device"),
            ("efficiency", "scaling efficiency"),
        ):
            fig, ax = plt.subplots(figsize=(6.5, 3.4))
            for i, (label, p) in enumerate(g.groupby("label", sort=True)):
                color = f"C{i}"
                p = p.sort_values("world_size")
                ax.plot(p["world_size"], p[column], "--", color=color, label=f"{label} (predicted)")
                ax.fill_between(
                    p["world_size"], p[column + "_low"], p[column + "_high"], color=color, alpha=0.15
                )
                if len(measured) and column in measured:
                    m = measured[(measured["label"] == label) & (measured["workload"] == workload)]
                    if len(m):
                        ax.plot(m["world_size"], m[column], "o", color=color, label=f"{label} (measured)")
            ax.set_xscale("log", base=2)
            title = f"Predicted {ylabel}: {workload}, {precision}, {batch}, {hardware}"
            ax.set(title=title, xlabel="N (ranks)", ylabel=ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
            buf = io.BytesIO()
            fig.tight_layout()
            fig.savefig(buf, format="png", dpi=90)
            plt.close(fig)
            out.append((title, buf.getvalue()))
    return out
