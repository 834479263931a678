"""RunConfig: everything that defines one run, resolved by the harness and handed to every worker as JSON.

The lowest layer of the project with workloads/: the harness, the adapters and the workers all import it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from workloads.spec import ModelSpec

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cuda", "cpu")
COMPUTE_METHODS = ("auto", "no_sync", "isolated", "none")
# The collectives `harness commbench` measures, by the names nccl-tests and torch.distributed share.
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
COMMBENCH_DTYPES = {"fp32": 4, "bf16": 2}  # element bytes


class InvalidConfig(ValueError):
    """A configuration that cannot run as asked (an adapter's validate() says why); the harness reports it
    as a usage error before anything launches."""


@dataclass
class RunConfig:
    backend: str
    workload: str  # preset name the spec came from (overrides already applied in `spec`)
    spec: ModelSpec
    world_size: int  # ranks = devices (or CPU workers), over all nodes (the CLI's --gpus)
    device: str  # resolved: "cuda" or "cpu"
    precision: str = "fp32"
    tf32: bool = False
    """Let fp32 matmuls and convolutions run as TF32 (--tf32; fp32 runs only), in every framework alike,
    where the GPU has it. Off, fp32 is IEEE fp32 in every framework (core.precision): off by default because
    the frameworks' own defaults differ (PyTorch off, TensorFlow and Paddle on), which would compare other
    maths under one flag."""
    micro_batch: int = 8  # sequences per rank per micro-step
    grad_accum: int = 1
    steps: int = 20  # measured steps
    warmup: int = 3  # excluded from every statistic
    compute_steps: int = 5  # sync-off steps for t_compute (no_sync method), after the measured ones
    compute_method: str = "auto"  # auto -> the backend's preferred method
    isolated_repeats: int = 2  # launches of the isolated counterfactual, one after the other
    trace_comm: bool = True  # profile `trace_steps` steps after the measured ones for the collective trace
    trace_steps: int = 2
    threads_per_worker: int = 1
    seed: int = 0
    data_path: str | None = None
    activation_checkpointing: bool = False
    scaling: str = "weak"  # how the batch was chosen (recorded for sweeps/compare)
    timeout_s: float = 900.0
    collective_timeout_s: float | None = None  # a collective's wait for a missing peer; None: timeout_s
    backend_options: dict = field(default_factory=dict)
    # The interpreter the launcher and the workers run under: the backend's own environment where its
    # stack's pinned wheels cannot share one with the others (backends.interpreter says how it is chosen).
    # None: the harness's own (records written before it was recorded).
    python: str | None = None
    # Multi-node: this harness invocation starts the launcher of node `node_rank` of `nodes`, each with
    # gpus / nodes workers; ranks meet at master_addr (port chosen by the harness or given).
    nodes: int = 1
    gpus_per_node: int = 0  # ranks per node; 0: world_size / nodes
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    hosts: list = field(default_factory=list)  # one hostname per node, when known
    # This harness only starts the ranks on `hosts` (an MPIJob's launcher pod): no rank runs here.
    launcher_only: bool = False
    # Set only for the isolated counterfactual: this worker runs alone (world 1) on data shard
    # `isolated_index` of the real N-rank run.
    isolated_index: int | None = None
    dump_weights: bool = False  # rank 0 saves its final weights (neutral names) for equivalence tests
    # Set for `harness commbench`: the workers time collectives (CommbenchSpec's fields) instead of training.
    commbench: dict | None = None

    def __post_init__(self):
        if not self.gpus_per_node:
            self.gpus_per_node = self.world_size // self.nodes

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.spec.seq_len

    @property
    def collective_timeout(self) -> float:
        """Seconds a rank waits in a collective for a peer that never comes (a hung or dead rank) before
        it fails: every framework's own collective timeout is set from this."""
        return self.collective_timeout_s or self.timeout_s

    @property
    def local_procs(self) -> int:
        """Worker processes this node's launcher starts (1 for an isolated-counterfactual worker)."""
        return 1 if self.isolated_index is not None else self.gpus_per_node

    @property
    def process_group_size(self) -> int:
        """Ranks taking part in collectives: 1 for an isolated-counterfactual worker."""
        return 1 if self.isolated_index is not None else self.world_size

    @property
    def first_local_rank(self) -> int:
        """The global rank of this node's first rank."""
        return self.node_rank * self.gpus_per_node

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["spec"] = self.spec.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        d = migrate_config(d)
        d["spec"] = ModelSpec(**d["spec"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)


@dataclass(frozen=True)
class CommbenchSpec:
    """What `harness commbench` measures: every op at every size, each timed `iters` times after `warmup`
    untimed calls, on every rank."""

    ops: tuple[str, ...]
    """Collectives, by COLLECTIVE_OPS' names, in the order they run."""
    sizes: tuple[int, ...]
    """Message sizes in bytes, as nccl-tests counts them: the whole buffer of all_reduce and broadcast, the
    gathered output of all_gather, the input that reduce_scatter splits, each rank's send buffer of
    all_to_all. Multiples of world size x element bytes, so every rank's share is whole."""
    dtype: str = "fp32"
    """Element type, a key of COMMBENCH_DTYPES."""
    iters: int = 20
    """Timed calls per op and size; the figures are medians over them."""
    warmup: int = 5
    """Untimed calls first (connection set-up, buffer registration, algorithm selection)."""

    @property
    def element_bytes(self) -> int:
        return COMMBENCH_DTYPES[self.dtype]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ops": list(self.ops), "sizes": list(self.sizes)}

    @classmethod
    def from_dict(cls, d: dict) -> CommbenchSpec:
        """From a record's config; settings this version no longer has (`under_load`, from records that
        also timed calls beside a compute thread) are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **{k: v for k, v in d.items() if k in known}
            | {"ops": tuple(d["ops"]), "sizes": tuple(d["sizes"])}
        )


def migrate_config(d: dict) -> dict:
    """A config as written by any earlier version, in today's names (record schema 1 called the world
    size `gpus` and had no `gpus_per_node`)."""
    d = dict(d)
    if "gpus" in d and "world_size" not in d:
        d["world_size"] = d.pop("gpus")
    d.setdefault("gpus_per_node", d["world_size"] // d.get("nodes", 1))
    return d
