"""Run records: one JSON file per run, with a schema version, written atomically (temp file + rename);
records of an older schema are migrated when read. Each kind of record (and a saved baseline) has a JSON
Schema in core/schemas/, and write_record_atomic checks a record against it before writing, so an invalid
file is never written. Also what makes two records the same configuration."""

from __future__ import annotations

import datetime as dt
import functools
import importlib.resources
import json
import os
import re
import reprlib
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core.config import RunConfig, migrate_config
from core.process import REPO_ROOT
from workloads.spec import PRESETS, ModelSpec

DEFAULT_OUT = Path("results")  # where records go unless --out says otherwise

# 2: config.gpus -> config.world_size (+ gpus_per_node); comm.method -> comm.t_compute_method.
# 3: "kind": "training" (every earlier record) or "commbench" (`harness commbench`).
# 4: config in RunConfig's sections (model, batch, measurement, topology, role) instead of flat.
SCHEMA_VERSION = 4
KINDS = ("training", "commbench", "prediction")
STATUSES = ("ok", "failed", "crashed", "oom", "timeout")
REQUIRED_KEYS = ("schema_version", "run_id", "status", "config", "ranks", "summary", "environment")


# Every kind of JSON file the harness writes for a user to keep -> its schema in core/schemas/. A baseline
# (harness.analyze.baseline) holds trimmed records of the other kinds and has a version of its own.
BASELINE_KIND = "distbench-baseline"
SCHEMA_NAMES = {
    "training": "training",
    "commbench": "commbench",
    "prediction": "prediction",
    "selection": "selection",
    BASELINE_KIND: "baseline",
}


class RecordError(ValueError):
    """A file that is not a readable distbench run record (or one of a newer schema than this harness)."""


class RecordInvalid(RecordError):
    """A record that does not match its kind's schema. `field` is where, as a JSON path
    (ranks[0].step_times[3]; "$" for the whole record), and `problem` what is wrong there."""

    def __init__(self, field: str, problem: str, path: Path | None = None):
        self.field, self.problem, self.path = field, problem, path
        where = f"not writing {path}: " if path is not None else ""
        super().__init__(f"{where}{field}: {problem}")


def current_umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def write_atomic(path: Path, write) -> None:
    """Never leave a half-written file: `write(tmp_path)` into a temp file beside `path`, fsync, rename.
    The file gets the mode a plain open() would give it (0666 less the umask): mkstemp's 0600 would hide
    records from a team sharing the results folder, or from a CI step running as another user."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~current_umask())
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


def write_record_atomic(path: Path, record: dict) -> None:
    """Write a record of a kind in SCHEMA_NAMES atomically, after checking it against its schema; raise
    RecordInvalid (naming the field) and write nothing if it does not match. What is checked is the JSON
    text itself, read back: json.dumps(default=str) turns what JSON cannot hold into strings, which the
    object handed in would hide."""
    text = json.dumps(record, indent=1, sort_keys=True, default=str)
    try:
        validate_record(json.loads(text))
    except RecordInvalid as exc:
        raise RecordInvalid(exc.field, exc.problem, Path(path)) from None
    write_atomic(path, lambda tmp: tmp.write_text(text))


# ------------------------------------------------------------------------------------------ the schemas
@functools.cache
def schemas() -> dict[str, dict]:
    """Every schema in core/schemas/ by file stem (training, commbench, prediction, baseline, common)."""
    folder = importlib.resources.files(__package__ or "core") / "schemas"
    return {
        entry.name.removesuffix(".schema.json"): json.loads(entry.read_text())
        for entry in folder.iterdir()
        if entry.name.endswith(".schema.json")
    }


@functools.lru_cache(maxsize=16)
def record_validator(kind: str, backends: tuple[str, ...] | None = None):
    """A draft 2020-12 validator for records of `kind`, its cross-file references resolved among the
    schemas here. `backends`: the registered stack names, to hold config.backend to them (core cannot ask
    the registry, which sits above it); None keeps the schema's name pattern."""
    jsonschema = import_jsonschema()
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012

    found = schemas()
    if backends is not None:
        common = json.loads(json.dumps(found["common"]))
        common["$defs"]["backend_name"] = {"enum": sorted(backends)}
        found = {**found, "common": common}
    registry = Registry().with_resources(
        (schema["$id"], DRAFT202012.create_resource(schema)) for schema in found.values()
    )
    return jsonschema.Draft202012Validator(found[SCHEMA_NAMES[kind]], registry=registry)


def import_jsonschema():
    """jsonschema, imported here rather than at the top: a worker imports this module in its own stack's
    environment, which need not have it. Where rfc3987-syntax is installed (jupyter's jsonschema
    [format-nongpl] brings it), jsonschema imports it for its "iri" format check, and it builds a grammar
    on import: 2.5 s at the end of every run on a 2-core machine. These schemas check no format, so that
    module is hidden during the import (only when nothing has imported either yet) and back afterwards."""
    hide = "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules
    if hide:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]  # None: `import` raises ImportError
    try:
        import jsonschema  # type: ignore[import-untyped]  # it has no type information
    finally:
        if hide:
            del sys.modules["rfc3987_syntax"]
    return jsonschema


def validate_record(record: Any, backends: tuple[str, ...] | None = None) -> str:
    """Check a record (or a baseline) of today's schema against its kind's schema; return its kind, or
    raise RecordInvalid naming the first field that fails (the shallowest, as jsonschema ranks them)."""
    if not isinstance(record, dict):
        raise RecordInvalid("$", f"{short_repr(record)} is not a JSON object")
    if "kind" not in record:
        raise RecordInvalid("kind", f"required field missing (one of {list(SCHEMA_NAMES)})")
    kind = record["kind"]
    if kind not in SCHEMA_NAMES:
        raise RecordInvalid("kind", f"{short_repr(kind)} is not one of {list(SCHEMA_NAMES)}")
    best_match = import_jsonschema().exceptions.best_match
    error = best_match(record_validator(kind, backends).iter_errors(record))
    if error is not None:
        raise RecordInvalid(*located(error))
    return kind


IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SHORT = reprlib.Repr()
SHORT.maxstring, SHORT.maxother, SHORT.maxlist, SHORT.maxdict = 60, 60, 4, 3


def short_repr(value) -> str:
    return SHORT.repr(value)


def json_path(parts) -> str:
    """['ranks', 0, 'step_times', 3] -> ranks[0].step_times[3]; a key that is no identifier in brackets."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif IDENTIFIER.fullmatch(part):
            out += f".{part}" if out else part
        else:
            out += f"[{json.dumps(part)}]"
    return out or "$"


def located(error) -> tuple[str, str]:
    """(JSON path of the failing field, what is wrong with it) from a jsonschema error: a missing field is
    named by its own path, not its parent's, and a value in the message is shortened to keep one line."""
    parts = list(error.absolute_path)
    problem = error.message
    if error.validator == "required":
        missing = [p for p in error.validator_value if error.message == f"{p!r} is a required property"]
        if missing:
            parts.append(missing[0])
            problem = "required field missing"
    elif error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = error.schema.get("properties", {})
        extra = sorted(k for k in error.instance if k not in known)
        if extra:
            parts.append(extra[0])
            problem = "field not in the schema"
    else:
        problem = problem.replace(repr(error.instance), short_repr(error.instance), 1)
    return json_path(parts), " ".join(problem.split())


def load_record(path: Path) -> dict:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(record, dict) or any(k not in record for k in REQUIRED_KEYS):
        raise RecordError(f"{path}: not a distbench run record")
    version = record["schema_version"]
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version {version}, this harness reads 1 to {SCHEMA_VERSION}")
    try:
        record = migrate(record)
        if not isinstance(record["config"]["topology"].get("world_size"), int):
            raise KeyError("world_size")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{path}: not a distbench run record (config: {exc})") from None
    return record


def migrate(record: dict) -> dict:
    """A record of any earlier schema in today's shape (the stored summary is kept as written; every
    analysis recomputes the summary from the raw rank records)."""
    if record["schema_version"] == 1:
        record = {
            **record,
            "config": migrate_config(record["config"]),
            "schema_version": 2,
            "migrated_from": 1,
        }
        comm = dict(record.get("comm") or {})
        if "method" in comm:
            comm["t_compute_method"] = comm.pop("method")
        record["comm"] = comm
        info = record.get("backend_info") or {}
        if "kind" in (info.get("comm_pattern") or {}):
            record["backend_info"] = {
                **info,
                "comm_pattern": legacy_comm_pattern(info["comm_pattern"], record["config"]),
            }
    if record["schema_version"] == 2:
        record = {**record, "schema_version": 3, "kind": "training"}
        record.setdefault("migrated_from", 2)
    if record["schema_version"] == 3:
        flat = record["config"]
        # Test hooks (core.hooks) were settings in the config until they left it for the record's top level.
        hooks = {k: flat[k] for k in ("step_delay_s", "fault") if flat.get(k) not in (None, 0, 0.0)}
        record = {**record, "schema_version": 4, "config": migrate_config(flat)}
        if hooks:
            record["test_hooks"] = {**hooks, **(record.get("test_hooks") or {})}
        record.setdefault("migrated_from", 3)
    return record


def legacy_comm_pattern(pattern: dict, cfg: dict) -> dict:  # cfg: already migrated (sections)
    """Schema 1's comm pattern ({kind, dtype_bytes, reduce_dtype_bytes, param_gathers}: every parameter
    all-reduced, or gathered `param_gathers` times and reduce-scattered, once per step) as terms."""
    n = ModelSpec(**cfg["model"]["spec"]).n_params
    gather, reduce = pattern["dtype_bytes"], pattern.get("reduce_dtype_bytes") or pattern["dtype_bytes"]
    if pattern["kind"] == "allreduce":
        terms = [
            {"op": "all_reduce", "elements": n, "dtype_bytes": reduce, "per_step": 1, "what": "gradients"}
        ]
    else:
        terms = [
            {
                "op": "all_gather",
                "elements": n,
                "dtype_bytes": gather,
                "per_step": pattern.get("param_gathers", 2),
                "what": "parameters",
            },
            {
                "op": "reduce_scatter",
                "elements": n,
                "dtype_bytes": reduce,
                "per_step": 1,
                "what": "gradients",
            },
        ]
    return {
        "terms": terms,
        "assumptions": "schema 1 record: every parameter in every collective, once per step",
    }


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


def load_records(paths, warn=True, kind: str | None = "training") -> list[dict]:
    """Every readable record of `kind` (None: of any kind); a corrupt or foreign file is reported by name
    and skipped, a record of another kind silently (training and commbench records share a folder)."""
    records = []
    for path in record_paths(paths):
        try:
            record = load_record(path)
        except RecordError as exc:
            if warn:
                print(f"warning: skipping {exc}", file=sys.stderr)
            continue
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def git_commit() -> dict:
    if not (REPO_ROOT / ".git").exists():  # an installed wheel: a repository holding its venv is not ours
        return {"commit": None, "dirty": None}

    def git(*args):
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


# ------------------------------------------------------------------------------ the same configuration
def run_config(record: dict) -> RunConfig:
    """A record's config as the typed RunConfig every reader uses (load_record has migrated a record of
    any schema; a config still flat, from a record built by an older writer, is migrated here too)."""
    return RunConfig.from_dict(record["config"])


def workload_name(cfg: RunConfig) -> str:
    """The preset name, plus the fields that differ from it when the spec was overridden, so runs of
    different models never share a group."""
    preset, spec = PRESETS.get(cfg.model.workload), cfg.model.spec
    if preset is None or preset == spec:
        return cfg.model.workload
    changed = [f"{k}={v}" for k, v in spec.to_dict().items() if preset.to_dict().get(k) != v]
    return f"{cfg.model.workload}({', '.join(changed)})"


def device_name(record: dict) -> str | None:
    """The device the ranks ran on (its kind: a GPU model, or the CPU model); None if no rank said."""
    return (record.get("environment") or {}).get("device_kind")


def batch_name(cfg: RunConfig) -> str:
    """The batch that defines a scaling series: per rank for weak scaling, global for strong."""
    if cfg.batch.scaling == "strong":
        return f"{cfg.global_batch} seq global, {cfg.batch.grad_accum} accum"
    return f"{cfg.batch.micro_batch} seq/rank x {cfg.batch.grad_accum} accum"


def settings_name(cfg: RunConfig) -> str:
    """What else changes the work of a step or how it is measured: nodes, checkpointing, the data, threads
    per CPU worker (N workers share one machine's cores: another thread count is other hardware), and the
    number of warm-up and measured steps."""
    topo = cfg.topology
    parts = [f"{topo.nodes} node(s)"] if topo.nodes > 1 else []
    parts += ["activation checkpointing"] if cfg.model.activation_checkpointing else []
    parts += [f"data {Path(cfg.batch.data_path).name}"] if cfg.batch.data_path else []
    parts += [f"{topo.threads_per_worker} thread(s)/worker"] if topo.device == "cpu" else []
    parts.append(f"{cfg.measurement.warmup}+{cfg.measurement.steps} steps")
    return ", ".join(parts)


@dataclass(frozen=True, order=True)
class ConfigKey:
    """What makes two runs the same measurement: everything that changes a step's work or the hardware it
    ran on, and nothing else (not the seed, timeouts, run ids, the t_compute method or test-only settings).
    Sweeps (resume), analysis (groups), compare (pairs) and history (series) all match runs by it."""

    label: str  # backend with its options, e.g. deepspeed-zero2
    workload: str  # preset, with any overrides
    world_size: int
    precision: str
    scaling: str
    batch: str
    settings: str
    device: str  # device kind (with threads per CPU worker); "*" matches any device

    def text(self) -> str:
        parts = [
            self.label,
            self.workload,
            f"N={self.world_size}",
            self.precision,
            self.scaling,
            self.batch,
            self.settings,
        ]
        return " · ".join(parts + ([self.device] if self.device != "*" else []))

    def any_device(self) -> ConfigKey:
        return replace(self, device="*")


def config_key(record: dict, device: str | None = None) -> ConfigKey:
    """The configuration of a record (or of {"config": ..., "backend_info": {"label": ...}} for a run still to
    be made); `device` overrides the record's own device ("*" to match across devices)."""
    cfg = run_config(record)
    topo = cfg.topology
    label = (record.get("backend_info") or {}).get("label") or cfg.backend
    if record.get("kind") == "commbench":  # the stack's collectives: no model, batch or steps
        bench = cfg.commbench_spec
        return ConfigKey(
            label=label,
            workload="commbench " + ",".join(bench.ops),
            world_size=topo.world_size,
            precision=bench.dtype,
            scaling="-",
            batch=f"{len(bench.sizes)} sizes {bench.sizes[0]}-{bench.sizes[-1]} B",
            settings=", ".join(
                ([f"{topo.nodes} node(s)"] if topo.nodes > 1 else [])
                + ([f"{topo.threads_per_worker} thread(s)/worker"] if topo.device == "cpu" else [])
                + [f"{bench.warmup}+{bench.iters} calls"]
            ),
            device=device or str(device_name(record)),
        )
    return ConfigKey(
        label=label,
        workload=workload_name(cfg),
        world_size=topo.world_size,
        # TF32 matmuls are other maths than IEEE fp32 ones: never repeats of one measurement
        precision=cfg.model.precision + ("+tf32" if cfg.model.tf32 else ""),
        scaling=cfg.batch.scaling,
        batch=batch_name(cfg),
        settings=settings_name(cfg),
        device=device or str(device_name(record)),
    )
