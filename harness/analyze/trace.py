"""`harness trace FILE...`: the collectives of the trace files a stack's profiler writes (PyTorch profiler
(kineto) traces), one file per rank, read by the reader its adapter names (Backend.trace_reader), the same
one its workers use for their records, so a trace from any job, on GPU or CPU, can be checked without
running anything.

Per file and op: calls, bytes (nccl-tests' size S summed over the calls), time (the NCCL kernels', or on
CPU the gloo work's), algbw = S / time and busbw = S x the op's bus factor / time, summed over the calls
whose size and time are both known (a time-weighted mean of the calls' bandwidths), and the share of the
time that compute ran alongside. The bus factors are harness.analyze.metrics', the same as commbench's and
the run records'. A size or time the trace does not give stays unknown ("n/a", null), never 0.
"""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from pathlib import Path

from rich.console import Console
from rich.table import Table

from backends import all_backends, load
from backends.comm_trace import NotThisFormat
from harness.analyze.metrics import bus_factor
from harness.usage import EXIT_OK, UsageError, positive


def one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def trace_readers() -> list:
    """The modules that read the stacks' trace files (each adapter's trace_reader, once each), in the
    registry's order."""
    names = dict.fromkeys(b.trace_reader for b in all_backends() if b.trace_reader)
    return [load(name) for name in names]


def file_bytes(path: Path) -> bytes:
    """What one file holds, decompressed where it is gzip (torch writes *.json.gz); a file that is missing
    or cut short is a usage error naming it."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b" or path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise UsageError(f"{path}: not a readable gzip file ({one_line(exc)})") from None
    return raw


def op_figures(calls: list[dict]) -> dict[str, dict]:
    """Per op, the figures of its calls (backends.comm_trace entries)."""
    out = {}
    for op in sorted({c["op"] for c in calls}):
        mine = [c for c in calls if c["op"] == op]
        sized = [c for c in mine if c["size_bytes"] is not None]
        timed = [c for c in mine if c["time_s"] is not None]
        both = [c for c in timed if c["size_bytes"] is not None and c["time_s"] > 0]
        both_time = sum(c["time_s"] for c in both)
        overlapped = [c for c in timed if c["overlapped_s"] is not None]
        overlapped_time = sum(c["time_s"] for c in overlapped)
        out[op] = {
            "calls": len(mine),
            "bytes": sum(c["size_bytes"] for c in sized) if sized else None,
            "calls_unknown_size": len(mine) - len(sized),
            "time_s": sum(c["time_s"] for c in timed) if timed else None,
            "calls_untimed": len(mine) - len(timed),
            "algbw_Bps": sum(c["size_bytes"] for c in both) / both_time if both_time else None,
            "busbw_Bps": (
                sum(c["size_bytes"] * bus_factor(op, c["group_size"]) for c in both) / both_time
                if both_time
                else None
            ),
            "overlap_fraction": (
                sum(c["overlapped_s"] for c in overlapped) / overlapped_time if overlapped_time else None
            ),
            "dtypes": sorted({str(c["dtype"]) for c in mine}),
        }
    return out


def read_file(path: Path, world: int | None) -> dict:
    """One rank's trace file, read by the first stack's reader whose format it is; a file no reader takes is
    a usage error with every reader's reason."""
    raw = file_bytes(path)
    reasons = []
    for reader in trace_readers():
        try:
            found = reader.read_trace_file(raw, world)
        except NotThisFormat as exc:
            reasons.append(str(exc))
            continue
        except ValueError as exc:
            raise UsageError(f"{path}: {one_line(exc)}") from None
        return {
            "file": str(path),
            "rank": found.rank,
            "world_size": found.world_size,
            "timed_by": found.timed_by,
            "ops": op_figures(found.collectives),
            "collectives": found.collectives,
        }
    raise UsageError(f"{path}: {'; '.join(reasons) or 'no installed stack reads trace files'}")


def text(x, spec: str) -> str:
    return "n/a" if x is None else spec.format(x)


def print_tables(files: list[dict]) -> None:
    console = Console(file=sys.stdout, width=120)
    for f in files:
        console.print(
            f"{f['file']}: rank {text(f['rank'], '{}')} of {f['world_size']}, timed by {f['timed_by']}",
            markup=False,
        )
        table = Table()
        for name in ("op", "calls", "bytes", "time", "algbw", "busbw", "overlapped"):
            table.add_column(name, justify="left" if name == "op" else "right", no_wrap=True)
        for op, o in f["ops"].items():
            unknown = f" (+{o['calls_unknown_size']} unknown)" if o["calls_unknown_size"] else ""
            untimed = f" (+{o['calls_untimed']} untimed)" if o["calls_untimed"] else ""
            table.add_row(
                op,
                str(o["calls"]),
                text(o["bytes"], "{:,}") + unknown,
                text(o["time_s"] and o["time_s"] * 1e3, "{:.2f} ms") + untimed,
                text(o["algbw_Bps"] and o["algbw_Bps"] / 1e9, "{:.3g} GB/s"),
                text(o["busbw_Bps"] and o["busbw_Bps"] / 1e9, "{:.3g} GB/s"),
                text(o["overlap_fraction"], "{:.1%}"),
            )
        if not f["ops"]:
            table.add_row("(no collectives in this trace)", *[""] * 6)
        console.print(table)
    console.print(
        "bytes: nccl-tests' size S per call, summed; algbw = S / time, busbw = S x bus factor / time, over "
        "the calls of known size and time; overlapped: the share of the time compute ran alongside",
        markup=False,
    )


def cmd_trace(args) -> int:
    files = [read_file(path, args.world) for path in args.files]  # every file is checked before output
    if args.json:
        print(json.dumps({"files": files}, indent=1))
    else:
        print_tables(files)
    return EXIT_OK


def register(subparsers) -> None:
    formats = ", ".join(reader.FILE_FORMAT for reader in trace_readers())
    p = subparsers.add_parser(
        "trace",
        help=f"collectives in the stacks' trace files ({formats}): calls, bytes, time, algbw/busbw, overlap",
    )
    p.add_argument("files", nargs="+", type=Path, help="trace files, one per rank (gzip-compressed or not)")
    p.add_argument("--json", action="store_true", help="print one JSON document (per file: ops and calls)")
    p.add_argument(
        "--world", type=positive, help="ranks in the job, for traces without distributedInfo.world_size"
    )
    p.set_defaults(func=cmd_trace)
