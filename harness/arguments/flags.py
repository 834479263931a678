"""Every flag a run is defined by, declared once, and the argparse options of each verb generated from it.

A flag that sets a RunConfig setting is declared on the setting's own field (core.config.flag: its name,
help, type, valid values and default, beside the field's docstring); the workload's shape flags come from
workloads.spec.OVERRIDES; each stack's flags from its Options (backends.base.option); the rest, which set
no setting (where records go, the display, the test hooks, the hostfile, the prediction's inputs), are
declared below in HARNESS_FLAGS. A verb adds them with `add_flags(parser, "--steps", ...)`, or the sets
of them that verbs share: add_run_arguments (run, sweep, plan, gate), add_layout_arguments (commbench,
doctor) and add_stack_options. A verb that needs a flag otherwise than the others passes its own variant,
`declared(NAME).but(...)`, with the reason beside it; tests/test_arguments.py walks every verb's parser and
fails on a shared flag defined two ways that is not one of those stated differences.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from pathlib import Path

from backends import all_backends, backend_names
from core.config import SECTIONS, RunConfig
from core.records import DEFAULT_OUT
from harness.arguments import parsers
from harness.arguments.layout import DEFAULT_MASTER_PORT
from workloads.spec import OVERRIDES

# The help sections flags are grouped under (core.config.flag's `group`).
GROUPS = {
    "multi-node": "multi-node (one harness per node, the same options on each but --node-rank)",
    "testing": "testing (never for real measurements)",
}
# Flags that exclude each other: one argparse mutually exclusive group per key.
EXCLUSIVE = {"--hosts": "hosts", "--hostfile": "hosts"}


@dataclass(frozen=True)
class Flag:
    """One command-line flag as a verb defines it. `setting`: the RunConfig setting it sets ("" for a flag
    of the harness's own); `valid`: the values accepted, checked where the config is built so that the
    usage error names them (argparse checks `choices`)."""

    name: str
    help: str
    type: Callable | None = None
    default: object = None
    action: str | None = None  # None (takes a value), "store_true", "boolean" (--x/--no-x), "append"
    metavar: str | None = None
    valid: tuple | None = None
    choices: tuple | None = None
    nargs: str | None = None
    group: str | None = None
    required: bool = False
    setting: str = ""
    short: str | None = None  # a one-letter alias ("-o")

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    def but(self, **changes) -> Flag:
        """This flag as one verb defines it otherwise (a stated difference: say why where it is used)."""
        return dataclasses.replace(self, **changes)

    def add(self, parser) -> argparse.Action:
        kwargs: dict = {"dest": self.dest, "help": self.help}
        if self.required:
            kwargs["required"] = True
        else:
            kwargs["default"] = self.default
        names = [self.short, self.name] if self.short else [self.name]
        if self.action == "store_true":
            return parser.add_argument(*names, action="store_true", **kwargs)
        if self.action == "boolean":
            return parser.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
        if self.action == "append":
            kwargs["action"] = "append"
        for key in ("type", "metavar", "choices", "nargs"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        return parser.add_argument(*names, **kwargs)


class Unfilled(dict):
    """Placeholders of a help text: the ones not known yet stay as they are, for the verb to fill."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def fill(text: str, values: dict) -> str:
    return text.format_map(Unfilled(values))


def type_named(name: str | None) -> Callable | None:
    """core.config.flag's `parse`: the name of a type of harness.arguments.parsers, or "int"."""
    return None if name is None else int if name == "int" else getattr(parsers, name)


def field_flag(field: dataclasses.Field, placeholders: dict) -> Flag:
    """The Flag a RunConfig field declares in its metadata (core.config.flag)."""
    meta = field.metadata
    if meta["default"] is not MISSING:
        default = meta["default"]
    elif meta["action"] == "store_true":
        default = False
    else:
        default = field.default if field.default is not MISSING else None
    return Flag(
        name=meta["flag"],
        help=fill(meta["help"], {**placeholders, "default": field.default}),
        type=type_named(meta["parse"]),
        default=default,
        action=meta["action"],
        metavar=meta["metavar"],
        valid=meta["valid"],
        choices=meta["choices"],
        group=meta["group"],
        required=meta["required"],
        setting=field.name,
    )


HARNESS_FLAGS = (
    Flag(
        "--quiet",
        "plain progress lines instead of the live display (the default when stdout is not a terminal)",
        action="store_true",
        default=False,
    ),
    Flag(
        "--tensorboard",
        "also write each run's per-step curves as TensorBoard event files under DIR/<run>/",
        type=Path,
        metavar="DIR",
    ),
    Flag("--global-batch", "global batch; micro-batch = global / (gpus x accum)", type=parsers.positive),
    Flag("--out", "directory for run records", type=Path, default=DEFAULT_OUT),
    Flag("--run-id", "this run's id (default: a new one); a multi-node run needs the same one on every node"),
    Flag("--backends", "comma-separated, or all (the default): {backends}"),
    Flag(
        "--hostfile",
        "one host per line, node 0 first; 'host slots=G' or 'host:G' also read (DeepSpeed/MPI hostfiles)",
        type=Path,
        group="multi-node",
    ),
    Flag(
        "--inject-fault",
        "make one rank fail; KIND: {fault_kinds}",
        type=parsers.fault_spec,
        metavar="RANK:STEP:KIND",
        group="testing",
    ),
    Flag(
        "--skip-memory-check",
        "launch even where this node's ranks, at their stack's measured footprint, would not fit its memory",
        action="store_true",
        default=False,
    ),
    Flag("--step-delay", "seconds of sleep added to every step", type=float, default=0.0, group="testing"),
    Flag(
        "--part-delay",
        "seconds of sleep added to one part of every step (repeatable); PART: {delayable_parts}",
        type=parsers.part_delay,
        action="append",
        metavar="PART=SECONDS",
        group="testing",
    ),
    Flag(
        "--warmup-transient",
        "each rank takes and frees this much memory before its first warm-up step",
        type=parsers.positive,
        metavar="BYTES",
        group="testing",
    ),
    # The documents a verb writes (harness.arguments.documents): the kind named by the flag, either or both
    Flag("--markdown", "write the document as Markdown to FILE ('-': standard output)", metavar="FILE"),
    Flag("--html", "write the document as one self-contained HTML file (plots embedded)", metavar="FILE"),
    # What a prediction is priced with (`harness predict`, `harness select`)
    Flag(
        "--hardware",
        "{profiles}, a profile .yaml, or local (this machine, from the commbench records in --calibrate)",
        required=True,
    ),
    Flag(
        "--calibrate",
        "record files or folders: a 1-rank training run on the profile's device calibrates compute; "
        "commbench runs make the local profile",
        nargs="+",
        metavar="RECORD",
    ),
    Flag("--tokens", "tokens to train on (default 20 x parameters)", type=parsers.tokens_count),
    Flag("--gpu-hour-price", "USD per GPU-hour, for the cost column", type=parsers.usd),
)
SHAPE_FLAGS = tuple("--" + name.replace("_", "-") for name in OVERRIDES)


@functools.cache
def placeholders() -> dict[str, str]:
    """What a help text may name that only the harness knows (core.config.flag)."""
    from core.hooks import DELAYABLE_PARTS, FAULT_KINDS

    return {
        "backends": ", ".join(backend_names()),
        "remote_launchers": ", ".join(b.name for b in all_backends() if b.starts_remote_ranks),
        "master_port": str(DEFAULT_MASTER_PORT),
        "fault_kinds": ", ".join(FAULT_KINDS),
        "delayable_parts": ", ".join(DELAYABLE_PARTS),
    }


@functools.cache
def declared_flags() -> dict[str, Flag]:
    """Every declared flag by name: RunConfig's fields', the workload's shape, the harness's own."""
    marks = placeholders()
    fields = [*dataclasses.fields(RunConfig), *(f for s in SECTIONS.values() for f in dataclasses.fields(s))]
    out = {f.metadata["flag"]: field_flag(f, marks) for f in fields if "flag" in f.metadata}
    for name, attribute in OVERRIDES.items():
        shape = "--" + name.replace("_", "-")
        out[shape] = Flag(shape, f"override the preset's {attribute}", type=parsers.positive, setting="spec")
    for flag in HARNESS_FLAGS:
        out[flag.name] = flag.but(help=fill(flag.help, marks))
    return out


def declared(name: str) -> Flag:
    """The one definition of flag `name`."""
    return declared_flags()[name]


def add_flags(parser, *flags: str | Flag, **values: str) -> None:
    """Add flags to a verb's parser: each a declared flag's name, or a verb's own variant of one (a Flag);
    grouped (multi-node, testing) and made exclusive (--hosts, --hostfile) as declared. `values` fill the
    placeholders of help texts that only the verb knows ({profiles}: the hardware catalogue)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for item in flags:
        flag = declared(item) if isinstance(item, str) else item
        flag = flag.but(help=fill(flag.help, values)) if values else flag
        target = parser
        if flag.group:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(GROUPS[flag.group])
            target = groups[flag.group]
        if flag.name in EXCLUSIVE:
            key = EXCLUSIVE[flag.name]
            if key not in exclusive:
                exclusive[key] = target.add_mutually_exclusive_group()
            target = exclusive[key]
        flag.add(target)


def add_verb(subparsers, name: str, help: str, description: str | None, **kwargs) -> argparse.ArgumentParser:
    """A verb's parser whose --help prints `description` (its module's docstring) as it is written, its
    lines and paragraphs kept; `kwargs` as argparse's add_parser takes them."""
    return subparsers.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


# The flags of a run, in the order `harness run --help` lists them: run, sweep, plan and the gate take all.
RUN_FLAGS = (
    "--quiet",
    "--tensorboard",
    "--workload",
    *SHAPE_FLAGS,
    "--precision",
    "--tf32",
    "--device",
    "--micro-batch",
    "--global-batch",
    "--grad-accum",
    "--steps",
    "--warmup",
    "--compute-steps",
    "--anatomy-steps",
    "--isolated-repeats",
    "--trace-comm",
    "--trace-steps",
    "--compute-method",
    "--threads-per-worker",
    "--activation-checkpointing",
    "--tuned",
    "--data",
    "--seed",
    "--timeout",
    "--collective-timeout",
    "--skip-memory-check",
    "--out",
    "--inject-fault",
    "--step-delay",
    "--part-delay",
    "--warmup-transient",
    "--dump-weights",
    "--python",
)
# Where the ranks run when there are several nodes.
MULTI_NODE_FLAGS = (
    "--nodes",
    "--gpus-per-node",
    "--hosts",
    "--hostfile",
    "--node-rank",
    "--launcher-only",
    "--master",
)


def add_stack_options(parser) -> None:
    """Every stack's own flags (its Options), each stack's in a group of its own."""
    for backend in all_backends():
        backend.Options.add_arguments(parser, backend.name)


def add_layout_arguments(parser) -> None:
    """The multi-node flags of `run` and of everything that places ranks on nodes."""
    add_flags(parser, *MULTI_NODE_FLAGS)


def add_run_arguments(parser) -> None:
    """Every flag that defines a run and how it is measured, less the stack and the ranks (--backend and
    --gpus, whose form differs by verb: one stack or several, one N or a list): run, sweep, plan, gate."""
    add_flags(parser, *RUN_FLAGS)
    add_stack_options(parser)
    add_layout_arguments(parser)


def add_job_arguments(parser) -> None:
    """A job file's allocation and where the file goes (`harness slurm`, `harness k8s`). The job hands the
    allocation to `harness run` as its layout, so here it is a size of its own: one node of one rank unless
    given, where run's --nodes and --gpus-per-node are worked out from the hosts when not given."""
    nodes = declared("--nodes").but(default=1, group=None, help="nodes the job takes, one harness each")
    per_node = declared("--gpus-per-node").but(
        default=1, group=None, help="ranks per node (GPUs, or CPU workers)"
    )
    output = Flag("--output", "file to write (default: stdout)", default="-", short="-o")
    add_flags(parser, nodes, per_node, output)
