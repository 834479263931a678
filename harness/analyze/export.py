"""Run records handed to the tools people already use: TensorBoard (per-step curves) and the
github-action-benchmark action (one value per configuration and figure, charted across commits).

TensorBoard's event files are written with the tensorboard package's own writer and protos. That writer
reaches for TensorFlow when it can import it (its file-system layer), and the harness imports no ML framework
(two in one process can crash); `tensorboard.compat.notf` is TensorBoard's own switch to its TensorFlow stub,
so it is set before the writer is first used.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pandas as pd

from core.records import run_config, write_atomic
from harness.analyze.analysis import GROUP_KEYS
from harness.analyze.metrics import per_step_series

sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))

from tensorboard.compat.proto.event_pb2 import Event  # noqa: E402
from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: E402
from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: E402

# The per-step curves, as TensorBoard tags: the run's measured steps (step 0 = the first after warm-up).
CURVES = {
    "loss": "loss",
    "step_time_s": "time/step_s",
    "tokens_per_s": "throughput/tokens_per_s",
}


def run_name(record: dict) -> str:
    """A run's folder in the TensorBoard log dir: its label, N and run id, so runs sort by configuration."""
    return f"{record['backend_info']['label']}-N{run_config(record).topology.world_size}-{record['run_id']}"


def write_tensorboard(records: list[dict], log_dir: Path) -> list[Path]:
    """One event file per run (ok runs; a failed run has no curves to show) under log_dir/<run_name>/;
    returns the run folders written."""
    written = []
    for record in records:
        if record.get("status") != "ok":
            continue
        folder = Path(log_dir) / run_name(record)
        folder.mkdir(parents=True, exist_ok=True)
        start = (record.get("environment") or {}).get("start_time")
        wall = pd.Timestamp(start).timestamp() if start else 0.0
        writer = EventFileWriter(str(folder))
        for key, series in per_step_series(record).items():
            for step, value in enumerate(series):
                value_proto = Summary.Value(tag=CURVES[key], simple_value=float(value))
                writer.add_event(Event(wall_time=wall, step=step, summary=Summary(value=[value_proto])))
        writer.close()
        written.append(folder)
    return written


# --------------------------------------------------------------------------------------- github-benchmark
# (figure column of the aggregate table, name shown, unit, scale); the action takes one direction per file
BIGGER_IS_BETTER = [
    ("throughput", "throughput", "tokens/s", 1.0),
    ("per_device_throughput", "throughput per device", "tokens/s", 1.0),
    ("efficiency", "scaling efficiency", "fraction", 1.0),
    ("mfu", "MFU", "fraction", 1.0),
]
SMALLER_IS_BETTER = [
    ("t_step_s", "step time", "ms", 1e3),
    ("peak_memory_bytes", "peak memory per rank", "MiB", 1 / 2**20),
    ("exposed_comm_ratio", "exposed communication", "fraction of step", 1.0),
]
TOOLS = {"customBiggerIsBetter": BIGGER_IS_BETTER, "customSmallerIsBetter": SMALLER_IS_BETTER}


def configuration_name(row: pd.Series) -> str:
    """The configuration's name (every GROUP_KEYS value: two configurations never share one), '/'-separated
    from broad to narrow, since dashboards group on it; a '/' inside a value is spelled 'per'."""
    parts = [row["workload"], row["device"], row["precision"], row["scaling"], row["batch"], row["settings"]]
    parts += [row["label"], f"N={row['world_size']}"]
    return "/".join(str(p).replace("/", " per ") for p in parts)


def github_benchmark(agg: pd.DataFrame, runs: pd.DataFrame) -> dict[str, list[dict]]:
    """{tool: entries} for github-action-benchmark: per configuration (GROUP_KEYS) and figure, the median
    over its ok repeats as `value`, their spread as `range` (throughput: min-max of the repeats) and the
    repeat count, backend sharding and commit in `extra`. Unmeasured figures (MFU on a CPU, say) are left
    out, never written as 0."""
    out: dict[str, list[dict]] = {tool: [] for tool in TOOLS}
    for _, row in agg.iterrows():
        name = configuration_name(row)
        members = runs[(runs[GROUP_KEYS] == row[GROUP_KEYS]).all(axis=1) & (runs["status"] == "ok")]
        commits = sorted({c for c in members["git_commit"].dropna()})
        extra = f"runs: {row['runs']} ok, {row['failed']} failed; sharding: {row['sharding']}" + (
            f"; commit {', '.join(c[:12] for c in commits)}" if commits else ""
        )
        for tool, figures in TOOLS.items():
            for column, figure, unit, scale in figures:
                value = row.get(column)
                if value is None or not math.isfinite(float(value)):
                    continue
                entry = {"name": f"{name} {figure}", "unit": unit, "value": float(value) * scale}
                if column in members.columns and members[column].notna().sum() > 1:  # not efficiency
                    lo, hi = members[column].min() * scale, members[column].max() * scale
                    entry["range"] = f"{lo:.6g} to {hi:.6g} over {row['runs']} runs"
                entry["extra"] = extra
                out[tool].append(entry)
    return out


def write_github_benchmark(agg: pd.DataFrame, runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    paths = []
    for tool, entries in github_benchmark(agg, runs).items():
        path = Path(out_dir) / f"{tool}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda tmp, entries=entries: tmp.write_text(json.dumps(entries, indent=1)))
        paths.append(path)
    return paths
