"""Every flag that defines a run is defined once (harness.arguments): a configuration turned into `harness
run` arguments and read back is the same configuration, on every stack, with its options and its tuned
set; every flag that two verbs share is one definition, unless the difference is stated below; and every
verb that writes a document names it as the others do."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools

import pytest
from record_factory import make_record

from backends import all_backends, backend_names, get_backend
from backends.base import on_off
from core.records import write_json_atomic
from harness.arguments import run_argv
from harness.cli import main, make_parser
from harness.run.options import run_request
from harness.usage import Parser, UsageError

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


# ------------------------------------------------------------------------- one definition per shared flag
# (flag, verb) -> why this verb defines a flag that other verbs share otherwise. Every other verb that takes
# the flag has the one definition (harness.arguments); a new difference fails until it is stated here.
STATED = {
    # One N per run; a list where a verb runs or prices several
    ("--gpus", "sweep"): "a list of N, run in the order given",
    ("--gpus", "predict"): "rank counts, one prediction each",
    ("--gpus", "select"): "rank counts or a range of doublings, one candidate each",
    # A prediction prices what a cluster trains: bf16 on a GPU profile, fp32 on a CPU (predict/command.py)
    ("--precision", "predict"): "the default is the profile's device's",
    ("--precision", "select"): "a list of precisions to search",
    ("--global-batch", "predict"): "the micro-batch is chosen to fit the profile's memory, not derived",
    ("--global-batch", "select"): "a selection compares candidates at one global batch, 512 by default",
    ("--threads-per-worker", "predict"): "one calibration prices every N: 1 thread unless given",
    ("--threads-per-worker", "select"): "predict's: one calibration prices every N",
    ("--out", "predict"): "a prediction writes records only when asked",
    ("--out", "select"): "a selection writes its record only when asked",
    ("--out", "gate"): "the gate's folder of runs and pairs, which it resumes from",
    # A commbench rank has no steps: its fault's second field counts (op, size) points
    ("--inject-fault", "commbench"): "RANK:POINT:KIND",
    # A job file's allocation (harness.arguments.flags.add_job_arguments), which it hands to run as its layout
    ("--nodes", "slurm"): "the job's size, 1 node unless given",
    ("--nodes", "k8s"): "the job's size, 1 pod unless given",
    ("--gpus-per-node", "slurm"): "the job's size, 1 rank a node unless given",
    ("--gpus-per-node", "k8s"): "the job's size, 1 rank a pod unless given",
    ("--workdir", "slurm"): "the repository on the cluster's shared filesystem",
    ("--workdir", "k8s"): "the repository inside the image",
    # `history` selects recorded runs: these flags filter, they define no run
    ("--backend", "history"): "a backend name or a label",
    ("--workload", "history"): "required: the history of one workload",
    ("--gpus", "history"): "required: the history at one N",
    ("--precision", "history"): "a filter",
    ("--scaling", "history"): "a filter",
    # What a verb writes besides a document: a job file, an export folder, a plot, JSON
    ("--output", "slurm"): "the job file",
    ("--output", "k8s"): "the job file",
    ("--output", "results"): "the export folder",
    ("--output", "history"): "the plot",
    ("--output", "report"): "deprecated: --markdown FILE or --html FILE",
    ("--format", "report"): "deprecated: --markdown FILE or --html FILE",
    ("--format", "results"): "the table or an export's format",
    ("--json", "compare"): "the comparison's JSON file",
    ("--json", "trace"): "JSON instead of text",
    ("--json", "env"): "JSON instead of text",
    # compare decides on one pair of record sets; the gate runs its own sequential experiment
    ("--threshold", "compare"): "3% of throughput",
    ("--threshold", "gate"): "5% of step time",
    ("--statistic", "compare"): "median or min",
    ("--statistic", "gate"): "every per-run statistic, min by default",
    ("--memory-threshold", "compare"): "peak memory or model state",
    ("--memory-threshold", "gate"): "peak memory per rank",
}
# Definitions a verb still writes by hand, which it replaces by the shared one (harness.arguments: add_flags,
# add_document_arguments) as its module moves: a debt, not a difference. Remove an entry when it is paid.
PENDING: set[tuple[str, str]] = set()


def definition(action: argparse.Action) -> tuple:
    """What makes two verbs' flags one flag: how it is given, parsed, checked, defaulted and described."""
    kind, choices = type(action).__name__, action.choices
    choices = tuple(choices) if isinstance(choices, list) else choices
    return (kind, action.default, action.type, choices, action.nargs, action.required, action.help)


def verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def differences(parser: argparse.ArgumentParser, allowed) -> list[str]:
    """Every flag two verbs of `parser` define two ways, less the (flag, verb) pairs `allowed`; and every
    allowed pair that no longer differs (a stale entry)."""
    flags: dict[str, dict[str, tuple]] = collections.defaultdict(dict)
    for verb, sub in verbs(parser).items():
        for action in sub._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    flags[flag][verb] = definition(action)
    problems = []
    for flag, by_verb in sorted(flags.items()):
        shared = {verb: d for verb, d in by_verb.items() if (flag, verb) not in allowed}
        if len(set(shared.values())) > 1:
            kinds = collections.defaultdict(list)
            for verb, d in shared.items():
                kinds[d].append(verb)
            problems.append(f"{flag} is defined {len(kinds)} ways: " + "; ".join(map(str, kinds.values())))
        common = set(shared.values())
        for verb, d in by_verb.items():
            if (flag, verb) in allowed and (d in common or (not common and len(set(by_verb.values())) == 1)):
                problems.append(f"{flag} of {verb} is listed as a difference but is the shared definition")
    return problems


def test_every_flag_two_verbs_share_is_defined_once_or_its_difference_stated():
    parser = make_parser()
    assert differences(parser, {*STATED, *PENDING}) == []
    listed = {*STATED, *PENDING}
    every = {(flag, verb) for verb, sub in verbs(parser).items() for flag in sub._option_string_actions}
    assert listed <= every, f"listed for a verb that has no such flag: {sorted(listed - every)}"


def test_the_walk_finds_a_shared_flag_defined_twice():
    """What the test above catches: one verb's --steps with another default, or another help."""
    parser = Parser(prog="harness")
    sub = parser.add_subparsers(dest="command")
    for verb, default, text in (("a", 20, "measured steps"), ("b", 20, "measured steps"), ("c", 10, "steps")):
        sub.add_parser(verb).add_argument("--steps", type=int, default=default, help=text)
    assert differences(parser, set()) == ["--steps is defined 2 ways: ['a', 'b']; ['c']"]
    assert differences(parser, {("--steps", "c")}) == []
    assert differences(parser, {("--steps", "c"), ("--steps", "a")}) == [
        "--steps of a is listed as a difference but is the shared definition"
    ]


def test_a_stack_added_by_entry_point_gets_its_flags_on_every_verb_that_runs_it():
    """Each stack's Options are added to run, sweep, plan, predict and commbench alike."""
    every = verbs(make_parser())
    for backend in all_backends():
        for flag in backend.Options.flags():
            for verb in ("run", "sweep", "plan", "predict", "commbench", "gate"):
                assert flag in every[verb]._option_string_actions, (verb, flag)


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
