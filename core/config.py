"""RunConfig: everything that defines one run, resolved by the harness and handed to every worker as JSON.

The lowest layer of the project with workloads/: the harness, the adapters and the workers all import it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING, dataclass, field

from core.commbench_spec import CommbenchSpec
from workloads.spec import PRESETS, ModelSpec

PRECISIONS = ("fp32", "bf16", "fp16")
# A stack's settings as its options' defaults give them, or as its own experts set them (`--tuned`: each
# adapter's `tuned()` says which settings and why, backends.base.Tuned).
VARIANTS = ("default", "tuned")
DEVICES = ("auto", "cuda", "cpu")
COMPUTE_METHODS = ("auto", "no_sync", "isolated", "none")
SCALINGS = ("weak", "strong")  # BatchConfig.scaling


# What a flag's metadata holds where its field's flag() does not say (flag() says what each means).
FLAG_DEFAULTS = {
    "parse": None,
    "valid": None,
    "choices": None,
    "action": None,
    "metavar": None,
    "group": None,
    "default": MISSING,
    "required": False,
}


def flag(name: str, help: str, **given) -> dict:
    """The command-line flag that sets a field, as the field's metadata: declared here once, beside the
    field and its default, and turned into the argparse option of every verb that takes it and back into
    a command line by harness.arguments (as backends.base.option declares a stack's own).

    `parse`: the name of the argparse type in harness.arguments.parsers ("positive", "seconds", ...; none:
    the text itself), named because core imports nothing of the harness. `valid`: the values the harness
    accepts, checked where it builds the config so the usage error names them; `choices`: the same, checked
    by argparse. `action`: "store_true", "boolean" (--x and --no-x) or "append". `metavar`: the value's
    name in the help. `group`: the help section ("multi-node", "testing"). `default`: the flag's own where
    it differs from the field's: None where a flag not given leaves the value to the harness (a derived or
    resolved value, which the help says). `required`: a flag every run gives. `help` may name {default}
    (the field's), {backends}, {remote_launchers} and {master_port}, which only the harness knows."""
    unknown = sorted(set(given) - set(FLAG_DEFAULTS))
    if unknown:
        raise TypeError(f"flag {name}: no {', '.join(unknown)}")
    return {"flag": name, "help": help, **FLAG_DEFAULTS, **given}


def setting(value, name: str, help: str, **given):
    """A field, its default `value` (`list`: a fresh empty list each) and the flag that sets it (flag()), as
    backends.base.option declares a stack's option."""
    if value is list:
        return field(default_factory=list, metadata=flag(name, help, **given))
    return field(default=value, metadata=flag(name, help, **given))


def node_setting(value, name: str, help: str, **given):
    """A multi-node setting: in the help's multi-node section and, not given, worked out from the layout; a
    count (a positive integer) unless `parse` says otherwise."""
    return setting(value, name, help, group="multi-node", **{"default": None, "parse": "positive", **given})


class InvalidConfig(ValueError):
    """A configuration that cannot run as asked (an adapter's validate() says why); the harness reports it
    as a usage error before anything launches."""


@dataclass
class ModelConfig:
    """What is trained: the same model, numerics and initial weights on every stack it is compared on."""

    workload: str = field(
        metadata=flag("--workload", f"preset: {', '.join(PRESETS)}", valid=tuple(PRESETS), default="tiny")
    )
    """The preset the spec came from (`--workload`); the overrides are already applied in `spec`."""
    spec: ModelSpec
    """The framework-free model every stack builds (workloads.spec)."""
    precision: str = setting("fp32", "--precision", ", ".join(PRECISIONS), valid=PRECISIONS)
    """Compute precision, one of PRECISIONS; master weights and the optimizer stay fp32 (core.precision)."""
    tf32: bool = setting(
        False,
        "--tf32",
        "fp32 runs: let fp32 matmuls and convolutions run as TF32 in every framework (default: IEEE fp32 "
        "everywhere, whatever each framework's own default)",
        action="store_true",
    )
    """Let fp32 matmuls and convolutions run as TF32 (--tf32; fp32 runs only), in every framework alike,
    where the GPU has it. Off, fp32 is IEEE fp32 in every framework (core.precision): off by default because
    the frameworks' own defaults differ (PyTorch off, TensorFlow and Paddle on), which would compare other
    maths under one flag."""
    activation_checkpointing: bool = setting(
        False,
        "--activation-checkpointing",
        "recompute each block's activations in the backward pass: less memory, about a third more compute",
        action="store_true",
    )
    """Recompute each block's activations in the backward pass: less memory, about a third more compute."""
    seed: int = setting(0, "--seed", "seeds the initial weights and the synthetic data", parse="int")
    """Seeds the initial weights and the synthetic data, identically in every framework."""


@dataclass
class BatchConfig:
    """How much data one step consumes, and from where."""

    micro_batch: int = setting(
        8,
        "--micro-batch",
        "sequences per rank per micro-step (default {default}); max: the largest that fits a GPU, from the "
        "memory model, confirmed by a short probe that backs off on out-of-memory",
        parse="positive_or_max",
        default=None,
    )
    """Sequences per rank per micro-step."""
    grad_accum: int = setting(
        1,
        "--grad-accum",
        "micro-steps per optimizer step (default {default}, unless derived from --global-batch)",
        parse="positive",
        default=None,
    )
    """Micro-steps per optimizer step; gradients are reduced once per step."""
    scaling: str = setting(
        "weak",
        "--scaling",
        "weak: fixed per-device batch (default); strong: fixed global batch split over N",
        choices=SCALINGS,
        default=None,
    )
    """How the batch was chosen across world sizes ("weak": fixed per rank; "strong": fixed global), recorded
    so sweeps and `harness compare` pair like with like."""
    data_path: str | None = setting(
        None,
        "--data",
        "flat token file (memory-mapped; uint16, uint32 where the vocabulary is above 65,536) instead of "
        "synthetic tokens",
    )
    """A token file to read instead of synthetic data (workloads.data)."""


@dataclass
class MeasurementConfig:
    """How the step is timed and what is measured beside it (docs/measurement.md)."""

    steps: int = setting(20, "--steps", "measured steps", parse="positive")
    """Measured steps: every statistic is over these."""
    warmup: int = setting(3, "--warmup", "steps run first and excluded from statistics", parse="non_negative")
    """Steps run first and excluded from every statistic (allocator, autotuning, compilation)."""
    compute_steps: int = setting(
        5, "--compute-steps", "sync-off steps for t_compute (no_sync method)", parse="non_negative"
    )
    """Steps with gradient sync off that time t_compute (the no_sync method), after the measured ones."""
    anatomy_steps: int = setting(
        3,
        "--anatomy-steps",
        "steps after the measured ones whose forward, backward and optimizer are each timed between device "
        "synchronisations, for the step's anatomy (0: none)",
        parse="non_negative",
    )
    """Steps that time the parts of a step (backends.loop.anatomy_steps), in the launch that measures
    t_compute: sync off where the stack can switch it off, alone in an isolated worker or a 1-rank run."""
    compute_method: str = setting(
        "auto",
        "--compute-method",
        f"{', '.join(COMPUTE_METHODS)}: how t_compute is measured",
        valid=COMPUTE_METHODS,
    )
    """How t_compute is measured, one of COMPUTE_METHODS; auto: the backend's preferred method."""
    isolated_repeats: int = setting(
        2,
        "--isolated-repeats",
        "launches of the isolated counterfactual (isolated method), one after the other",
        parse="positive",
    )
    """Launches of the isolated counterfactual (one rank alone), one after the other."""
    trace_comm: bool = setting(
        True,
        "--trace-comm",
        "after the measured steps, profile --trace-steps more with the stack's own instrument for the "
        "collective trace: measured bytes, time and compute overlap per op (default on)",
        action="boolean",
    )
    """Profile `trace_steps` steps after the measured ones for the collective trace."""
    trace_steps: int = setting(
        2, "--trace-steps", "steps profiled for the collective trace", parse="positive"
    )
    """Steps the collective trace covers."""
    timeout_s: float = setting(900.0, "--timeout", "seconds before the whole run is killed", parse="seconds")
    """Wall-clock limit of the whole run; past it every rank is killed and the run recorded as timed out."""
    collective_timeout_s: float | None = setting(
        None,
        "--collective-timeout",
        "seconds a collective waits for a dead or hung peer before the ranks give up (default: --timeout)",
        parse="seconds",
    )
    """A collective's wait for a missing peer before it fails; None: timeout_s."""


@dataclass
class TopologyConfig:
    """Where the ranks run and how they meet."""

    world_size: int = field(
        metadata=flag(
            "--gpus",
            "ranks in all: GPUs, or CPU workers without a GPU (default: nodes x --gpus-per-node, else 1)",
            parse="positive",
            default=None,
        )
    )
    """Ranks = devices (or CPU workers), over all nodes (the CLI's --gpus)."""
    device: str = field(
        metadata=flag(
            "--device",
            f"{', '.join(DEVICES)} (auto: cuda if a GPU is visible)",
            valid=DEVICES,
            default="auto",
        )
    )
    """Resolved: "cuda" or "cpu"."""
    nodes: int = node_setting(1, "--nodes", "machines taking part (default: the number of hosts, else 1)")
    """Nodes; this harness invocation starts the launcher of node `node_rank` (gpus_per_node ranks each)."""
    gpus_per_node: int = node_setting(
        0, "--gpus-per-node", "ranks per node (default: --gpus / --nodes, or the hostfile's slots)"
    )
    """Ranks per node; 0: world_size / nodes."""
    node_rank: int = node_setting(
        0, "--node-rank", "this node's index (default: this host's place in the hosts)", parse="int"
    )
    """The node this invocation launches."""
    master_addr: str = node_setting(
        "127.0.0.1",
        "--master",
        "where the ranks meet (default: the first host, port {master_port}; a one-node run picks a free "
        "local port per run)",
        parse=None,
        metavar="ADDR[:PORT]",
    )
    """Where the ranks meet (rendezvous)."""
    master_port: int | None = None
    """The rendezvous port; None: chosen by the harness. Set with master_addr by --master ADDR:PORT."""
    hosts: list = node_setting(
        list, "--hosts", "comma-separated host names, one per node, node 0 first", parse=None
    )
    """One hostname per node, when known."""
    launcher_only: bool = setting(
        False,
        "--launcher-only",
        "this harness only starts the ranks on the hosts (an MPIJob's launcher pod, which has no GPU of its "
        "own): the device is the hosts', given as --device cuda or cpu and not checked here; for backends "
        "whose launcher reaches the other hosts ({remote_launchers}), with --compute-method none",
        action="store_true",
        group="multi-node",
    )
    """This harness only starts the ranks on `hosts` (an MPIJob's launcher pod): no rank runs here."""
    threads_per_worker: int = setting(
        1,
        "--threads-per-worker",
        "CPU threads per worker (default: cores / gpus)",
        parse="positive",
        default=None,
    )
    """Intra-op threads of each CPU worker, fixed and recorded (CPU runs)."""
    python: str | None = setting(
        None,
        "--python",
        "the interpreter the launcher and workers run under, e.g. a venv of the backend's own stack; "
        "BACKEND=PATH names one backend (a sweep of several); default: $DISTBENCH_PYTHON_<BACKEND>, else "
        ".venvs/<stack>/bin/python (./setup.sh --stack), else the harness's own",
        action="append",
        metavar="[BACKEND=]PATH",
    )
    """The interpreter the launcher and the workers run under: the backend's own environment where its
    stack's pinned wheels cannot share one with the others (backends.interpreter says how it is chosen).
    None: the harness's own."""

    def __post_init__(self):
        if not self.gpus_per_node:
            self.gpus_per_node = self.world_size // self.nodes


@dataclass
class RoleConfig:
    """What this worker does, set by the harness and never by a user: a training rank of the run (the
    default), one rank of the isolated counterfactual, or a commbench worker."""

    isolated_index: int | None = None
    """Set only for the isolated counterfactual: this worker runs alone (world 1) on data shard
    `isolated_index` of the real N-rank run."""
    dump_weights: bool = setting(
        False,
        "--dump-weights",
        "rank 0 saves its final weights in the log dir",
        action="store_true",
        group="testing",
    )
    """Rank 0 saves its final weights (neutral names), for the equivalence tests."""
    commbench: dict | None = None
    """Set for `harness commbench`: the workers time collectives (CommbenchSpec's fields) instead of
    training."""
    trace_launch: str = "inline"
    """Where the collective trace is taken: "inline", in the traced phase after the measured steps of the
    same launch; or, for a stack whose instrument costs time from the moment it is enabled
    (Backend.traces_in_own_launch), "untraced" in the launch that measures and "only" in a launch of its
    own that runs the warm-up and the traced steps and measures nothing (TRACE_LAUNCHES)."""


TRACE_LAUNCHES = ("inline", "untraced", "only")

SECTIONS = {
    "model": ModelConfig,
    "batch": BatchConfig,
    "measurement": MeasurementConfig,
    "topology": TopologyConfig,
    "role": RoleConfig,
}
# Which section holds each setting: lets a caller (and migrate_config, for records written flat) name a
# setting without its section. Names are unique across sections; a test holds them so.
SECTION_OF = {f.name: name for name, section in SECTIONS.items() for f in dataclasses.fields(section)}
# The settings outside every section: which stack, and how it is set up.
TOP_LEVEL = ("backend", "backend_options", "variant")


@dataclass
class RunConfig:
    """Everything that defines one run, in sections as torchtitan's JobConfig has them: what is trained
    (model), on how much data per step (batch), how it is timed (measurement), where the ranks run
    (topology), the stack and its own options (backend, backend_options), and what this worker does
    (role, set by the harness)."""

    backend: str = field(metadata=flag("--backend", "{backends}", required=True))
    """A registered stack name (backends.backend_names(): the shipped adapters and the entry points)."""
    model: ModelConfig
    topology: TopologyConfig
    batch: BatchConfig = field(default_factory=BatchConfig)
    measurement: MeasurementConfig = field(default_factory=MeasurementConfig)
    backend_options: dict = field(default_factory=dict)
    """The stack's own settings (its adapter's `options` say which it takes), e.g. ZeRO's stage."""
    role: RoleConfig = field(default_factory=RoleConfig)
    variant: str = setting(
        "default",
        "--tuned",
        "the stack's tuned set: the settings its own documentation and reference trainers use (each listed "
        "in the record with its source; a flag given as well overrides its setting)",
        action="store_true",
    )
    """One of VARIANTS: "tuned" when the stack's tuned set (its adapter's `tuned()`) was applied to
    backend_options, any option given by hand on top; part of the label, so tables and `harness compare`
    never take a tuned run for a default one."""

    @classmethod
    def build(
        cls, backend: str, backend_options: dict | None = None, variant: str = "default", **settings
    ) -> RunConfig:
        """A config from settings named without their sections (`world_size=2, steps=5`): the harness's
        CLI, the tests and migrate_config route through here; an unknown name is a TypeError."""
        unknown = sorted(set(settings) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"RunConfig.build: no setting {', '.join(unknown)}")
        parts: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in settings.items():
            parts[SECTION_OF[key]][key] = value
        return cls(
            backend=backend,
            backend_options=dict(backend_options or {}),
            variant=variant,
            **{name: SECTIONS[name](**parts[name]) for name in SECTIONS},
        )

    def evolve(self, **changes) -> RunConfig:
        """A copy with settings changed, named without their sections (as in `build`)."""
        top = {k: changes.pop(k) for k in TOP_LEVEL if k in changes}
        unknown = sorted(set(changes) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"RunConfig.evolve: no setting {', '.join(unknown)}")
        sections = {}
        for name in SECTIONS:
            mine = {k: v for k, v in changes.items() if SECTION_OF[k] == name}
            if mine:
                sections[name] = dataclasses.replace(getattr(self, name), **mine)
        return dataclasses.replace(self, **top, **sections)

    def setting(self, name: str):
        """A setting by its name alone (as `build` takes it): for readers that list settings generically,
        such as `harness compare`'s differences."""
        if name in TOP_LEVEL:
            return getattr(self, name)
        return getattr(getattr(self, SECTION_OF[name]), name)

    @property
    def commbench_spec(self) -> CommbenchSpec:
        """What a commbench worker times (role.commbench); a ValueError for a training run's config."""
        if self.role.commbench is None:
            raise ValueError("not a commbench configuration (RunConfig.role.commbench is not set)")
        return CommbenchSpec.from_dict(self.role.commbench)

    @property
    def global_batch(self) -> int:
        return self.batch.micro_batch * self.batch.grad_accum * self.topology.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.model.spec.seq_len

    @property
    def collective_timeout(self) -> float:
        """Seconds a rank waits in a collective for a peer that never comes (a hung or dead rank) before
        it fails: every framework's own collective timeout is set from this."""
        return self.measurement.collective_timeout_s or self.measurement.timeout_s

    @property
    def local_procs(self) -> int:
        """Worker processes this node's launcher starts (1 for an isolated-counterfactual worker)."""
        return 1 if self.role.isolated_index is not None else self.topology.gpus_per_node

    @property
    def process_group_size(self) -> int:
        """Ranks taking part in collectives: 1 for an isolated-counterfactual worker."""
        return 1 if self.role.isolated_index is not None else self.topology.world_size

    @property
    def first_local_rank(self) -> int:
        """The global rank of this node's first rank."""
        return self.topology.node_rank * self.topology.gpus_per_node

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"]["spec"] = self.model.spec.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        d = migrate_config(d)
        model = dict(d["model"])
        model["spec"] = ModelSpec(**model["spec"])
        d["model"] = model
        sections = {}
        for name, section in SECTIONS.items():
            known = {f.name for f in dataclasses.fields(section)}
            sections[name] = section(**{k: v for k, v in d.get(name, {}).items() if k in known})
        return cls(
            backend=d["backend"],
            backend_options=dict(d.get("backend_options") or {}),
            variant=d.get("variant", "default"),  # records before variants ran every stack as default
            **sections,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)


def migrate_config(d: dict) -> dict:
    """A config as written by any earlier version, in today's layout: record schemas 1 to 3 wrote it flat
    (schema 1 also called the world size `gpus` and had no `gpus_per_node`); schema 4 writes it in
    RunConfig's sections, with a `variant` since tuned variants exist."""
    d = dict(d)
    d.setdefault("variant", "default")  # configs from before tuned variants ran the defaults
    if "model" in d and isinstance(d["model"], dict):
        return d
    if "gpus" in d and "world_size" not in d:
        d["world_size"] = d.pop("gpus")
    d.setdefault("gpus_per_node", d["world_size"] // d.get("nodes", 1))
    nested: dict = {
        "backend": d["backend"],
        "backend_options": d.get("backend_options") or {},
        "variant": d["variant"],
    }
    for name in SECTIONS:
        nested[name] = {k: v for k, v in d.items() if SECTION_OF.get(k) == name}
    return nested
