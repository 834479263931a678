"""Typed records: every kind of file the harness writes for a user to keep (training, commbench and
prediction records, baselines) has a JSON Schema in core/schemas/; `harness check` validates files against
them, naming the failing field as a JSON path, and the writers refuse a record that does not match."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import record_factory as factory
from conftest import harness as run_harness

from backends import backend_names
from core.commbench_spec import COLLECTIVE_OPS, COMMBENCH_DTYPES
from core.config import COMPUTE_METHODS, PRECISIONS
from core.hooks import FAULT_KINDS
from core.records import (
    BASELINE_KIND,
    SCHEMA_NAMES,
    SCHEMA_VERSION,
    STATUSES,
    RecordInvalid,
    schemas,
    validate_record,
    write_record_atomic,
)
from harness.analyze import baseline
from harness.analyze.check import check_file
from harness.cli import main
from harness.predict.calibration import calibrate
from harness.predict.command import prediction_record
from harness.predict.hardware import load_profile
from harness.predict.model import predict_point
from harness.run.record import save_record

DATA = Path(__file__).parent / "data"
BACKENDS = tuple(backend_names())
# The folders of tests/data that hold records or baselines (crds/ and gpu-traces/ hold other formats).
RECORD_FOLDERS = [DATA / "schema1", *sorted(p for p in (DATA / "predict").iterdir() if p.is_dir())]


def as_written(record: dict) -> dict:
    """The record as its file holds it (tuples become lists, as json.dumps writes them)."""
    return json.loads(json.dumps(record, default=str))


def prediction() -> dict:
    """A prediction record as `harness predict --hardware h100-sxm --out` writes it, for 8 ranks."""
    cfg = factory.config("torch-ddp", 8, device="cuda", precision="bf16")
    profile = load_profile("h100-sxm")
    calib = calibrate([], cfg, profile)
    point = predict_point(cfg, profile, calib, 1e9, None)
    inputs = {
        "argv": ["predict", "--backend", "torch-ddp", "--gpus", "8", "--hardware", "h100-sxm"],
        "tokens": 1e9,
        "gpu_hour_price_usd": None,
        "schedule": point["schedule"],
        "calibration_records": [],
    }
    return as_written(prediction_record(cfg, point, profile, calib, inputs))


def baseline_file() -> dict:
    """A baseline as `harness baseline save` writes it, over a training and a commbench record."""
    runs = [
        baseline.trim(as_written(factory.make_record(gpus=2))),
        baseline.trim(factory.make_commbench_record()),
    ]
    return {
        "kind": BASELINE_KIND,
        "baseline_schema_version": baseline.BASELINE_SCHEMA_VERSION,
        "name": "main",
        "created": factory.START,
        "git": {"commit": "abc123", "dirty": False},
        "record_commits": ["abc123"],
        "records": as_written(runs),
    }


@pytest.fixture(autouse=True)
def no_git(monkeypatch):
    """The writers ask git which commit they run; a unit test starts no process."""
    commit = {"commit": "abc123", "dirty": False}
    monkeypatch.setattr("harness.predict.command.git_commit", lambda: commit)
    monkeypatch.setattr("harness.analyze.baseline.git_commit", lambda: commit)


SYNTHETIC = {
    "training": lambda: as_written(factory.make_record("torch-ddp", 2, compute_time=0.05)),
    "commbench": lambda: as_written(factory.make_commbench_record()),
    "prediction": prediction,
    BASELINE_KIND: baseline_file,
}


# ------------------------------------------------------------------------------------------ the schemas
@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(schemas()))
def test_each_schema_is_a_valid_draft_2020_12_schema(name):
    schema = schemas()[name]
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.unit
def test_the_schemas_enums_are_the_code_s_own():
    """The schemas are read without Python, so they spell the code's enums out; these are the same lists."""
    common = schemas()["common"]["$defs"]
    assert common["run_status"]["enum"] == list(STATUSES)
    assert common["precision"]["enum"] == list(PRECISIONS)
    assert common["collective_op"]["enum"] == list(COLLECTIVE_OPS)
    assert common["commbench_spec"]["properties"]["dtype"]["enum"] == list(COMMBENCH_DTYPES)
    assert common["config"]["properties"]["measurement"]["properties"]["compute_method"]["enum"] == list(
        COMPUTE_METHODS
    )
    assert common["test_hooks"]["properties"]["fault"]["properties"]["kind"]["enum"] == list(FAULT_KINDS)
    for kind in ("training", "commbench", "prediction"):
        assert schemas()[kind]["properties"]["schema_version"] == {"const": SCHEMA_VERSION}
        assert schemas()[kind]["properties"]["kind"] == {"const": kind}
    base = schemas()["baseline"]["properties"]
    assert base["kind"] == {"const": baseline.BASELINE_KIND}
    assert base["baseline_schema_version"] == {"const": baseline.BASELINE_SCHEMA_VERSION}
    assert base["name"]["pattern"] == baseline.NAME_PATTERN.pattern
    assert set(SCHEMA_NAMES) == {"training", "commbench", "prediction", "selection", BASELINE_KIND}


# ------------------------------------------------------------------------------------ valid files pass
@pytest.mark.unit
@pytest.mark.parametrize("folder", RECORD_FOLDERS, ids=lambda p: str(p.relative_to(DATA)))
def test_every_real_record_validates(folder):
    """Real files written by the harness (schema 1 ones migrated first) all pass, and say what they are."""
    lines = [check_file(path, BACKENDS) for path in sorted(folder.glob("*.json"))]
    assert lines and [line for ok, line in lines if not ok] == []
    said = {re.search(r": ok \((.*)\)$", line).group(1) for _, line in lines}
    if folder.name == "schema1":
        assert said == {
            "training, schema 1, migrated to 4",
            f"{BASELINE_KIND}, schema 1; records migrated from schema 1",
        }
    else:
        assert said == {"training, schema 3, migrated to 4", "commbench, schema 3, migrated to 4"}


@pytest.mark.unit
@pytest.mark.parametrize("kind", SYNTHETIC)
def test_a_synthetic_record_of_each_kind_validates(kind):
    assert validate_record(SYNTHETIC[kind](), BACKENDS) == kind


@pytest.mark.unit
@pytest.mark.parametrize("label", factory.BACKENDS)
@pytest.mark.parametrize("status", ["ok", "failed", "oom", "timeout", "crashed"])
def test_training_records_of_every_stack_and_outcome_validate(label, status):
    record = as_written(factory.make_record(label, 2, status=status, compute_time=0.05))
    assert validate_record(record, BACKENDS) == "training"


@pytest.mark.unit
def test_a_failed_commbench_record_validates():
    assert validate_record(as_written(factory.make_commbench_record(status="failed"))) == "commbench"


# -------------------------------------------------------------------------- corrupted files are named
def set_at(record: dict, path: list, value) -> None:
    for key in path[:-1]:
        record = record[key]
    record[path[-1]] = value


def delete_at(record: dict, path: list) -> None:
    for key in path[:-1]:
        record = record[key]
    del record[path[-1]]


# kind, what is broken, where (a path into the record), the value put there (deleted: "missing"), and the
# start of the one line that must name the field and say what is wrong with it
CORRUPTIONS = [
    ("training", "type", ["ranks", 0, "step_times", 2], "fast",
     "ranks[0].step_times[2]: 'fast' is not of type 'number'"),
    ("training", "missing", ["summary", "step_time_s", "median"], None,
     "summary.step_time_s.median: required field missing"),
    ("training", "enum", ["status"], "slow",
     "status: 'slow' is not one of ['ok', 'failed', 'crashed', 'oom', 'timeout']"),
    ("training", "negative", ["ranks", 1, "memory", "peak_rss"], -1,
     "ranks[1].memory.peak_rss: -1 is less than the minimum of 0"),
    ("training", "extra", ["ranks", 0, "model_state_bytes", "activations"], 5,
     "ranks[0].model_state_bytes.activations: field not in the schema"),
    ("training", "backend", ["config", "backend"], "torch-dpp",
     "config.backend: 'torch-dpp' is not one of ['deepspeed', "),
    ("commbench", "type", ["ranks", 1, "collectives", 0, "times", 3], "1ms",
     "ranks[1].collectives[0].times[3]: '1ms' is not of type 'number'"),
    ("commbench", "missing", ["config", "role", "commbench", "dtype"], None,
     "config.role.commbench.dtype: required field missing"),
    ("commbench", "enum", ["ranks", 0, "collectives", 1, "op"], "allreduce",
     "ranks[0].collectives[1].op: 'allreduce' is not one of ['all_reduce', "),
    ("prediction", "type", ["summary", "corners", "nominal", "step_time_s"], "1 s",
     "summary.corners.nominal.step_time_s: '1 s' is not of type 'number'"),
    ("prediction", "missing", ["inputs", "hardware"], None,
     "inputs.hardware: required field missing"),
    ("prediction", "enum", ["summary", "fits", "verdict"], "maybe",
     "summary.fits.verdict: 'maybe' is not one of ['yes', 'tight', 'no', 'unknown']"),
    (BASELINE_KIND, "type", ["records", 0, "step_times_s", 1], None,
     "records[0].step_times_s[1]: None is not of type 'number'"),
    (BASELINE_KIND, "missing", ["records", 1, "run_id"], None,
     "records[1].run_id: required field missing"),
    (BASELINE_KIND, "enum", ["records", 0, "status"], "fine",
     "records[0].status: 'fine' is not one of ['ok', "),
]  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize(
    "kind, what, where, value, line", CORRUPTIONS, ids=[f"{c[0]}-{c[1]}" for c in CORRUPTIONS]
)
def test_a_corrupted_file_is_rejected_naming_its_field(tmp_path, kind, what, where, value, line):
    record = SYNTHETIC[kind]()
    if what == "missing":
        delete_at(record, where)
    else:
        set_at(record, where, value)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    ok, said = check_file(path, BACKENDS)
    assert not ok and "\n" not in said
    assert said.startswith(f"{path}: {line}"), said


@pytest.mark.unit
@pytest.mark.parametrize(
    "content, line",
    [
        ("{nope", "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ("[1, 2]", "$: [1, 2] is not a JSON object"),
        ('{"schema_version": 9}', "schema_version: 9 is not one this harness reads (1 to 4)"),
        ('{"run_id": "x"}', "schema_version: required field missing"),
        ('{"schema_version": 4, "kind": "wat"}', "kind: 'wat' is not one of"),
    ],
)
def test_a_file_that_is_no_record_says_why_in_one_line(tmp_path, content, line):
    path = tmp_path / "r.json"
    path.write_text(content)
    assert check_file(path, BACKENDS)[1].startswith(f"{path}: {line}")


# ---------------------------------------------------------------------- writers validate before writing
@pytest.mark.unit
def test_the_writer_refuses_an_invalid_record_and_leaves_no_file(tmp_path):
    record = SYNTHETIC["training"]()
    record["ranks"][0]["step_times"][1] = "fast"
    path = tmp_path / "out" / "r.json"
    with pytest.raises(RecordInvalid) as caught:
        write_record_atomic(path, record)
    assert str(caught.value) == f"not writing {path}: ranks[0].step_times[1]: 'fast' is not of type 'number'"
    assert not path.parent.exists() or list(path.parent.iterdir()) == []  # no record, no temp file


@pytest.mark.unit
def test_the_writer_checks_the_json_it_writes_not_the_object_it_was_given(tmp_path):
    """json.dumps(default=str) would write a Path (or any object JSON cannot hold) as a string."""
    record = SYNTHETIC["training"]()
    record["summary"]["t_compute_s"] = Path("0.1")
    with pytest.raises(RecordInvalid, match=r"summary\.t_compute_s: '0\.1' is not of type 'number', 'null'"):
        write_record_atomic(tmp_path / "r.json", record)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
@pytest.mark.parametrize("kind", SYNTHETIC)
def test_the_writer_writes_a_valid_record_of_each_kind(tmp_path, kind):
    record = SYNTHETIC[kind]()
    write_record_atomic(tmp_path / "r.json", record)
    assert json.loads((tmp_path / "r.json").read_text()) == record
    assert check_file(tmp_path / "r.json", BACKENDS)[0]


@pytest.mark.unit
def test_the_runner_and_the_baseline_refuse_an_invalid_record(tmp_path):
    """The writers of the kinds: the runner's save_record (training, commbench records) and save_baseline
    raise instead of writing."""
    record = copy.deepcopy(SYNTHETIC["commbench"]())
    del record["ranks"][0]["collectives"][0]["times"]
    with pytest.raises(RecordInvalid, match=r"ranks\[0\]\.collectives\[0\]\.times: required field missing"):
        save_record(record, tmp_path / "c.json")
    trimmed = baseline.trim(SYNTHETIC["training"]())
    trimmed["status"] = "fine"
    with pytest.raises(RecordInvalid, match=r"records\[0\]\.status: 'fine' is not one of"):
        baseline.save_baseline("main", [trimmed], tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_the_prediction_command_refuses_an_invalid_record(tmp_path, monkeypatch):
    import harness.predict.command as command

    built = command.prediction_record

    def broken(*args):
        record = built(*args)
        record["summary"]["corners"]["slow"]["throughput_tokens_per_s"] = -1.0
        return record

    monkeypatch.setattr(command, "prediction_record", broken)
    args = ["predict", "--backend", "torch-ddp", "--gpus", "8", "--hardware", "h100-sxm", "--out", tmp_path]
    with pytest.raises(
        RecordInvalid, match=r"summary\.corners\.slow\.throughput_tokens_per_s: -1\.0 is less"
    ):
        main(list(map(str, args)))
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------- the command, end to end
def test_harness_check_exit_codes(tmp_path):
    """0: every file ok; 1: one failed (its line names the field, the others are still checked); 2: a path
    that is not there, one line on stderr."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps(SYNTHETIC["training"]()))
    proc = run_harness("check", good)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{good}: ok (training, schema 4)\n", "")

    bad = tmp_path / "bad.json"
    record = SYNTHETIC["commbench"]()
    record["status"] = "slow"
    bad.write_text(json.dumps(record))
    proc = run_harness("check", DATA / "schema1" / "v1-ddp-n1.json", bad)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines() == [
        f"{DATA / 'schema1' / 'v1-ddp-n1.json'}: ok (training, schema 1, migrated to 4)",
        f"{bad}: status: 'slow' is not one of ['ok', 'failed', 'crashed', 'oom', 'timeout']",
    ]

    proc = run_harness("check", good, tmp_path / "absent.json")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"harness: error: {tmp_path / 'absent.json'}: no such file or directory\n"
