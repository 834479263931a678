"""The command line of every verb that defines a run, in one place below harness.run and harness.predict
(which never imports harness.run): parsers.py (every argparse type the verbs use), flags.py (each flag
declared once, mostly on RunConfig's own fields, and the argparse options of every verb generated from
the declarations), layout.py (hosts, rendezvous and nodes, read once), request.py (the one path from
parsed arguments to RunConfigs), argv.py (a RunConfig back into `harness run` arguments) and documents.py
(--markdown and --html, for every verb that writes a document)."""

from harness.arguments.argv import run_argv
from harness.arguments.documents import add_document_arguments, write_documents
from harness.arguments.flags import (
    Flag,
    add_flags,
    add_job_arguments,
    add_layout_arguments,
    add_run_arguments,
    add_stack_options,
    add_verb,
    declared,
)
from harness.arguments.layout import DEFAULT_MASTER_PORT, Layout, read_hosts, requested_world
from harness.arguments.parsers import (
    exit_code,
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
    RunRequest,
    foreign_flags,
    hooks_from_args,
    micro_batch_for,
    spec_from_args,
    validated,
    worker_python,
)

__all__ = [
    "DEFAULT_MASTER_PORT",
    "Flag",
    "Layout",
    "RunRequest",
    "add_document_arguments",
    "add_flags",
    "add_job_arguments",
    "add_layout_arguments",
    "add_run_arguments",
    "add_stack_options",
    "add_verb",
    "declared",
    "exit_code",
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
    "non_negative",
    "positive",
    "read_hosts",
    "requested_world",
    "run_argv",
    "seconds",
    "spec_from_args",
    "tokens_count",
    "usd",
    "validated",
    "worker_python",
    "write_documents",
]
