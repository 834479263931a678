"""Records and baselines of an older schema keep working: tests/data/schema1 holds REAL files written by the
schema-1 harness (commit aaaa457: two torch-ddp tiny runs on CPU at N=1 and N=2, 1+4 steps, and
`harness baseline save v1main` over them), read here with today's code, in process."""

import json
import shutil
from pathlib import Path

import pytest

from backends import get_backend
from core.records import SCHEMA_VERSION, RecordError, config_key, load_record, run_config, write_json_atomic
from harness.analyze.metrics import summarize
from harness.cli import main
from harness.run.record import assemble_record

pytestmark = pytest.mark.unit

SCHEMA1 = Path(__file__).parent / "data" / "schema1"
RECORDS = {1: SCHEMA1 / "v1-ddp-n1.json", 2: SCHEMA1 / "v1-ddp-n2.json"}
COMMIT = "aaaa457478"  # the commit that wrote them, as reports show it
# Throughput (tokens/s) and exposed-communication ratio of each run, as the schema-1 harness printed them
# when it wrote the records (N=2: t_compute 98.0 ms by no_sync against a 111.5 ms step).
THROUGHPUT = {1: "17,681", 2: "18,361"}
EXPOSED = {1: "0.0%", 2: "12.1%"}


@pytest.fixture
def v1(tmp_path):
    """Copies of the schema-1 files: the records in v1/records, the baseline in v1/baselines/v1main."""
    records, baseline = tmp_path / "records", tmp_path / "baselines" / "v1main"
    records.mkdir(parents=True)
    baseline.mkdir(parents=True)
    for path in RECORDS.values():
        shutil.copy(path, records / path.name)
    shutil.copy(SCHEMA1 / "baseline.json", baseline / "baseline.json")
    return records, baseline


def test_the_files_are_schema_1():
    for n, path in RECORDS.items():
        raw = json.loads(path.read_text())
        assert raw["schema_version"] == 1 and raw["config"]["gpus"] == n and "world_size" not in raw["config"]
        assert "method" in raw["comm"] and "t_compute_method" not in raw["comm"]
    baseline = json.loads((SCHEMA1 / "baseline.json").read_text())
    assert baseline["baseline_schema_version"] == 1
    assert [(r["schema_version"], r["config"]["gpus"]) for r in baseline["records"]] == [(1, 1), (1, 2)]


@pytest.mark.parametrize("n, method", [(1, "none"), (2, "no_sync")])
def test_load_record_migrates_to_today_s_schema(n, method):
    record = load_record(RECORDS[n])
    assert record["schema_version"] == SCHEMA_VERSION == 4 and record["migrated_from"] == 1
    topology = run_config(record).topology
    assert topology.world_size == n and topology.gpus_per_node == n and "gpus" not in record["config"]
    assert record["comm"]["t_compute_method"] == method and "method" not in record["comm"]
    # Today's metrics read the migrated record as the schema-1 harness did when it wrote its summary.
    stored, now = record["summary"], summarize(record)
    for key in (
        "tokens_per_step",
        "throughput_tokens_per_s",
        "exposed_comm_ratio",
        "t_compute_s",
        "comm_bytes_per_rank_per_step",
        "model_state_bytes_analytic",
        "peak_rss_bytes",
    ):
        assert now[key] == pytest.approx(stored[key]), key
    # Today's RunConfig takes the migrated config, and a record today's runner assembles from the same run is
    # the same configuration.
    again = assemble_record(
        get_backend(record["config"]["backend"]),
        run_config(record),
        record["run_id"],
        record["ranks"],
        isolated_ranks=record["isolated_ranks"],
        environment=record["environment"],
    )
    assert config_key(again) == config_key(record)


def test_report_over_schema_1_records(v1, capsys):
    records, _ = v1
    assert main(["report", str(records), "--format", "md"]) == 0
    out, err = capsys.readouterr()
    assert "skipping" not in err
    assert "2 run record(s): 2 ok, 0 failed" in out
    for n in (1, 2):
        row = next(
            (line for line in out.splitlines() if line.startswith(f"| torch-ddp | {n} | 1 ok |")), None
        )
        assert row is not None, out
        assert THROUGHPUT[n] in row and f"| {EXPOSED[n]} |" in row  # the t_compute method survived migration


def test_compare_schema_1_baseline_with_schema_1_records(v1, tmp_path, capsys):
    records, baseline = v1
    out = tmp_path / "compare.json"
    assert main(["compare", str(baseline), str(records), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(c["match"]["world_size"] for c in result["comparisons"]) == [1, 2]
    assert result["only_in_baseline"] == result["only_in_candidate"] == result["not_compared"] == []
    assert all(c["metrics"][0]["change"] == 0 for c in result["comparisons"])  # the same runs on both sides
    assert "no regression" in capsys.readouterr().out


def test_compare_schema_1_baseline_with_runs_recorded_today(v1, tmp_path, capsys):
    """An old baseline committed to a repo against runs the runner records today (the same runs, assembled as
    schema 2): both configurations pair up."""
    _, baseline = v1
    today = tmp_path / "today"
    for path in RECORDS.values():
        old = load_record(path)
        record = assemble_record(
            get_backend("torch-ddp"),
            run_config(old),
            old["run_id"] + "-v2",
            old["ranks"],
            isolated_ranks=old["isolated_ranks"],
            launch=old["launch"],
            environment=old["environment"],
            sweep=old["sweep"],
        )
        assert record["schema_version"] == 4 and "migrated_from" not in record
        write_json_atomic(today / f"{record['run_id']}.json", record)
    out = tmp_path / "compare.json"
    assert main(["compare", str(baseline), str(today), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert sorted(c["match"]["world_size"] for c in result["comparisons"]) == [1, 2]
    assert result["only_in_baseline"] == result["only_in_candidate"] == []


@pytest.mark.parametrize("source", ["records", "baseline"])
def test_history_over_schema_1_files(v1, capsys, source):
    records, baseline = v1
    path = records if source == "records" else baseline
    assert main(["history", str(path), "--backend", "torch-ddp", "--workload", "tiny", "--gpus", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {COMMIT} |")]
    assert len(rows) == 1 and "| 1 (0) | " + THROUGHPUT[2] + " |" in rows[0]


def test_a_newer_schema_is_refused_with_one_line(v1, tmp_path, capsys):
    records, baseline = v1
    future = tmp_path / "future.json"
    future.write_text(json.dumps({**json.loads(RECORDS[2].read_text()), "schema_version": 99}))
    with pytest.raises(RecordError, match="schema_version 99, this harness reads 1 to 4"):
        load_record(future)
    assert main(["compare", str(baseline), str(future)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("harness: error: ") and "schema_version 99" in err[0]
    # A baseline holding such a record is refused the same way.
    data = json.loads((baseline / "baseline.json").read_text())
    data["records"][1]["schema_version"] = 99
    (baseline / "baseline.json").write_text(json.dumps(data))
    assert main(["compare", str(baseline), str(records)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds records of schema_version 99" in err[0]
