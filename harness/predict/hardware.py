"""Hardware profiles: what a device and its interconnect can do, as data, and what a collective costs there.

A catalogue profile (profiles/*.yaml) holds published constants, each a [low, nominal, high] range of what is
achieved, with its sources. The `local` profile is this machine as `harness commbench` measured it: a
collective's time is read off the commbench record of the same stack and rank count, never extrapolated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from core.records import run_config
from harness.analyze.collectives import call_time, summarize_commbench
from harness.predict import nccl
from harness.usage import UsageError, choice

PROFILE_DIR = Path(__file__).with_name("profiles")
CORNERS = ("fast", "nominal", "slow")  # the inputs' best case, their nominal values, their worst case
# A GPU's compute slowed while a collective runs beside it, as a fraction of the overlapped time, where a
# profile does not say: measured 18.9% on average and 40.0% at most (Lee et al. 2025, arXiv 2507.03114), the
# fast end none; the catalogue's profiles state the same range with its source.
OVERLAP_SLOWDOWN = (0.0, 0.189, 0.40)


class ProfileError(ValueError):
    """A profile that cannot be loaded or cannot answer (a usage error for the CLI)."""


def catalogue() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def pick(values, corner: str, larger_is_faster: bool = True) -> float:
    """A [low, nominal, high] range's value at a corner: the fast corner takes whichever end is faster."""
    low, nominal, high = values if isinstance(values, (list, tuple)) else (values,) * 3
    if corner == "nominal":
        return float(nominal)
    fast = high if larger_is_faster else low
    slow = low if larger_is_faster else high
    return float(fast if corner == "fast" else slow)


@dataclass
class Profile:
    """One kind of node and its network. Bandwidths are bus bandwidths in the nccl-tests sense."""

    name: str
    description: str
    device: str  # "cuda" or "cpu"
    device_name: str | None
    gpus_per_node: int
    memory_bytes: float | None
    peak_flops: dict = field(default_factory=dict)
    hbm_Bps: list | None = None
    intra_node: dict = field(default_factory=dict)
    inter_node: dict = field(default_factory=dict)
    gpu_arch: str = "hopper"  # which of NCCL's per-architecture caps apply: "ampere" or "hopper"
    latency_scale: list = field(default_factory=lambda: [1.0, 1.0, 1.0])  # x NCCL's own latencies
    overlap_slowdown: list = field(default_factory=lambda: list(OVERLAP_SLOWDOWN))
    step_cv: list = field(default_factory=lambda: [0.005, 0.01, 0.02])
    sources: list = field(default_factory=list)
    commbench: dict = field(default_factory=dict)  # local: {world_size: commbench summary} of one stack
    path: str | None = None

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "commbench"}
        d["commbench_world_sizes"] = sorted(self.commbench)
        return d

    def nodes(self, world: int) -> int:
        return math.ceil(world / self.gpus_per_node)

    def busbw(self, world: int, corner: str) -> float:
        """Achieved ring/Simple bus bandwidth. Inside a node NVLink's; across nodes each ring leaves a node
        through one NIC and the node's rings share its NICs, so busbw = min(NVLink's, the node's egress =
        GPUs x NIC), less what the fabric loses as it grows: `scale_loss_per_doubling` of it for every
        doubling of nodes beyond 4 (published nccl-tests series at 4 to 512 nodes, in the profile)."""
        intra = pick(self.intra_node["busbw_Bps"], corner)
        nodes = self.nodes(world)
        if nodes == 1:
            return intra
        return min(intra, self.network_busbw(world, corner)) * self.scale_factor(nodes, corner)

    def network_busbw(self, world: int, corner: str) -> float:
        """A node's egress as bus bandwidth: GPUs x NIC. Where the profile says its leaf switches are
        oversubscribed (`inter_node.oversubscription`: `ratio` o of a leaf's bandwidth down to its nodes
        over its bandwidth up to the spine, and `nodes_per_leaf` S on one rail's leaf), a job of more than S
        nodes placed contiguously sends, per leaf group and rail, one ring hop and a few tree edges through
        the spine, which the uplinks (S/o nodes' bandwidth) carry at full rate while o is a few times below
        S; placed across leaf groups among other jobs, every hop can cross the spine and gets 1/o of a NIC.
        The slow corner takes that placement, the nominal and fast ones the contiguous placement."""
        egress = self.gpus_per_node * pick(self.inter_node["nic_Bps_per_gpu"], corner)
        fabric = self.inter_node.get("oversubscription")
        if fabric and corner == "slow" and self.nodes(world) > fabric["nodes_per_leaf"]:
            egress /= float(fabric["ratio"])
        return egress

    def scale_factor(self, nodes: int, corner: str) -> float:
        """What the fabric keeps of its bandwidth as it grows: 1 - `scale_loss_per_doubling` for every
        doubling of nodes beyond 4."""
        loss = self.inter_node.get("scale_loss_per_doubling")
        if not loss or nodes <= 4:
            return 1.0
        return (1 - pick(loss, corner, larger_is_faster=False)) ** math.log2(nodes / 4)

    def tree_network_busbw(self, world: int, corner: str) -> float:
        """What the network lets a tree of nodes (the tree, NVLSTree) carry: the node's NICs, twice them on
        two nodes, where NCCL's search raises a tree's in-node bandwidth up to twice the network's
        ("increase bwIntra for trees (2 nodes or collnet)", src/graph/search.cc) and tuning.cc prices two
        nodes at it ("On two nodes, NCCL uses the tree (or nvlstree) algorithm which can indeed go beyond the
        network bottleneck", a maintainer in NVIDIA/nccl-tests#196): each node sends and receives the buffer
        once across, where a ring sends 2(N-1)/N of it."""
        return self.network_busbw(world, corner) * (2 if self.nodes(world) <= 2 else 1)

    def tree_busbw(self, world: int, corner: str) -> float | None:
        """The tree's bus bandwidth where it is not the ring's: on two nodes min(NVLink's, twice the node's
        NICs) (`tree_network_busbw`). Else None (the ring's)."""
        if self.nodes(world) != 2:
            return None
        return min(pick(self.intra_node["busbw_Bps"], corner), self.tree_network_busbw(world, corner))

    def nvls_busbw(self, world: int, corner: str) -> float | None:
        """Achieved all_reduce bus bandwidth of NVLink SHARP where the profile has it
        (`intra_node.nvls_all_reduce_busbw_Bps`, measured on one full node), else None. In one node NVLS's;
        across nodes NVLSTree's: a node's switch reduces and its NICs carry one tree of nodes, so tuning.cc
        bounds it by the network, twice the network on two nodes ("Handle 2 node case of NVLSTree";
        `tree_network_busbw`), less what the fabric loses as it grows, as the ring's. Only for whole nodes:
        with 2-4 GPUs of a node NVLS measures the ring's bus bandwidth, 420-460 GB/s with 5-7
        (NVIDIA/nccl#1455), priced as the ring."""
        nvls = self.intra_node.get("nvls_all_reduce_busbw_Bps")
        nodes = self.nodes(world)
        if not nvls or world != nodes * self.gpus_per_node:
            return None
        bus = pick(nvls, corner)
        if nodes == 1:
            return bus
        return min(bus, self.tree_network_busbw(world, corner)) * self.scale_factor(nodes, corner)

    def priced(
        self, op: str, size_bytes: float, world: int, corner: str, latency_corner: str | None = None
    ) -> tuple[str | None, float]:
        """(how the call runs, its seconds) for one `op` of nccl-tests size `size_bytes` over `world` ranks:
        measured (commbench) on the local profile, no pair named; else NCCL's algorithm/protocol and time
        as it prices them (nccl.fastest: bandwidth at `corner`, latency at `latency_corner`, by default
        the same)."""
        if world == 1 or not size_bytes:
            return None, 0.0
        if self.commbench:
            return None, self.measured_call(op, size_bytes, world)
        scale = pick(self.latency_scale, latency_corner or corner, larger_is_faster=False)
        return nccl.fastest(
            op, size_bytes, world, self.gpus_per_node, self.busbw(world, corner), self.gpu_arch, scale,
            self.nvls_busbw(world, corner), self.tree_busbw(world, corner),
        )  # fmt: skip

    def collective_time(
        self, op: str, size_bytes: float, world: int, corner: str, latency_corner: str | None = None
    ) -> float:
        """Seconds for one `op` of `size_bytes` over `world` ranks (`priced`)."""
        return self.priced(op, size_bytes, world, corner, latency_corner)[1]

    def measured_call(self, op: str, size_bytes: float, world: int) -> float:
        summary = self.commbench.get(world)
        if summary is None:
            raise ProfileError(
                f"profile {self.name}: no commbench record at {world} ranks (have: "
                f"{', '.join(map(str, sorted(self.commbench)))}); run `harness commbench --gpus {world}`"
            )
        t = call_time(summary, op, size_bytes)
        if t is None:
            raise ProfileError(
                f"profile {self.name}: the commbench record at {world} ranks has no {op}, which this "
                f"stack's step issues; run `harness commbench` of that stack with `--gpus {world} --ops "
                f"{op.replace('_', '')}`"
            )
        return t

    def hbm(self, corner: str) -> float | None:
        return pick(self.hbm_Bps, corner) if self.hbm_Bps else None


# Every range a profile holds: (section or None for the top level, key, required). Each is a number or
# [low, nominal, high] with low <= nominal <= high, checked when the profile loads: a user's own profile
# (`--hardware path.yaml`) with a malformed range gets one line naming it, not a traceback mid-prediction.
RANGES = (
    (None, "hbm_Bps", False),
    ("intra_node", "busbw_Bps", True),
    ("intra_node", "nvls_all_reduce_busbw_Bps", False),
    ("inter_node", "nic_Bps_per_gpu", True),
    ("inter_node", "scale_loss_per_doubling", False),
    (None, "latency_scale", True),
    (None, "overlap_slowdown", True),
    (None, "step_cv", True),
)


def check_ranges(data: dict) -> None:
    """Raise ValueError naming the first range of `data` (a profile's YAML) that is not a number or an
    ordered [low, nominal, high] of numbers."""
    for section, key, required in RANGES:
        holder = data.get(section) if section else data
        value = holder.get(key) if isinstance(holder, dict) else None
        where = f"{section}.{key}" if section else key
        if value is None:
            if required:
                raise ValueError(f"{where} is missing")
            continue
        items = value if isinstance(value, list) else [value]
        try:  # YAML 1.1 reads 2.5e12 (no exponent sign) as a string: numbers as text are numbers here too
            values = [float(v) for v in items if not isinstance(v, bool)]
        except (TypeError, ValueError):
            values = []
        if len(values) != len(items) or len(values) not in (1, 3) or values != sorted(values):
            raise ValueError(f"{where} must be a number or [low, nominal, high] in order, not {value!r}")


def check_fabric(data: dict) -> None:
    """Raise ValueError if `inter_node.oversubscription`, where given, is not {ratio >= 1, nodes_per_leaf
    >= 1 whole}."""
    fabric = (data.get("inter_node") or {}).get("oversubscription")
    if fabric is None:
        return
    try:
        ratio, per_leaf = float(fabric["ratio"]), fabric["nodes_per_leaf"]
        ok = ratio >= 1 and isinstance(per_leaf, int) and not isinstance(per_leaf, bool) and per_leaf >= 1
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"inter_node.oversubscription must be {{ratio: >= 1, nodes_per_leaf: a whole number >= 1}}, "
            f"not {fabric!r}"
        )


def load_profile(name: str) -> Profile:
    """A catalogue profile by name, or a YAML file of the same shape by path."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else PROFILE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ProfileError(
            f"unknown hardware profile '{name}'; valid: {', '.join(catalogue())}, local, or a .yaml"
        )
    try:
        data = yaml.safe_load(path.read_text())
        check_ranges(data)
        check_fabric(data)
        return Profile(
            name=data["name"],
            description=data.get("description", ""),
            device="cuda",
            device_name=data.get("device_name"),
            gpus_per_node=int(data["gpus_per_node"]),
            memory_bytes=float(data["memory_bytes"]),
            peak_flops={k: float(v) for k, v in data["peak_flops"].items()},
            hbm_Bps=data.get("hbm_Bps"),
            intra_node=data["intra_node"],
            inter_node=data["inter_node"],
            gpu_arch=choice(data["gpu_arch"], tuple(nccl.LL_MAX_BUSBW_GBPS), "gpu_arch"),
            latency_scale=data["latency_scale"],
            overlap_slowdown=data["overlap_slowdown"],
            step_cv=data["step_cv"],
            sources=data.get("sources", []),
            path=str(path),
        )
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, UsageError) as exc:
        raise ProfileError(f"hardware profile {path}: {exc}") from None


def local_profile(commbench_records: list[dict], backend: str, cpus: int | None) -> Profile:
    """This machine, from commbench records of `backend` on one device (the newest record's; the latest
    record per rank count): collective times as measured, one node; compute comes from a calibration run
    on the same device, as no peak FLOP/s is known for a CPU."""
    mine = [r for r in commbench_records if r["config"]["backend"] == backend and r["status"] == "ok"]
    if not mine:
        others = sorted({r["config"]["backend"] for r in commbench_records})
        raise ProfileError(
            f"the local profile needs a commbench record of {backend} in --calibrate"
            + (f" (given: {', '.join(others)})" if others else "")
            + f"; run `harness commbench --backend {backend} --gpus 2`"
        )

    def started(record):
        return (record.get("environment") or {}).get("start_time") or ""

    def device_of(record):  # ("cpu", "cpu") or ("cuda", "NVIDIA H200")
        ranks = record.get("ranks") or [{}]
        return run_config(record).topology.device, ranks[0].get("device")

    mine.sort(key=started)
    here = device_of(mine[-1])  # the newest record's device; records of another are named, not mixed in
    used = [r for r in mine if device_of(r) == here]
    skipped = [r["run_id"] for r in mine if device_of(r) != here]
    by_world = {run_config(r).topology.world_size: summarize_commbench(r) for r in used}  # the latest per N
    device = here[0]
    unused = f"; not used, of another device: {', '.join(skipped)}" if skipped else ""
    return Profile(
        name="local",
        description=f"this machine as commbench measured {backend} ({here[1] or device}{unused})",
        device=device,
        device_name=here[1] if device == "cuda" else None,  # calibration runs must match it
        # one machine: every rank count commbench measured here is one node
        gpus_per_node=max(by_world) if device == "cuda" else max(cpus or 1, max(by_world)),
        memory_bytes=None,
        # On a CPU every core runs a worker's compute thread, so a collective's threads take CPU time
        # from compute: overlapping them buys nothing (slowdown 1: the overlapped time is added in full).
        # On a GPU the catalogue's range.
        overlap_slowdown=[1.0, 1.0, 1.0] if device == "cpu" else list(OVERLAP_SLOWDOWN),
        commbench=by_world,
        sources=[r["run_id"] for r in used],
    )
