"""The report's section on `harness predict` records: the predicted figures with their bands, per
configuration and hardware profile, and (html) beside the measured medians of the same context.

Apart from the measured sections so that a prediction is never folded into a measured table: its rows come
from harness.analyze.predictions alone.
"""

from __future__ import annotations

from harness.analyze.predictions import measured_beside, prediction_figures, prediction_rows
from harness.document import Figure, Section, Table, nbytes, num, pct


def prediction_sections(predictions: list[dict], training: list[dict], with_figures: bool) -> list[Section]:
    """`harness predict` records, apart from every measured table: per configuration and hardware profile,
    the predicted figures with their bands, and (html) dashed lines beside the measured medians of the
    same context where there are some."""
    table = prediction_rows(predictions)
    if table.empty:
        return []
    intro = Section(
        "Predictions (not measured)",
        2,
        [
            "From `harness predict`: an analytic model of each stack's step (its collectives replayed "
            "against its compute on one communication stream), priced by a hardware profile and "
            "calibrated by measured records where given. Nominal value, then the band from the fast and "
            "slow ends of its inputs' ranges. Never folded into the measured tables above."
        ],
    )
    rows = [
        [
            r.label,
            f"{r.workload} {r.precision} {r.batch}",
            r.hardware,
            str(r.world_size),
            str(r.nodes),
            f"{num(r.t_step_s, '{:.3g}')} ({num(r.t_step_s_low, '{:.3g}')}–{num(r.t_step_s_high, '{:.3g}')})",
            num(r.per_device_throughput),
            pct(r.efficiency, 1),
            pct(r.exposed_comm_ratio, 1),
            pct(r.mfu, 1),
            nbytes(r.memory_bytes),
            r.fits,
            r.compute,
        ]
        for r in table.itertuples()
    ]
    intro.blocks.append(
        Table(
            [
                "stack",
                "configuration",
                "hardware",
                "N",
                "nodes",
                "step s (band)",
                "tokens/s/device",
                "efficiency",
                "exposed comm",
                "MFU",
                "memory/rank",
                "fits",
                "compute",
            ],
            rows,
        )
    )
    # How each predicted stack fared on published scaling runs, as `harness predict` printed it: a budget
    # read from this table carries the caveat beside it.
    checks = {(r["summary"].get("published_check") or {}).get("verdict") for r in predictions}
    intro.blocks.extend(f"Published check: {verdict}" for verdict in sorted(str(v) for v in checks if v))
    if with_figures:
        measured = measured_beside(table, training)
        intro.blocks.extend(Figure(title, png) for title, png in prediction_figures(table, measured))
    return [intro]
