"""Baselines: the trimmed run records a comparison needs, saved as one plain JSON file that can be committed.

`harness baseline save NAME [records...]` writes baselines/NAME/baseline.json. `compare` and `history` read
every input through `load_runs`, which turns a record file, a directory of records or a saved baseline
into the same trimmed form, so there is one code path whatever the source.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from core.records import (
    BASELINE_KIND,
    SCHEMA_VERSION,
    RecordError,
    git_commit,
    load_record,
    load_records,
    migrate,
    now_iso,
    write_record_atomic,
)
from harness.analyze.metrics import per_step_max
from harness.usage import EXIT_OK, UsageError

BASELINE_SCHEMA_VERSION = 1
BASELINE_FILE = "baseline.json"
DEFAULT_BASELINE_DIR = Path("baselines")
TRIMMED_KEYS = (
    "schema_version",
    "run_id",
    "status",
    "config",
    "backend_info",
    "environment",
    "summary",
    "step_times_s",
)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class InputError(ValueError):
    """An input compare/history/baseline cannot use (missing, foreign, other schema): exit 2."""


def trim(record: dict) -> dict:
    """What a comparison needs from a full run record: the per-step samples (step time = slowest rank's
    time, as harness.analyze.metrics defines it) instead of every rank's raw series, logs and launch
    details."""
    ok_ranks = [r for r in record.get("ranks", []) if r.get("status") == "ok"]
    error = record.get("error") or None
    return {
        "schema_version": record["schema_version"],
        "run_id": record["run_id"],
        "status": record["status"],
        "test_hooks": record.get("test_hooks"),  # a slowed or faulted run stays marked as one
        "error": {k: error.get(k) for k in ("rank", "message")} if error else None,
        "config": record["config"],
        "backend_info": record.get("backend_info", {}),
        "environment": record["environment"],
        "summary": record["summary"],
        "kind": record.get("kind", "training"),
        "step_times_s": per_step_max(ok_ranks, "step_times") if record.get("kind") != "commbench" else [],
        "step_cpu_times_s": per_step_max(ok_ranks, "step_cpu_times")
        if record.get("kind") != "commbench"
        else [],
    }


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not readable JSON ({exc})") from None


def is_baseline(data) -> bool:
    return isinstance(data, dict) and data.get("kind") == BASELINE_KIND


def baseline_records(data: dict, path: Path) -> list[dict]:
    """The trimmed records of a saved baseline, checked against both schema versions."""
    if data.get("baseline_schema_version") != BASELINE_SCHEMA_VERSION:
        raise InputError(
            f"{path}: baseline_schema_version {data.get('baseline_schema_version')}, "
            f"this harness reads {BASELINE_SCHEMA_VERSION}"
        )
    records = data.get("records")
    if not isinstance(records, list):
        raise InputError(f"{path}: baseline has no record list")
    for r in records:
        if not isinstance(r, dict) or any(k not in r for k in TRIMMED_KEYS):
            raise InputError(f"{path}: a baseline record lacks one of {', '.join(TRIMMED_KEYS)}")
        if not isinstance(r["schema_version"], int) or not 1 <= r["schema_version"] <= SCHEMA_VERSION:
            raise InputError(
                f"{path}: holds records of schema_version {r['schema_version']}, "
                f"this harness reads 1 to {SCHEMA_VERSION}"
            )
    return [migrate(r) for r in records]


def load_file(path: Path) -> list[dict]:
    """A file named explicitly must be a readable baseline or run record of this schema."""
    data = read_json(path)
    if is_baseline(data):
        return baseline_records(data, path)
    try:
        return [trim(load_record(path))]
    except RecordError as exc:
        raise InputError(str(exc)) from None


def load_runs(path) -> list[dict]:
    """Trimmed records from one input: a run record, a baseline (its file or its directory), or a
    directory of run records. In a directory, files that are not run records (or are corrupt) are skipped
    with a warning, as load_records does, but a directory that yields nothing is an error."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if path.is_dir() and (path / BASELINE_FILE).is_file():
        return load_file(path / BASELINE_FILE)
    if path.is_file():
        return load_file(path)
    runs = [trim(r) for r in load_records([path], kind=None)]
    if not runs:
        raise InputError(f"{path}: no distbench run records (*.json) in this directory")
    return runs


def load_all(paths) -> list[dict]:
    """Trimmed records from several inputs; a run reachable twice (a record and a baseline holding it)
    counts once."""
    runs: dict[str, dict] = {}
    for p in paths:
        for run in load_runs(p):
            runs.setdefault(run["run_id"], run)
    return list(runs.values())


def save_baseline(name: str, runs: list[dict], root: Path) -> Path:
    """Write root/NAME/baseline.json atomically; replaces an older baseline of that name."""
    path = Path(root) / name / BASELINE_FILE
    write_record_atomic(
        path,
        {
            "kind": BASELINE_KIND,
            "baseline_schema_version": BASELINE_SCHEMA_VERSION,
            "name": name,
            "created": now_iso(),
            "git": git_commit(),
            "record_commits": sorted(
                {r["environment"].get("git", {}).get("commit") or "unknown" for r in runs}
            ),
            "records": sorted(runs, key=lambda r: r["run_id"]),
        },
    )
    return path


def cmd_baseline_save(args) -> int:
    if not NAME_PATTERN.match(args.name):
        raise UsageError(
            f"baseline name '{args.name}' must be letters, digits, '.', '_' or '-' (it becomes a directory)"
        )
    try:
        runs = load_all(args.records or [Path("results")])
    except InputError as exc:
        raise UsageError(str(exc)) from None
    replaced = (Path(args.dir) / args.name / BASELINE_FILE).exists()
    path = save_baseline(args.name, runs, args.dir)
    ok = sum(r["status"] == "ok" for r in runs)
    print(
        f"baseline '{args.name}': {len(runs)} record(s) ({ok} ok) -> {path}"
        f"{' (replaced the previous baseline of that name)' if replaced else ''}"
    )
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("baseline", help="save run records as a named baseline for `harness compare`")
    sub = p.add_subparsers(dest="baseline_command", required=True, parser_class=type(p))
    save = sub.add_parser(
        "save", help="store trimmed records as DIR/NAME/baseline.json (commit it to your repo)"
    )
    save.add_argument("name", help="baseline name, e.g. main")
    save.add_argument("records", nargs="*", type=Path, help="record files or directories (default: results/)")
    save.add_argument(
        "--dir", type=Path, default=DEFAULT_BASELINE_DIR, help="where baselines live (default: baselines/)"
    )
    save.set_defaults(func=cmd_baseline_save)
