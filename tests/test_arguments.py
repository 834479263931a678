"""Every flag that defines a run is defined once (harness.arguments): a configuration turned into `harness
run` arguments and read back is the same configuration, on every stack, with its options and its tuned
set; and every verb that writes a document names it as the others do."""

from __future__ import annotations

import argparse
import dataclasses
import functools

import pytest
from record_factory import make_record

from backends import backend_names, get_backend
from backends.base import on_off
from core.records import write_json_atomic
from harness.arguments import run_argv
from harness.cli import main, make_parser
from harness.run.options import run_request
from harness.usage import UsageError

pytestmark = pytest.mark.unit


# -------------------------------------------------------------------------------- config -> argv -> config
def option_argvs(backend) -> list[list[str]]:
    """Each of the stack's options at each value other than its default, as a user would give it."""
    out = []
    for f in dataclasses.fields(backend.Options):
        meta = f.metadata
        if meta["parse"] is on_off:
            values = ["on", "off"] if f.default is None else ["off" if f.default else "on"]
        elif meta["choices"]:
            values = [str(c) for c in meta["choices"] if c != f.default]
        elif f.type in (bool, "bool"):
            out.append([meta["flag"]])
            continue
        else:
            values = ["2.5" if meta["type"] is float else "64"]
        out += [[meta["flag"], value] for value in values]
    return out


SETTINGS = [
    [],
    ["--steps", "7", "--warmup", "1", "--compute-steps", "2", "--seed", "3", "--trace-steps", "1"],
    ["--timeout", "120.5", "--collective-timeout", "30", "--no-trace-comm", "--isolated-repeats", "3"],
    ["--activation-checkpointing", "--tf32", "--dump-weights", "--threads-per-worker", "1"],
    ["--workload", "small", "--layers", "3", "--micro-batch", "2", "--grad-accum", "2"],
    ["--d-model", "96", "--heads", "4", "--global-batch", "16", "--grad-accum", "2", "--precision", "bf16"],
    ["--compute-method", "none"],
    ["--nodes", "2", "--gpus-per-node", "1", "--hosts", "a,b", "--node-rank", "1"],
    [
        "--nodes",
        "2",
        "--gpus-per-node",
        "1",
        "--master",
        "node-a:29600",
        "--node-rank",
        "0",
        "--hosts",
        "x,y",
    ],
]


@functools.cache
def run_parser() -> argparse.ArgumentParser:
    return make_parser("run")


def built(argv: list[str]):
    args = run_parser().parse_args(["run", *argv])
    request = run_request(args)
    return request.config(args.backend, request.world, check_devices=False)


@pytest.mark.parametrize("stack", backend_names())
def test_a_config_read_back_from_its_run_argv_is_the_same_config(stack):
    """argv -> RunConfig -> run_argv -> RunConfig: equal, and run_argv of the second is the first's, for
    the run settings, the layout, every option of the stack at every value, default and tuned, on a CPU
    and (where its tuned set differs there) a GPU."""
    checked, refused = 0, []
    options = option_argvs(get_backend(stack))
    cases = [*SETTINGS, *options, *([*SETTINGS[1], *SETTINGS[7], *option] for option in options)]
    for device in ("cpu", "cuda"):
        for case in cases:
            for variant in ([], ["--tuned"]):
                argv = ["--backend", stack, "--gpus", "2", "--device", device, *case, *variant]
                try:
                    first = built(argv)
                except UsageError as exc:  # a combination the stack refuses (Paddle's stages on a CPU, ...)
                    refused.append(f"{argv}: {exc}")
                    continue
                again = run_argv(first)
                second = built(again)
                assert second == first, (argv, again)
                assert run_argv(second) == again
                checked += 1
    assert checked >= 0.7 * (len(cases) * 4), "\n".join(refused)
    print(f"{stack}: {checked} configurations read back, {len(refused)} refused by the stack")


def test_run_argv_names_what_differs_from_the_defaults_and_the_tuned_set():
    cfg = built(["--backend", "deepspeed", "--gpus", "2", "--device", "cpu", "--zero-stage", "2", "--tuned"])
    argv = run_argv(cfg)
    assert argv[:6] == ["--backend", "deepspeed", "--gpus", "2", "--device", "cpu"]
    assert "--tuned" in argv and argv[argv.index("--zero-stage") + 1] == "2"
    assert "--steps" not in argv and "--precision" not in argv  # the defaults
    with pytest.raises(ValueError, match="role"):
        run_argv(cfg.evolve(isolated_index=0))


# ------------------------------------------------------------------------------------------------- documents
@pytest.fixture
def records(tmp_path):
    for n, t in ((1, 0.10), (2, 0.12)):
        rec = make_record("torch-ddp", n, t)
        write_json_atomic(tmp_path / f"{rec['run_id']}.json", rec)
    return tmp_path


def test_report_writes_each_document_named_by_its_flag(records, tmp_path, capsys):
    """--markdown FILE and --html FILE, either or both (the kind from the flag, not the file's name: a CI
    step summary has no suffix); neither: the Markdown on standard output."""
    md, page = tmp_path / "out" / "step_summary", tmp_path / "out" / "report.page"
    assert main(["report", str(records), "--markdown", str(md), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert md.read_text().startswith("# distbench report") and "<img alt=" not in md.read_text()
    assert page.read_text().startswith("<!DOCTYPE html>") and "<img alt=" in page.read_text()
    assert f"report: {md}" in out and f"report: {page}" in out
    assert main(["report", str(records)]) == 0
    assert capsys.readouterr().out == md.read_text()
    assert main(["report", str(records), "--markdown", "-", "--html", str(page)]) == 0
    out, err = capsys.readouterr()
    assert out == md.read_text() and f"report: {page}" in err
    assert main(["report", str(records), "--markdown", "-", "--html", "-"]) == 2
    assert "only one document can go to standard output" in capsys.readouterr().err


def test_report_still_reads_format_and_output_with_a_warning(records, tmp_path, capsys):
    page = tmp_path / "page.html"
    assert main(["report", str(records), "--format", "html", "--output", str(page)]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert (
        "--format and --output are deprecated: use --markdown FILE or --html FILE" in capsys.readouterr().err
    )
    assert main(["report", str(records), "--format", "html"]) == 0  # as before: beside the records
    assert (records / "report.html").read_text().startswith("<!DOCTYPE html>")
