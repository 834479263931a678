"""`harness check FILE...`: does each file match its kind's JSON Schema (core/schemas/)?

One line per file: `FILE: ok (KIND, schema N)`, or `FILE: FIELD: PROBLEM` naming the first failing field as a
JSON path (`r.json: ranks[0].step_times[3]: 'fast' is not of type 'number'`); exit 1 if any file fails. A
record of an older schema is migrated first (core.records.migrate), as every reader does, and the line says
so. Directories are searched for *.json as `harness report` does. A path that cannot be read is a usage
error (exit 2): it says nothing about a record.
"""

from __future__ import annotations

import json
from pathlib import Path

from backends import backend_names
from core.records import (
    BASELINE_KIND,
    SCHEMA_VERSION,
    RecordInvalid,
    migrate,
    record_paths,
    short_repr,
    validate_record,
)
from harness.usage import EXIT_FAILED, EXIT_OK, UsageError


def checked(data, backends: tuple[str, ...]) -> str:
    """What an ok file is ("training, schema 4"; "training, schema 1, migrated to 4"); raises RecordInvalid
    naming the failing field."""
    if isinstance(data, dict) and data.get("kind") == BASELINE_KIND:
        return checked_baseline(data, backends)
    if not isinstance(data, dict):
        raise RecordInvalid("$", f"{short_repr(data)} is not a JSON object")
    version = data.get("schema_version")
    if "schema_version" not in data:
        raise RecordInvalid("schema_version", "required field missing")
    if type(version) is not int or not 1 <= version <= SCHEMA_VERSION:
        raise RecordInvalid(
            "schema_version", f"{short_repr(version)} is not one this harness reads (1 to {SCHEMA_VERSION})"
        )
    record = migrated(data, "")
    kind = validate_record(record, backends)
    return f"{kind}, schema {version}" + (
        f", migrated to {SCHEMA_VERSION}" if version < SCHEMA_VERSION else ""
    )


def checked_baseline(data: dict, backends: tuple[str, ...]) -> str:
    """A baseline holds trimmed records as they were saved; like `harness compare`, migrate them first."""
    records = data.get("records")
    older: set[int] = set()
    if isinstance(records, list):
        for i, record in enumerate(records):
            version = record.get("schema_version") if isinstance(record, dict) else None
            if type(version) is int and 1 <= version < SCHEMA_VERSION:
                older.add(version)
                records[i] = migrated(record, f"records[{i}]")
    kind = validate_record(data, backends)
    versions = f"; records migrated from schema {', '.join(map(str, sorted(older)))}" if older else ""
    return f"{kind}, schema {data.get('baseline_schema_version')}{versions}"


def migrated(record: dict, where: str) -> dict:
    """The record in today's shape; a record too broken to migrate is named as such."""
    try:
        return migrate(record)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        problem = f"cannot migrate from schema {record['schema_version']} ({type(exc).__name__}: {exc})"
        raise RecordInvalid(where or "$", problem) from None


def check_file(path: Path, backends: tuple[str, ...]) -> tuple[bool, str]:
    """(ok, the file's one line). Raises UsageError when the file cannot be read at all."""
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as exc:
        return False, f"{path}: not JSON text ({exc.reason})"
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return False, f"{path}: not JSON ({exc})"
    try:
        return True, f"{path}: ok ({checked(data, backends)})"
    except RecordInvalid as exc:
        return False, f"{path}: {exc}"


def cmd_check(args) -> int:
    missing = [p for p in args.files if not p.exists()]
    if missing:
        raise UsageError(f"{missing[0]}: no such file or directory")
    paths = record_paths(args.files)
    if not paths:
        raise UsageError(f"no *.json files in {', '.join(map(str, args.files))}")
    backends = tuple(backend_names())
    failed = 0
    for path in paths:
        ok, line = check_file(path, backends)
        failed += not ok
        print(line)
    return EXIT_FAILED if failed else EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="validate records and baselines against their JSON Schemas (exit 1 naming the failing field)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("files", nargs="+", type=Path, help="record or baseline files, or directories of them")
    p.set_defaults(func=cmd_check)
