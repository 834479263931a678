"""The command line of every verb that defines a run, in one place below harness.run and harness.predict
(which never imports harness.run): parsers.py (every argparse type the verbs use), layout.py (hosts,
rendezvous and nodes, read once) and request.py (from parsed arguments to the parts of a RunConfig)."""

from harness.arguments.layout import DEFAULT_MASTER_PORT, Layout, node_layout, read_hosts, requested_world
from harness.arguments.parsers import (
    fault_spec,
    fraction,
    gpu_counts,
    gpu_list,
    gpu_range,
    hours,
    int_at_least,
    non_negative,
    positive,
    seconds,
    tokens_count,
    usd,
)
from harness.arguments.request import (
    foreign_flags,
    hooks_from_args,
    micro_batch_for,
    spec_from_args,
    worker_python,
)

__all__ = [
    "DEFAULT_MASTER_PORT",
    "Layout",
    "fault_spec",
    "foreign_flags",
    "fraction",
    "gpu_counts",
    "gpu_list",
    "gpu_range",
    "hooks_from_args",
    "hours",
    "int_at_least",
    "micro_batch_for",
    "node_layout",
    "non_negative",
    "positive",
    "read_hosts",
    "requested_world",
    "seconds",
    "spec_from_args",
    "tokens_count",
    "usd",
    "worker_python",
]
