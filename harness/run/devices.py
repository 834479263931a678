"""Which devices a run has and which physical device each rank and each isolated worker gets.

Decided here once, from nvidia-smi and the user's CUDA_VISIBLE_DEVICES (no framework is imported), and
handed to the adapters as physical ids (see backends/base.py: the device contract).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from core.config import RunConfig
from harness.usage import UsageError


def visible_mask() -> list[str] | None:
    """The user's CUDA_VISIBLE_DEVICES as a list of ids, or None when it is not set."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if mask is None else [v.strip() for v in mask.split(",") if v.strip()]


def gpu_query(fields: tuple[str, ...]) -> list[str]:
    """The nvidia-smi command that lists `fields` (its --query-gpu names) for every GPU, a CSV line each."""
    return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"]


def query_gpus(fields: tuple[str, ...] = ("name",)) -> list[dict[str, str]]:
    """`fields` of every GPU this machine has (CUDA_VISIBLE_DEVICES not applied), as nvidia-smi reports them
    ("memory.total" -> "143771 MiB"); [] without nvidia-smi or when it fails (no driver, no GPU). The one
    place the harness asks nvidia-smi about GPUs: runs, `harness doctor` and `harness env` read it."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(gpu_query(fields), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    rows = [[cell.strip() for cell in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    return [dict(zip(fields, row)) for row in rows if len(row) == len(fields)]


def visible_gpus() -> list[str]:
    """GPU names from nvidia-smi, honouring CUDA_VISIBLE_DEVICES."""
    names = [gpu["name"] for gpu in query_gpus(("name",))]
    mask = visible_mask()
    return names if mask is None else names[: len(mask)]


def resolve_device(requested: str, per_node: int) -> str:
    """auto -> cuda when a GPU is visible here, else cpu; cuda needs `per_node` GPUs visible."""
    gpus = visible_gpus()
    device = ("cuda" if gpus else "cpu") if requested == "auto" else requested
    if device == "cuda" and per_node > len(gpus):
        raise UsageError(
            f"--gpus {per_node} but {len(gpus)} GPU(s) visible; use --gpus <= {len(gpus)} "
            "(per node) or --device cpu"
        )
    return device


def node_devices(cfg: RunConfig) -> list[str]:
    """The physical GPU ids of this node's ranks, in local-rank order: the first gpus_per_node ids of the
    user's mask, or 0..gpus_per_node-1 without one (every node is given the same ids). Empty on CPU."""
    if cfg.topology.device != "cuda":
        return []
    mask = visible_mask()
    ids = mask if mask else [str(i) for i in range(cfg.topology.gpus_per_node)]
    if len(ids) < cfg.topology.gpus_per_node:
        raise UsageError(
            f"CUDA_VISIBLE_DEVICES={','.join(ids)} shows {len(ids)} GPU(s) for {cfg.topology.gpus_per_node} "
            "ranks per node"
        )
    return ids[: cfg.topology.gpus_per_node]


def isolated_devices(cfg: RunConfig, index: int) -> list[str]:
    """The device of isolated worker `index`: the one its rank used (a global rank of this node)."""
    devices = node_devices(cfg)
    return [devices[index - cfg.first_local_rank]] if devices else []
