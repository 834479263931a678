"""Run records: one JSON file per run, with a schema version, written atomically (temp file + rename)."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "crashed", "oom", "timeout")
REQUIRED_KEYS = ("schema_version", "run_id", "status", "config", "ranks", "summary", "environment")


class RecordError(ValueError):
    """A file that is not a readable distbench run record of this schema."""


def write_atomic(path: Path, write) -> None:
    """Never leave a half-written file: `write(tmp_path)` into a temp file beside `path`, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str)))


def load_record(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(record, dict) or any(k not in record for k in REQUIRED_KEYS):
        raise RecordError(f"{path}: not a distbench run record")
    if record["schema_version"] != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version {record['schema_version']}, this harness reads {SCHEMA_VERSION}")
    return record


def record_paths(paths) -> list[Path]:
    """Record files from files and directories (directories are searched for *.json, not recursively into
    the per-run log folders)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.glob("*.json") if not q.name.startswith(".")))
        else:
            out.append(p)
    return out


def load_records(paths, warn=True) -> list[dict]:
    """Every readable record; a corrupt or foreign file is reported by name and skipped."""
    records = []
    for path in record_paths(paths):
        try:
            records.append(load_record(path))
        except RecordError as exc:
            if warn:
                print(f"warning: skipping {exc}", file=sys.stderr)
    return records
