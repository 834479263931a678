"""`harness report`: the scaling tables, plots and framework-selection advice of a set of run records, as
Markdown (PR comment, terminal) or one self-contained HTML file (plots embedded as PNG, opens offline),
named as every verb that writes a document names them (harness.arguments.documents: --markdown FILE,
--html FILE); `harness results`: the tidy table itself, as CSV or Parquet, or exported (TensorBoard,
github-benchmark).

The commands only: they load the records, pick the sections (training.py, selection.py, commbench.py,
prediction.py), render them (harness/document.py) and write the output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from core.records import DEFAULT_OUT, load_records, write_atomic
from harness.analyze.analysis import DEFAULT_NOISE_CV, aggregate, runs_table
from harness.analyze.collectives import commbench_aggregate, commbench_rows
from harness.analyze.export import write_github_benchmark, write_tensorboard
from harness.analyze.predictions import prediction_rows
from harness.analyze.report.commbench import commbench_sections
from harness.analyze.report.prediction import prediction_sections
from harness.analyze.report.training import build
from harness.arguments import add_document_arguments, write_documents
from harness.document import Section
from harness.usage import EXIT_OK, UsageError, fraction, positive

FORMATS = ("md", "html")  # of the deprecated --format


def load(paths: list[Path], kind: str = "training") -> list[dict]:
    records = load_records(paths, kind=kind)
    if not records:
        raise UsageError(
            f"no run records ({kind}) in {', '.join(map(str, paths))}; run "
            + {"commbench": "`harness commbench`", "prediction": "`harness predict --out DIR`"}.get(
                kind, "`harness run` or `harness sweep`"
            )
            + " first"
        )
    return records


def cmd_report(args) -> int:
    training = load_records(args.paths)
    collectives = load_records(args.paths, kind="commbench", warn=False)
    predictions = load_records(args.paths, kind="prediction", warn=False)
    if not training and not collectives and not predictions:
        raise UsageError(
            f"no run records in {', '.join(map(str, args.paths))}; run `harness run`, `harness sweep` or "
            "`harness commbench` first"
        )
    documents_from_format(args)
    if not (args.markdown or args.html):
        args.markdown = "-"  # the Markdown on standard output
    with_figures = bool(args.html)
    sections = (
        build(training, args.at_gpus, args.noise_cv, with_figures)
        if training
        else [
            Section(
                "distbench report",
                1,
                [
                    f"{len(collectives)} commbench and {len(predictions)} prediction record(s), "
                    "no training runs."
                ],
            )
        ]
    )
    sections += commbench_sections(collectives, with_figures)
    sections += prediction_sections(predictions, training, with_figures)
    write_documents(args, sections, label="report")
    return EXIT_OK


def documents_from_format(args) -> None:
    """The deprecated --format md|html and --output FILE as the documents they asked for: --format html
    with no --output wrote <results>/report.html."""
    if args.format is None and args.output is None:
        return
    print(
        "harness: --format and --output are deprecated: use --markdown FILE or --html FILE", file=sys.stderr
    )
    if args.format == "html":
        first = args.paths[0]
        args.html = args.output or (first if first.is_dir() else first.parent) / "report.html"
    elif args.output is not None:
        args.markdown = args.output


RESULT_COLUMNS = [
    "run_id",
    "status",
    "label",
    "workload",
    "precision",
    "device",
    "scaling",
    "batch",
    "world_size",
    "repeat",
    "throughput",
    "exposed_comm_ratio",
    "peak_memory_bytes",
]


def commbench_results(args) -> int:
    """`harness results --kind commbench`: the tidy table of collective timings (per record, op and size)."""
    if args.format != "table":
        raise UsageError(f"--format {args.format} is for training records; commbench records: table only")
    rows = commbench_rows(load(args.paths, kind="commbench"))
    table = commbench_aggregate(rows) if args.aggregate else rows
    return write_table(table, args, table)


def write_table(table: pd.DataFrame, args, shown: pd.DataFrame) -> int:
    if args.csv:
        write_atomic(args.csv, lambda tmp: table.to_csv(tmp, index=False))
        print(f"csv: {args.csv} ({len(table)} rows)")
    if args.parquet:
        write_atomic(args.parquet, lambda tmp: table.to_parquet(tmp, index=False))
        print(f"parquet: {args.parquet} ({len(table)} rows)")
    if not (args.csv or args.parquet):
        with pd.option_context("display.width", 250, "display.max_columns", None):
            print(shown.to_string(index=False))
    return EXIT_OK


def cmd_results(args) -> int:
    if args.kind == "commbench":
        return commbench_results(args)
    if args.kind == "prediction":
        if args.format != "table":
            raise UsageError(
                f"--format {args.format} is for training records; prediction records: table only"
            )
        table = prediction_rows(load(args.paths, kind="prediction"))
        return write_table(table, args, table)
    records = load(args.paths)
    if args.format == "tensorboard":
        out = args.output or Path(args.paths[0]) / "tensorboard"
        folders = write_tensorboard(records, out)
        print(f"tensorboard: {len(folders)} run(s) under {out} (view with: tensorboard --logdir {out})")
        return EXIT_OK
    runs = runs_table(records)
    if args.format == "github-benchmark":
        out = args.output or Path(args.paths[0]) / "github-benchmark"
        for path in write_github_benchmark(aggregate(runs, args.noise_cv), runs, out):
            print(f"{path.stem}: {path}")
        return EXIT_OK
    table = aggregate(runs, args.noise_cv) if args.aggregate else runs
    return write_table(table, args, table if args.aggregate else table[RESULT_COLUMNS])


def register(subparsers) -> None:
    def common(p):
        p.add_argument(
            "paths",
            nargs="*",
            type=Path,
            default=[DEFAULT_OUT],
            help="record files or directories (default: results/)",
        )
        p.add_argument(
            "--noise-cv",
            type=fraction,
            default=DEFAULT_NOISE_CV,
            help="flag a backend x N as noisy when its repeats' coefficient of variation exceeds this",
        )

    p = subparsers.add_parser(
        "report",
        help="scaling tables, plots and framework selection from run records (Markdown on standard output "
        "unless --markdown or --html says where)",
    )
    common(p)
    add_document_arguments(p)
    # Before --markdown and --html: --format md|html with --output FILE; still read, with a warning.
    p.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
    p.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    p.add_argument(
        "--at-gpus",
        type=positive,
        help="N for the framework selection (default: the largest that fits the CPUs, else the largest)",
    )
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser("results", help="the tidy table of run records (one row per run), or export it")
    common(p)
    p.add_argument("--csv", type=Path, help="write the table as CSV")
    p.add_argument("--parquet", type=Path, help="write the table as Parquet")
    p.add_argument(
        "--aggregate", action="store_true", help="one row per backend x N x context instead of per run"
    )
    p.add_argument(
        "--kind",
        choices=("training", "commbench", "prediction"),
        default="training",
        help="which records: training runs (default), `harness commbench` collective timings (one row "
        "per record, op and size; --aggregate: per stack, N, op and size over records), or `harness "
        "predict --out` predictions (one row per configuration and N, nominal with its band)",
    )
    p.add_argument(
        "--format",
        choices=("table", "tensorboard", "github-benchmark"),
        default="table",
        help="tensorboard: per-step curves of every ok run as event files; github-benchmark: the JSON files "
        "of github-action-benchmark's customBiggerIsBetter / customSmallerIsBetter tools",
    )
    p.add_argument(
        "--output",
        type=Path,
        help="folder for tensorboard / github-benchmark (default: <first path>/<format>)",
    )
    p.set_defaults(func=cmd_results)
