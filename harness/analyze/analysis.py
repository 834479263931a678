"""Cross-run figures: run records -> a tidy table (one row per run) -> one row per backend x N.

Per-run figures come from harness.analyze.metrics.summarize (recomputed from the raw rank records, so every
table uses the current definitions); this module only groups runs and compares them: median and spread over
repeats, speedup and scaling efficiency against N = 1, memory ratio, a noise flag, and the step's anatomy
(harness.analyze.anatomy) part by part: each part's median over repeats, unresolved where any repeat's is.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from core.records import config_key, device_name, run_config
from harness.analyze.anatomy import PARTS
from harness.analyze.metrics import summarize
from harness.analyze.summary import incident_text

# Runs in one group are repeats of the same measurement: the same core.records.ConfigKey. A context is a
# ConfigKey but its label and N: the runs whose speedup over N = 1 is defined (the same per-device batch for
# weak scaling, the same global batch for strong).
CONTEXT_KEYS = ["workload", "precision", "device", "scaling", "batch", "settings"]
GROUP_KEYS = ["label", *CONTEXT_KEYS, "world_size"]
DEFAULT_NOISE_CV = 0.10
RESOLVED = ("measured", "derived")


def anatomy_columns(anatomy: dict | None) -> dict:
    """A run's anatomy as flat columns, per part: anatomy_<part>_s (its seconds, an unresolved part's
    negative value kept), _share (of the step), _status (measured, derived, unresolved or n/a) and _why
    (how it was obtained, or why it is n/a)."""
    out: dict = {}
    for name in PARTS:
        p = (anatomy or {}).get("parts", {}).get(name) or {
            "s": None,
            "share": None,
            "status": "n/a",
            "method": "no measured step",
        }
        out |= {
            f"anatomy_{name}_s": p["s"] if p["s"] is not None else np.nan,
            f"anatomy_{name}_share": p["share"] if p["share"] is not None else np.nan,
            f"anatomy_{name}_status": p["status"],
            f"anatomy_{name}_why": p["method"],
        }
    return out


def anatomy_group(ok: pd.DataFrame) -> dict:
    """The anatomy of a group's ok repeats, part by part: median seconds and share over the repeats that have
    the part (as every per-run figure here); unresolved where any repeat's part is (its median kept, never
    a figure to conclude from), n/a where no repeat has it, derived where a repeat derived it."""
    out: dict = {}
    for name in PARTS:
        status = ok[f"anatomy_{name}_status"] if len(ok) else pd.Series(dtype=object)
        has = ok[status != "n/a"] if len(ok) else ok
        if not len(has):
            whole = "n/a"
        elif (status == "unresolved").any():
            whole = "unresolved"
        else:
            whole = "measured" if (has[f"anatomy_{name}_status"] == "measured").all() else "derived"
        why = ok[f"anatomy_{name}_why"] if whole == "n/a" else has[f"anatomy_{name}_why"]
        out |= {
            f"anatomy_{name}_s": median(has[f"anatomy_{name}_s"]) if len(has) else np.nan,
            f"anatomy_{name}_share": median(has[f"anatomy_{name}_share"]) if len(has) else np.nan,
            f"anatomy_{name}_status": whole,
            f"anatomy_{name}_why": why.iloc[0] if len(why) else "no ok run",
        }
    return out


def resolved_part(row, name: str) -> float | None:
    """A part's seconds in a group row (or a run row) where it may be concluded from, else None."""
    status = getattr(row, f"anatomy_{name}_status", None)
    seconds = getattr(row, f"anatomy_{name}_s", None)
    if status not in RESOLVED or seconds is None or np.isnan(seconds):
        return None
    return float(seconds)


def run_row(record: dict) -> dict:
    """One run as a flat row: what was run (the group keys) and its per-run figures."""
    cfg, env, info = run_config(record), record.get("environment", {}), record.get("backend_info", {})
    s = summarize(record)
    sweep = record.get("sweep") or {}
    error = record.get("error") or {}
    # Per-rank peak memory: the framework allocator's peak on a GPU; process RSS where there is none (CPU),
    # which includes the framework runtime, so CPU memory ratios stay near 1 by construction.
    allocated = s["peak_allocated_bytes"]
    key = config_key(record)
    over = s["cpu_oversubscribed"]
    return {
        "run_id": record["run_id"],
        "status": record["status"],
        "error": error.get("message"),
        "incident": incident_text(record.get("incident")),
        "sweep_id": sweep.get("id"),
        "repeat": sweep.get("repeat"),
        "backend": cfg.backend,
        "label": key.label,
        "variant": cfg.variant,
        "framework": info.get("framework"),
        "sharding": info.get("sharding"),
        "workload": key.workload,
        "precision": key.precision,
        "device": device_name(record),
        "device_type": cfg.topology.device,
        "host": env.get("harness_host"),
        "scaling": key.scaling,
        "batch": key.batch,
        "settings": key.settings,
        "world_size": key.world_size,
        "threads_per_worker": cfg.topology.threads_per_worker,
        # CPU workers x threads beyond the CPUs they may use (metrics.cpu_oversubscription): the step times
        # measure contention, and every table, plot and sentence built on this run says so
        "oversubscribed": over is not None,
        "cpus": over["cpus"] if over else np.nan,
        "steps": cfg.measurement.steps,
        "throughput": s["throughput_tokens_per_s"],
        "per_device_throughput": s["per_device_tokens_per_s"],
        "t_step_s": s["step_time_s"]["median"],
        "t_step_p10_s": s["step_time_s"]["p10"],
        "t_step_p90_s": s["step_time_s"]["p90"],
        "t_compute_s": s["t_compute_s"],
        "compute_method": s["compute_method"],
        "exposed_comm_ratio": s["exposed_comm_ratio"],
        "comm_bytes_per_rank": s["comm_bytes_per_rank_per_step"],
        "volume_per_exposed_s": s["volume_per_exposed_s"],
        "peak_memory_bytes": allocated if allocated is not None else s["peak_rss_bytes"],
        "peak_memory_source": "allocator" if allocated is not None else "rss",
        "model_state_bytes": s["model_state_bytes_per_rank"],
        "model_state_analytic": s["model_state_bytes_analytic"],
        "mfu": s["mfu"],
        "first_step_s": s["first_step_s"],
        "loss_first": s["loss_first"],
        "loss_last": s["loss_last"],
        "start_time": env.get("start_time"),
        "git_commit": (env.get("git") or {}).get("commit"),
        **anatomy_columns(s["anatomy"]),
    }


def runs_table(records: list[dict]) -> pd.DataFrame:
    """The tidy table: one row per run record, any status."""
    runs = pd.DataFrame([run_row(r) for r in records])
    if runs.empty:
        return runs
    # A run that failed before any rank reported its device is placed with the runs of the same host,
    # device type and threads, so a failed repeat counts against its own group.
    where = ["host", "device_type", "threads_per_worker"]
    known = runs.dropna(subset=["device"]).drop_duplicates(where).set_index(where)["device"].to_dict()
    guess = [known.get(key, key[1]) for key in runs[where].itertuples(index=False, name=None)]
    runs["device"] = runs["device"].fillna(pd.Series(guess, index=runs.index))
    return runs.sort_values([*GROUP_KEYS, "start_time"], kind="stable").reset_index(drop=True)


def median(values: pd.Series) -> float:
    values = values.dropna()
    return float(values.median()) if len(values) else np.nan


def group_row(runs: pd.DataFrame) -> pd.Series:
    """The figures of one backend x N over its repeats (ok runs only; failures are counted)."""
    ok = runs[runs["status"] == "ok"]
    tput = ok["throughput"].dropna()
    # Sample coefficient of variation over repeats: unknowable from one repeat (NaN, never "quiet").
    cv = float(tput.std(ddof=1) / tput.mean()) if len(tput) > 1 else np.nan
    return pd.Series(
        {
            "backend": runs["backend"].iloc[0],
            "variant": runs["variant"].iloc[0],  # part of the label: one per group
            "sharding": runs["sharding"].iloc[0],
            "runs": len(ok),
            "failed": len(runs) - len(ok),
            "threads_per_worker": runs["threads_per_worker"].iloc[0],
            # any repeat, failed ones too: a failure under contention is no verdict on the stack either
            "oversubscribed": bool(runs["oversubscribed"].any()),
            "cpus": runs["cpus"].min(),
            "throughput": median(tput),
            "throughput_min": tput.min() if len(tput) else np.nan,
            "throughput_max": tput.max() if len(tput) else np.nan,
            "throughput_cv": cv,
            "per_device_throughput": median(ok["per_device_throughput"]),
            "t_step_s": median(ok["t_step_s"]),
            # not a figure where any repeat's exposed part is unresolved (its sign beyond its noise)
            "exposed_comm_ratio": np.nan
            if (ok["anatomy_exposed_comm_status"] == "unresolved").any()
            else median(ok["exposed_comm_ratio"]),
            "volume_per_exposed_s": median(ok["volume_per_exposed_s"]),
            "comm_bytes_per_rank": median(ok["comm_bytes_per_rank"]),
            "peak_memory_bytes": median(ok["peak_memory_bytes"]),
            "peak_memory_source": ok["peak_memory_source"].iloc[0] if len(ok) else None,
            "model_state_bytes": median(ok["model_state_bytes"]),
            "model_state_analytic": median(ok["model_state_analytic"]),
            "mfu": median(ok["mfu"]),
            # what compiling (and first allocations) cost once per launch: the median launch's
            "first_step_s": median(ok["first_step_s"]),
            **anatomy_group(ok),
        }
    )


def aggregate(runs: pd.DataFrame, noise_cv: float = DEFAULT_NOISE_CV) -> pd.DataFrame:
    """One row per GROUP_KEYS: median throughput and spread over repeats, speedup and efficiency against
    the same backend's N = 1 row in the same context, memory ratio, model state vs analytic, and `noisy`
    where the repeats' coefficient of variation exceeds `noise_cv` (the median is then not trustworthy,
    and neither is any speedup computed from it: `speedup_noisy`); `oversubscribed` where a run of the group
    had more CPU workers x threads than `cpus` (its figures measure contention)."""
    if runs.empty:
        return pd.DataFrame(columns=GROUP_KEYS)
    groups = runs.groupby(GROUP_KEYS, sort=True, dropna=False)
    agg = pd.DataFrame([group_row(g) for _, g in groups], index=groups.size().index).reset_index()
    agg["noisy"] = agg["throughput_cv"] > noise_cv
    agg["oversubscribed"] = agg["oversubscribed"].astype(bool)
    agg["model_state_vs_analytic"] = agg["model_state_bytes"] / agg["model_state_analytic"]

    base = agg[agg["world_size"] == 1].set_index(["label", *CONTEXT_KEYS])
    keys = pd.MultiIndex.from_frame(agg[["label", *CONTEXT_KEYS]])
    base_tput = base["throughput"].reindex(keys).to_numpy(dtype=float)
    agg["speedup"] = agg["throughput"] / base_tput
    agg["efficiency"] = agg["speedup"] / agg["world_size"]
    agg["memory_ratio"] = agg["peak_memory_bytes"] / base["peak_memory_bytes"].reindex(keys).to_numpy(
        dtype=float
    )
    base_noisy = base["noisy"].reindex(keys).fillna(False).to_numpy(dtype=bool)
    agg["speedup_noisy"] = agg["noisy"].to_numpy(dtype=bool) | base_noisy
    return agg


def contexts(agg: pd.DataFrame) -> list[tuple[dict, pd.DataFrame]]:
    """The comparable slices of an aggregate table: same workload, precision, device, scaling and batch."""
    return [
        (dict(zip(CONTEXT_KEYS, key)), g.reset_index(drop=True))
        for key, g in agg.groupby(CONTEXT_KEYS, sort=True, dropna=False)
    ]
