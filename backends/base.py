"""The harness side of a backend: the adapter interface, its typed options and the device contract.

An adapter knows how to start its stack's launcher for one node and what the stack does to the model state;
it imports no framework, so the harness can load every adapter. The worker side (the `Trainer` and the
timed loop) is backends/loop.py.

The device contract: the runner decides which physical devices this launch's workers get (honouring the
user's CUDA_VISIBLE_DEVICES) and passes their ids, in local-rank order, to `launch()`; each adapter turns
them into its launcher's flags and environment in one place. `launch()` has no side effects: the files it
needs (hostfiles) come back in the plan for the runner to write, so `harness plan` can call it anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from backends import interpreter
from backends.schedule import CommPattern, Schedule, gradients_after_backward
from core.commbench_spec import COLLECTIVE_OPS
from core.config import RunConfig
from core.precision import Numerics, autocast_numerics
from core.process import REPO_ROOT, Process, process_settings
from workloads.spec import PRESETS

WORKER_SCRIPT = REPO_ROOT / "backends" / "worker.py"
# The stack's host-memory footprint, beside its adapter's module (Backend.footprint): written by
# `python -m harness.run.footprint --backend NAME --write`, read before every launch (harness.run.footprint).
FOOTPRINT_FILE = "footprint.json"
CUDA_MASK = "CUDA_VISIBLE_DEVICES"
# The network interface NCCL and Gloo open their sockets on. On a node with several (an Ethernet for
# management, InfiniBand or a fast Ethernet for the job, a container bridge) each library picks one by its
# own rules, and ranks that pick interfaces the others cannot reach hang in their first collective. Set in the
# user's environment, they reach every worker of every launcher (worker_env), Slurm job and Kubernetes pod.
NETWORK_SETTINGS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def network_settings(environ=os.environ) -> dict[str, str]:
    """The network-interface settings (NETWORK_SETTINGS) set in `environ`."""
    return {k: environ[k] for k in NETWORK_SETTINGS if environ.get(k)}


def worker_python(cfg: RunConfig) -> str:
    """The interpreter this run's launcher and workers run under (backends.interpreter): the backend's own
    environment where one is configured, else the harness's (a record written before the choice existed)."""
    return cfg.topology.python or sys.executable


# ------------------------------------------------------------------------------------------- typed options
def option(default, flag: str, help: str, choices=None, type=None, parse=None):
    """A field of a backend's Options: its default (stated once), CLI flag, help text and accepted values.
    `parse` turns the flag's text into the field's value where that is not `type` (on/off -> bool)."""
    return field(
        default=default,
        metadata={"flag": flag, "help": help, "choices": choices, "type": type, "parse": parse},
    )


def on_off(text: str) -> bool:
    return text == "on"


def switch(default, flag: str, help: str):
    """A field of a backend's Options set by `FLAG on|off`: unlike a bare flag, it can turn off what a
    tuned set (`--tuned`) turned on."""
    return option(default, flag, help, choices=("on", "off"), parse=on_off)


@dataclass(frozen=True)
class Options:
    """A backend's options; each adapter subclasses it with its own fields (declared with `option`)."""

    def optimizer_kernel(self) -> str:
        """How the optimizer's update goes over memory on a GPU, which the prediction prices: "fused" (one
        pass over each parameter, its gradient and its moments) or "foreach" (torch's multi-tensor AdamW,
        one pass per elementwise operation). One pass unless the options say otherwise (Paddle's AdamW runs
        its adamw_ kernel once per parameter)."""
        return "fused"

    @classmethod
    def flags(cls) -> dict[str, str]:
        """CLI flag -> field name."""
        return {f.metadata["flag"]: f.name for f in dataclasses.fields(cls)}

    @classmethod
    def add_arguments(cls, parser, backend: str) -> None:
        """Register the flags; every default is None so that a flag given can be told from one not given."""
        # A field several stacks share (the torch family's --compile) is one flag, registered by the first.
        fields = [
            f for f in dataclasses.fields(cls) if f.metadata["flag"] not in parser._option_string_actions
        ]
        if not fields:
            return
        group = parser.add_argument_group(backend)
        for f in fields:
            meta, dest = f.metadata, f.metadata["flag"].lstrip("-").replace("-", "_")
            text = f"{backend}: {meta['help']}"
            if f.type in (bool, "bool") and meta["choices"] is None:
                group.add_argument(meta["flag"], dest=dest, action="store_true", default=None, help=text)
            else:
                group.add_argument(
                    meta["flag"],
                    dest=dest,
                    choices=meta["choices"],
                    type=meta["type"],
                    default=None,
                    help=f"{text} (default {f.default})",
                )

    @classmethod
    def given(cls, args) -> dict[str, object]:
        """The flags of this backend that were given on the command line, with their values."""
        return {
            flag: getattr(args, flag.lstrip("-").replace("-", "_"), None)
            for flag in cls.flags()
            if getattr(args, flag.lstrip("-").replace("-", "_"), None) is not None
        }

    @classmethod
    def from_args(cls: type[OptionsT], args, base: dict | None = None) -> OptionsT:
        """The flags given, over `base` (field -> value: a tuned set), over the defaults."""
        values = dict(base or {})
        for f in dataclasses.fields(cls):
            value = getattr(args, f.metadata["flag"].lstrip("-").replace("-", "_"), None)
            if value is not None:
                values[f.name] = f.metadata["parse"](value) if f.metadata["parse"] else value
        return cls(**values)

    def to_argv(self, against: Options | None = None) -> list[str]:
        """The command-line flags that set these options over `against` (the defaults where None): what
        `harness run` is given to run them again (`harness select --confirm`). Each flag takes the text it
        parses back to the value: on/off for a switch, the bare flag for a boolean, the value otherwise."""
        against = against if against is not None else type(self)()
        out: list[str] = []
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value == getattr(against, f.name):
                continue
            if meta["parse"] is on_off:
                out += [meta["flag"], "on" if value else "off"]
            elif f.type in (bool, "bool") and meta["choices"] is None:
                if not value:
                    raise ValueError(f"{meta['flag']}: a store-true flag cannot be turned off")
                out.append(meta["flag"])
            else:
                out += [meta["flag"], str(value)]
        return out

    @classmethod
    def from_dict(cls: type[OptionsT], d: dict | None) -> OptionsT:
        """From RunConfig.backend_options; a key missing (an older record) takes its default."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in (d or {}).items() if k in known})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Tuned:
    """One setting of a stack's tuned set (`harness run --tuned`): the value its own documentation or
    reference trainer uses for a GPT-style transformer, where that is written (`source`), and whether it
    changes the floating-point result (`numerics`): a compiler that fuses and reorders, a fused optimizer
    kernel that rounds in another order. A setting that changes the maths on purpose (fp16 gradient
    compression) is not in a tuned set: it stays a choice a user makes by hand, labelled as such."""

    value: object
    source: str
    numerics: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# An adapter's own Options class: from_dict/from_args and Backend.options() return it, so its fields are
# checked where they are read.
OptionsT = TypeVar("OptionsT", bound=Options)


# ------------------------------------------------------------------------------------------- the adapter
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def parameter_numels(cfg: RunConfig) -> dict[str, int]:
    """Elements of every parameter tensor of the spec, by neutral name (blocks.<i>.* are the blocks')."""
    return {name: math.prod(shape) for name, shape in cfg.model.spec.parameter_shapes().items()}


@dataclass
class Check:
    """One line of `harness doctor`: what was checked, the command that checks it by hand, what was expected
    and what was found."""

    name: str
    command: str
    expected: str
    got: str
    status: str  # "ok" | "FAIL" | "warn" (shown, does not fail the doctor)


@dataclass
class LaunchPlan:
    """What starting one node's share of a run takes: the processes, the files they read (absolute
    path -> content), which the runner writes before starting them, and `leftovers`: glob patterns of what
    the framework creates outside the run directory and leaves when its processes end (shared-memory
    segments), which the runner removes once they all have, however they ended."""

    processes: list[Process]
    files: dict[Path, str] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)


class Backend(ABC, Generic[OptionsT]):
    """An adapter: how one distributed-training stack is launched and what it does to the model state."""

    name: str = ""
    framework: str = ""  # "torch" | "tensorflow" | "paddle"
    launcher: str = ""  # human-readable, for `harness list` and reports
    also_requires: tuple[str, ...] = ()  # importable modules needed besides the framework itself
    # The pyproject.toml extra that installs this stack (`pip install -e '.[<extra>]'`, which `harness list`
    # prints where the stack is missing); a stack that pip alone cannot install also has
    # scripts/install_<extra>.sh, run after the extra.
    extra: str = ""
    compute_methods: tuple[str, ...] = ("isolated",)  # first = default for compute_method "auto"
    multi_node: bool = True
    mixed_precision: str = "autocast"  # how bf16/fp16 is implemented: "autocast" | "master"
    # True when node 0's launcher starts the ranks of every node itself (horovodrun over ssh): the other
    # nodes then start no ranks, and must not start their isolated workers while node 0's ranks still run.
    starts_remote_ranks: bool = False
    # True when the stack's trace instrument costs time from the moment it is enabled, not only while it
    # records: the harness then measures in a launch without it and traces in a launch of its own
    # (RoleConfig.trace_launch), and the record says so (comm_trace.launch).
    traces_in_own_launch: bool = False
    collective_api: str = ""  # the API `harness commbench` times, for tables
    # whether its worker times the optimizer step on its own (Trainer.timed_optimizer_step): where it cannot,
    # its anatomy steps then give no optimizer part, and an isolated worker no optimizer time to discount
    times_optimizer: bool = True
    # The Kubeflow job kind `harness k8s` writes for it, by how its pods learn their node rank: "PyTorchJob"
    # (MASTER_ADDR and RANK; any launcher with a master and node ranks fits), "TFJob" (TF_CONFIG),
    # "PaddleJob" (the replica index), or "MPIJob" (node 0's launcher reaches the others over ssh:
    # starts_remote_ranks); "" where no Kubeflow job runs it.
    kubeflow_job: str = ""
    # A framework-free module that reads the stack's trace files, for `harness trace`: it defines FILE_FORMAT
    # (a name for help and errors) and read_trace_file(raw, world) -> backends.comm_trace.TraceFile, raising
    # NotThisFormat for another format; "" where the stack's trace is no file a user holds.
    trace_reader: str = ""
    # Lower-case words of this stack's error messages that say a rank failed because of another: it gave up
    # waiting in a collective (timeout) or lost its connection (lost). harness.run.runner tells a failure's
    # cause from its effects by them, besides the words of the transports every stack uses (gloo, NCCL, TCP).
    peer_timeout_texts: tuple[str, ...] = ()
    peer_lost_texts: tuple[str, ...] = ()
    # Every adapter names its options class, the base Options when it has none (a subclass of
    # Backend[ThatClass], so that options() is typed as it).
    Options: type[OptionsT]

    @property
    def requires(self) -> tuple[str, ...]:
        """The modules this backend's workers import (checked without importing them)."""
        return (self.framework, *self.also_requires)

    @property
    def worker_module(self) -> str:
        """The module that defines `make_trainer(cfg) -> Trainer`: `worker` beside the adapter."""
        return f"{type(self).__module__}.worker"

    @property
    def collectives_module(self) -> str:
        """The module that defines `make_collectives(cfg) -> Collectives` (backends.commbench) for
        `harness commbench`: `collectives` beside the adapter."""
        return f"{type(self).__module__}.collectives"

    def commbench_label(self, cfg: RunConfig) -> str:
        """Name of this stack's collectives in commbench tables: options that change how they run show."""
        return self.name

    def collective_ops(self, cfg: RunConfig) -> tuple[str, ...]:
        """The collectives (core.commbench_spec.COLLECTIVE_OPS' names) this stack's own API offers on cfg's
        device."""
        return COLLECTIVE_OPS

    def availability(self, python: str | None = None) -> tuple[bool, str]:
        """(usable here, reason if not), decided without importing the framework, by the interpreter the
        workers run under: `python` (a run's RunConfig.python), else the one configured for this backend
        (backends.interpreter). Another interpreter is asked in a subprocess, once per process."""
        try:
            where = interpreter.facts(
                python or interpreter.configured(self.name, self.framework)[0], self.requires
            )
        except interpreter.InterpreterError as exc:
            return False, str(exc)
        return self.available_in(where)

    def available_in(self, where: interpreter.Interpreter) -> tuple[bool, str]:
        """(usable, reason if not) in the interpreter described by `where`."""
        missing = [m for m in self.requires if where.modules.get(m) is None]
        if not missing:
            return True, ""
        inside = "" if where.this_one else f" (in {where.executable})"
        return False, f"not installed: {', '.join(missing)}{inside}"

    def options(self, cfg: RunConfig) -> OptionsT:
        """This run's options, typed, with the defaults filled in."""
        return self.Options.from_dict(cfg.backend_options)

    def validate(self, cfg: RunConfig) -> None:
        """Raise InvalidConfig if this configuration cannot run as asked; called before anything launches."""

    def doctor_checks(self, python: str | None, required: bool) -> list[Check]:
        """`harness doctor`'s checks of what this stack needs beyond its imports (which the doctor checks for
        every stack): `python` is its workers' interpreter (None: the harness's), `required` whether the
        user named this stack (a problem then fails the doctor, else it warns)."""
        return []

    def label(self, cfg: RunConfig) -> str:
        """Name shown in tables and matched by `harness compare`: the stack's configuration
        (stack_label) and, for a tuned run, "+tuned"."""
        return self.stack_label(cfg) + ("+tuned" if cfg.variant == "tuned" else "")

    def stack_label(self, cfg: RunConfig) -> str:
        """The stack's configuration as tables name it: distinguishes ZeRO stages and the like."""
        return self.name

    def tuned(self, cfg: RunConfig) -> dict[str, Tuned]:
        """The stack's tuned set on cfg's device: its Options fields as its experts set them, each with its
        source (Tuned). Empty: nothing to tune beyond the defaults."""
        return {}

    def footprint_path(self) -> Path:
        """Where this stack's footprint is kept: FOOTPRINT_FILE beside its adapter's module (in its package
        for a shipped stack, package data of the wheel; beside the module of a registered one)."""
        return Path(sys.modules[type(self).__module__].__file__ or "").parent / FOOTPRINT_FILE

    def footprint(self) -> dict | None:
        """The host memory this stack needs beyond the model, measured once on a real run and kept with it
        (FOOTPRINT_FILE: bytes per worker, shared by its workers, per launcher, and how they were measured;
        harness.run.footprint measures and reads it). None where the stack has none: the check before
        launch then says it cannot estimate and lets the run go."""
        try:
            return json.loads(self.footprint_path().read_text())
        except FileNotFoundError:
            return None

    def sharding(self, cfg: RunConfig) -> str:
        """What this configuration shards across ranks: none | optimizer | gradients | parameters."""
        return "none"

    def model_state_bytes(self, cfg: RunConfig) -> dict[str, float]:
        """Bytes of parameters, gradients and optimizer state one rank holds (the predictor's model-state
        term): the spec's rule for this stack's sharding and precision scheme. A stack that keeps some
        tensors out of its sharding says so in its own override."""
        return cfg.model.spec.model_state_bytes(
            cfg.model.precision, self.precision_scheme(cfg), self.sharding(cfg), cfg.topology.world_size
        )

    def schedule(self, cfg: RunConfig) -> Schedule:
        """The collectives of one step as this stack issues them (backends.schedule): the one declaration
        the analytic volume (comm_pattern) and the prediction's replay both read. An adapter with its own
        overrides this in backends/<stack>/schedule.py; the default all-reduces every fp32 gradient once a
        step, in one call after backward."""
        return gradients_after_backward(cfg, 4)

    def comm_pattern(self, cfg: RunConfig) -> CommPattern:
        """What this configuration sends per step (the analytic volume): its schedule's terms, summed."""
        return self.schedule(cfg).comm_pattern()

    def settings(self, cfg: RunConfig) -> dict:
        """The framework's own configuration this run hands it (e.g. DeepSpeed's config), for the record."""
        return {}

    def timeouts(self, cfg: RunConfig) -> dict[str, float]:
        """The stack's own collective and rendezvous waits, each by the knob that sets it, in seconds: every
        one follows the run's collective timeout (cfg.collective_timeout, the run's --timeout unless
        --collective-timeout says otherwise), so that a busy or oversubscribed node waits as long as the run
        allows instead of failing at a framework default well before it. The adapter's launch and the
        worker set each knob from here; tests/test_timeouts.py holds every stack to it."""
        return {}

    def optimizer_kernel(self, cfg: RunConfig) -> str:
        """This configuration's optimizer kernel (Options.optimizer_kernel)."""
        return self.options(cfg).optimizer_kernel()

    def precision_scheme(self, cfg: RunConfig) -> str:
        return self.mixed_precision

    def numerics(self, cfg: RunConfig) -> Numerics:
        """What runs in which dtype in this configuration (core.precision), which the worker checks against
        what it observes and records. The default is torch.autocast's (DDP, Horovod)."""
        return autocast_numerics(cfg)

    def compute_methods_for(self, options: OptionsT) -> tuple[str, ...]:
        """The compute-only methods a configuration supports, preferred first. An option can rule one
        out: a sharded optimizer that synchronises inside its step has no sync-off switch (no_sync)."""
        return self.compute_methods

    def features(self) -> dict:
        """What this adapter supports, for the report's feature table. `sharding` lists the sharding of
        every configuration it offers; the default asks sharding() about a run with default options, so an
        adapter whose options change the sharding (ZeRO stages) overrides this."""
        probe = RunConfig.build(
            backend=self.name, workload="tiny", spec=PRESETS["tiny"], world_size=2, device="cpu"
        )
        return {
            "framework": self.framework,
            "launcher": self.launcher,
            "multi_node": self.multi_node,
            "mixed_precision": self.mixed_precision,
            "compute_methods": list(self.compute_methods),
            "sharding": [self.sharding(probe)],
        }

    @abstractmethod
    def launch(self, cfg: RunConfig, run_dir: Path, port: int, devices: list[str]) -> LaunchPlan:
        """The command(s) that start THIS node's cfg.local_procs workers with the framework's own
        launcher (cfg.topology.nodes / node_rank / master_addr for multi-node; `port` is the master's port).
        `devices`: the physical GPU ids of those workers in local-rank order (empty on CPU). An
        isolated-counterfactual config (cfg.role.isolated_index set) is always a single local process."""

    def worker_env(self, cfg: RunConfig) -> dict[str, str]:
        """Environment every worker process gets: import path, unbuffered output, the process settings
        every backend shares (see core.process.process_settings), and the user's network-interface settings
        (NETWORK_SETTINGS; inherited anyway on this node, stated so that a plan shows them)."""
        return {
            "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
            **process_settings(cfg.topology.threads_per_worker),
            **network_settings(),
        }


def device_mask(devices: list[str]) -> dict[str, str]:
    """The environment that shows a launcher exactly these physical GPUs (nothing on CPU)."""
    return {CUDA_MASK: ",".join(devices)} if devices else {}


# What torch.distributed's errors say when a peer is gone (ProcessGroupNCCL aborting its communicator), for
# the adapters of the stacks that run on it (Backend.peer_lost_texts)
TORCH_DISTRIBUTED_PEER_LOST = ("communicator was aborted",)


# torchrun's static rendezvous: the agents' TCPStore waits this long for the other nodes' agents and for
# its keys (torch.distributed.elastic.rendezvous.static_tcp_rendezvous: 600 s unless --rdzv-conf says)
TORCHRUN_RENDEZVOUS = "torchrun --rdzv-conf timeout"
TORCH_PROCESS_GROUP = "torch.distributed.init_process_group(timeout)"


def torchrun_timeouts(cfg: RunConfig) -> dict[str, float]:
    """The waits of a stack torchrun launches (Backend.timeouts): the agents' rendezvous store, and the
    workers' process group (its collectives and the store it meets over; torch's default: 30 min for gloo, 10
    for NCCL), both the run's collective timeout."""
    return {TORCHRUN_RENDEZVOUS: cfg.collective_timeout, TORCH_PROCESS_GROUP: cfg.collective_timeout}


def torchrun(backend: Backend, cfg: RunConfig, run_dir: Path, port: int, devices: list[str]) -> LaunchPlan:
    """torchrun (torch.distributed.run) for this node: one worker per device, static rendezvous at the
    master on `port` (an isolated-counterfactual worker is a 1-node, 1-process run on localhost), its store
    waiting as long as the run's collective timeout (Backend.timeouts), not torch's 600 s. Local rank i uses
    cuda:i inside the mask, which is devices[i]."""
    nodes, node_rank, master = (
        (1, 0, "127.0.0.1")
        if cfg.role.isolated_index is not None
        else (cfg.topology.nodes, cfg.topology.node_rank, cfg.topology.master_addr)
    )
    argv = [
        worker_python(cfg),
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={cfg.local_procs}",
        f"--nnodes={nodes}",
        f"--node-rank={node_rank}",
        f"--master-addr={master}",
        f"--master-port={port}",
        "--max-restarts=0",
        f"--rdzv-conf=timeout={math.ceil(backend.timeouts(cfg)[TORCHRUN_RENDEZVOUS])}",
        str(WORKER_SCRIPT),
        str(run_dir),
    ]
    return LaunchPlan([Process(argv, {**backend.worker_env(cfg), **device_mask(devices)})])
