"""The terminal summary of one run record (what `harness run` and `harness collect` print)."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from core.records import run_config
from harness.analyze.anatomy import anatomy_text, part_text


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt(x, spec="{:.3g}") -> str:
    return "n/a" if x is None else spec.format(x)


def exposed_text(s: dict) -> str:
    """The exposed-communication ratio, or why it is not a figure: unresolved where the sync-off steps were
    slower than the synced ones beyond their noise."""
    part = ((s.get("anatomy") or {}).get("parts") or {}).get("exposed_comm")
    if s["exposed_comm_ratio"] is None and part and part["status"] == "unresolved":
        return part_text(part)
    return fmt(s["exposed_comm_ratio"], "{:.1%}")


def measured_comm_text(m: dict | None) -> str:
    """The collective trace's figures in one cell: volume beside the analytic, then per op."""
    if not m:
        return "n/a (1 rank: no collectives)"
    if not m.get("method"):
        return f"n/a ({m.get('reason')})"
    ops = "; ".join(
        f"{op} {o['calls_per_step']:g}/step, {fmt_bytes(o['size_bytes_per_step'])}, "
        f"{o['time_s_per_step'] * 1e3:.1f} ms, overlapped {fmt(o['overlap_fraction'], '{:.0%}')}, "
        f"busbw {fmt(o['busbw_Bps'] and o['busbw_Bps'] / 1e9, '{:.2f}')} GB/s"
        + "".join(
            f" (rank {rank}'s trace lost calls: {fmt_bytes(size)})"
            for rank, size in (o.get("ranks_short") or {}).items()
        )
        for op, o in m["ops"].items()
    )
    return (
        f"{fmt_bytes(m['bytes_per_rank_per_step'])} per rank per step "
        f"({fmt(m['vs_analytic'], '{:.3f}')} x analytic) by {m['method']} over {m['steps']} step(s), "
        f"{m['ranks_traced']} rank(s) traced"
        + (f" (the others: {m['untraced_reason']})" if m.get("untraced_reason") else "")
        + f"; traced steps {fmt(m.get('trace_cost'), '{:+.0%}')} vs measured: "
        + (ops or "bytes on the wire only, no op or time per collective")
        + (
            "; on the wire "
            + ", ".join(f"rank {r} {fmt_bytes(b)}" for r, b in m["wire_sent_bytes_per_step"].items())
            if ops and m.get("wire_sent_bytes_per_step")
            else ""
        )
        + (
            f" ({m['connections_closed']} connection(s) closed while traced: their bytes are missing)"
            if m.get("connections_closed")
            else ""
        )
    )


def incident_text(incident: dict | None) -> str | None:
    """A failure after every rank had measured (the run stays ok), in one line."""
    if not incident:
        return None
    where = f"{incident['status']} in the {incident['phase']}, rank {incident.get('rank')}"
    return f"{where}: {incident.get('message')}"


def print_summary(record: dict, stream=None) -> None:
    """A short human summary of one run record."""
    cfg, s, env = run_config(record), record["summary"], record["environment"]
    topo = cfg.topology
    console = Console(file=stream or sys.stdout, width=100)
    if "step_time_s" not in s:  # the figures could not be derived; the raw rank records are in the record
        console.print(f"status {record['status']}; no summary: {s.get('error')}", markup=False)
        return
    title = (
        f"{record['backend_info']['label']} · {cfg.model.workload} · {topo.world_size} x {topo.device} "
        f"workers · {cfg.model.precision} · status {record['status']}"
    )
    table = Table(title=title, show_header=False, title_justify="left")
    t = s["step_time_s"]
    global_seq = cfg.batch.micro_batch * cfg.batch.grad_accum * cfg.topology.world_size
    step_ms = {q: fmt(t[q] and t[q] * 1e3, "{:.1f}") for q in ("median", "p10", "p90")}
    t_compute_ms = fmt(s["t_compute_s"] and s["t_compute_s"] * 1e3, "{:.1f}")
    rows = [
        (
            "device",
            f"{env['device_kind']} ({cfg.topology.threads_per_worker} thread(s)/worker)"
            if cfg.topology.device == "cpu"
            else str(env["device_kind"]),
        ),
        (
            "global batch",
            f"{cfg.batch.micro_batch} x {cfg.batch.grad_accum} accum x {cfg.topology.world_size} ranks = "
            f"{global_seq} seq x {cfg.model.spec.seq_len} tok",
        ),
        (
            "step time (median [p10, p90])",
            f"{step_ms['median']} ms [{step_ms['p10']}, {step_ms['p90']}] over {t['n']} steps",
        ),
        (
            "first step (warm-up)",
            f"{fmt(s.get('first_step_s'), '{:.2f}')} s, slowest rank: compilation and first allocations, "
            "in no statistic",
        ),
        (
            "throughput",
            f"{fmt(s['throughput_tokens_per_s'], '{:,.0f}')} tokens/s "
            f"({fmt(s['per_device_tokens_per_s'], '{:,.0f}')} per device)",
        ),
        ("loss first -> last", f"{fmt(s['loss_first'], '{:.4f}')} -> {fmt(s['loss_last'], '{:.4f}')}"),
        (
            "exposed comm ratio",
            f"{exposed_text(s)} "
            f"(t_compute {t_compute_ms} ms by {s['compute_method']}: {s.get('t_compute_detail')})",
        ),
        ("step anatomy", anatomy_text(s.get("anatomy"))),
        (
            "comm per rank per step",
            f"{fmt_bytes(s['comm_bytes_per_rank_per_step'])} ({s['comm_volume_method']}); "
            f"volume / exposed time {fmt_bytes(s['volume_per_exposed_s'])}/s (not a bus bandwidth)",
        ),
        ("comm measured (trace)", measured_comm_text(s.get("comm_measured"))),
        (
            "peak memory per rank",
            f"RSS {fmt_bytes(s['peak_rss_bytes'])}; allocated {fmt_bytes(s['peak_allocated_bytes'])}; "
            f"reserved {fmt_bytes(s['peak_reserved_bytes'])}",
        ),
        (
            "model state per rank",
            f"{fmt_bytes(s['model_state_bytes_per_rank'])} measured vs "
            f"{fmt_bytes(s['model_state_bytes_analytic'])} analytic",
        ),
        (
            "MFU",
            f"{fmt(s['mfu'], '{:.1%}')} of the {s['device_peak_precision']} peak"
            if s["mfu"] is not None
            else "n/a (device peak unknown)",
        ),
        (
            "data",
            f"{fmt(s.get('data_prep_s') and s['data_prep_s'] * 1e3, '{:.2f}')} ms per step to prepare, "
            "before the step's clock starts",
        ),
        (
            "host page faults",
            f"{fmt(s.get('minor_faults_per_step'), '{:,.1f}')} minor faults per step (slowest rank)",
        ),
    ]
    tuned = record["backend_info"].get("tuned")
    if tuned:
        rows.insert(
            1,
            (
                "tuned set (--tuned)",
                "; ".join(
                    f"{name}={setting['value']}"
                    + (
                        ""
                        if setting["value"] == setting["tuned_value"]
                        else f" (tuned: {setting['tuned_value']})"
                    )
                    + (" [numerics]" if setting["numerics"] else "")
                    for name, setting in tuned.items()
                ),
            ),
        )
    if s.get("cpu_oversubscribed"):
        o = s["cpu_oversubscribed"]
        rows.append(
            (
                "CPU OVERSUBSCRIBED",
                f"{o['workers_per_node']} workers x {o['threads_per_worker']} thread(s) on "
                f"{o['cpus']} CPU(s): step times include the contention",
            )
        )
    if record.get("test_hooks"):  # never a real measurement: a fault or a slowdown injected on purpose
        rows.insert(0, ("TEST HOOKS (not a real run)", json.dumps(record["test_hooks"], sort_keys=True)))
    if record.get("error"):
        err = record["error"]
        rows.append(("error", f"rank {err.get('rank')}: {err.get('message')}"))
    # After every rank had measured: the figures stand, the trace may not.
    if incident := incident_text(record.get("incident")):
        rows.append(("INCIDENT (after the measured steps)", incident))
    for k, v in rows:
        table.add_row(escape(k), escape(v))
    console.print(table)
    for what in ("error", "incident"):
        if record.get(what) and record[what].get("log_tail"):
            console.print(f"[bold]last log lines of rank {record[what].get('rank')}:[/bold]")
            console.print("\n".join(record[what]["log_tail"]), markup=False, highlight=False)
