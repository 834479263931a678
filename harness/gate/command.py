"""`harness gate --base REF|DIR --head REF|DIR [run arguments]`: a gate that runs its own experiment.

It launches `harness run` with the run arguments given (the same for both sides, plus `--base-args` or
`--head-args` for one side only) in pairs, base and head one after the other in a random order within each
pair (seeded, the seed recorded), and takes one paired log-ratio per pair, log(stat_head / stat_base), of a
per-run statistic of the step times (`--statistic`; the fastest step by default): a drift of the machine
lands on both runs of a pair and cancels in their ratio. After every pair a sequential test
(harness.analyze.sequential) decides between "no slowdown" and "a slowdown of at least `--threshold`", with
its error rates holding although it looks after every pair; the gate stops as soon as it decides, or when
`--max-pairs` or `--max-minutes` runs out.

Each side is a git ref (checked out with `git worktree add --detach` into a temporary folder, removed at the
end, interrupted or not, and by the next gate where a SIGKILL left no time to) or a directory holding a
distbench tree; each side's runs import that tree's own harness (its folder first on sys.path; the gate
checks it). It only shells out to `harness run`, so it works alike on a CPU runner, a GPU node (`--gpus`,
`--device` pass through) and inside a Slurm allocation.

Besides the step time: communication bytes per step and model-state bytes per rank are deterministic, so
any change between the sides is reported as one, and growth fails the gate, with no statistics; peak memory
per rank is gated as `harness compare` gates it (`--memory-threshold`).

Everything lands in `--out` (default results/gate-<hash of the configuration>): the runs' records under base/
and head/ (so `harness compare OUT/base OUT/head` reads them), one line per finished pair in pairs.jsonl
(rewritten atomically after each pair), failed pairs in failures.jsonl, the configuration in gate.json, the
verdict in verdict.json and, as a pull request's comment shows it, in OUT/verdict.md. Run again with the same
arguments and `--out`, it resumes from the recorded pairs; another configuration there is refused.

Exit codes: 0 NO REGRESSION; 1 REGRESSION (a slowdown, exact growth, peak memory over its threshold, or a
head run failing where the base ran); 2 bad input (a ref that does not exist, a tree whose harness cannot
run the arguments, runs failing on the base side or on both, a --max-pairs below the first look, another
gate's --out); `--inconclusive-exit` (default 3) INCONCLUSIVE, a budget spent before a decision; 130
interrupted (the pairs recorded stay).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path

from harness.analyze.compare import DEFAULT_MEMORY_THRESHOLD
from harness.analyze.samples import STATISTICS
from harness.analyze.sequential import Design
from harness.arguments import add_flags, add_run_arguments, add_verb
from harness.arguments.parsers import exit_code, fraction, int_at_least, seconds
from harness.gate.launching import Runner, RunOutcome, launch_run, plan_duet
from harness.gate.pairs import DEFAULT_MAX_MINUTES, DEFAULT_STATISTIC, EXIT_INCONCLUSIVE, Settings, run_gate
from harness.gate.trees import SIDES, checked_out, probe_tree, repository, resolve_tree
from harness.gate.verdict import anatomy_text
from harness.run.devices import visible_gpus
from harness.run.launch import stop_on_sigterm
from harness.usage import Parser, UsageError

DEFAULT_THRESHOLD = 0.05
DEFAULT_MAX_PAIRS = 40
# The calibration's cost grows with the square of the looks (about ten seconds at 100); a budget beyond it
# is better spent on a quieter machine or a higher threshold.
MAX_PAIRS_LIMIT = 100


def add_gate_options(p: argparse.ArgumentParser) -> None:
    """The gate's own options; every other option is a run argument, passed to both sides' `harness run`."""
    p.add_argument(
        "--base", required=True, metavar="REF|DIR", help="the code to gate against: a git ref or a directory"
    )
    p.add_argument(
        "--head", required=True, metavar="REF|DIR", help="the code under test: a git ref or a directory"
    )
    p.add_argument(
        "--threshold",
        type=fraction,
        default=DEFAULT_THRESHOLD,
        help="the slowdown of the step time that counts, e.g. 0.05 or 5%% "
        f"(default {DEFAULT_THRESHOLD:.0%}%)",
    )
    p.add_argument(
        "--max-pairs",
        type=pairs_budget,
        default=DEFAULT_MAX_PAIRS,
        help=f"most pairs to run, {Design().min_pairs} to {MAX_PAIRS_LIMIT}; the design is calibrated for "
        f"this many looks (default {DEFAULT_MAX_PAIRS})",
    )
    p.add_argument(
        "--max-minutes",
        type=seconds,
        default=DEFAULT_MAX_MINUTES,
        help="minutes of pairs to spend at most; no pair starts that would end past it "
        f"(default {DEFAULT_MAX_MINUTES:g})",
    )
    p.add_argument("--base-args", default="", metavar="'ARGS'", help="run arguments for the base side only")
    p.add_argument(
        "--head-args",
        default="",
        metavar="'ARGS'",
        help="run arguments for the head side only, e.g. --head-args '--step-delay 0.01' (one flag alone: "
        "--head-args=--tf32)",
    )
    p.add_argument(
        "--order-seed", type=int, help="seed of the order within each pair (default: drawn, recorded)"
    )
    p.add_argument(
        "--out", type=Path, help="where the runs and pairs go, and resume from (default: results/gate-<hash>)"
    )
    p.add_argument(
        "--statistic",
        choices=list(STATISTICS),
        default=DEFAULT_STATISTIC,
        help=f"per-run statistic of the step times (default {DEFAULT_STATISTIC}: the least noisy measured; "
        "docs/ci-gate.md)",
    )
    p.add_argument(
        "--memory-threshold",
        type=fraction,
        default=DEFAULT_MEMORY_THRESHOLD,
        help=f"relative growth of peak memory per rank that counts (default {DEFAULT_MEMORY_THRESHOLD:.0%}%)",
    )
    p.add_argument(
        "--duet",
        action="store_true",
        help="run base and head of each pair at the same time, each on its own half of the node's GPUs "
        "(or of its cores, pinned, on a CPU), the halves swapped every pair; needs room for 2 x --gpus",
    )
    p.add_argument(
        "--inconclusive-exit",
        type=exit_code,
        default=EXIT_INCONCLUSIVE,
        help=f"exit code of INCONCLUSIVE (default {EXIT_INCONCLUSIVE}; 0 lets it pass, 1 fails it)",
    )


def pairs_budget(text: str) -> int:
    """--max-pairs: from the design's first look (fewer could never decide) to MAX_PAIRS_LIMIT. Here, not
    with the other types in harness.arguments.parsers: its lower bound is the sequential design's
    (harness.analyze.sequential.Design), which the arguments do not import."""
    lowest = Design().min_pairs
    what = f"a number of pairs from {lowest} (the first look) to {MAX_PAIRS_LIMIT}"
    value = int_at_least(lowest, what)(text)
    if value > MAX_PAIRS_LIMIT:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def split_args(text: str, flag: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise UsageError(f"{flag} '{text}': {exc}") from None


def run_tokens(argv: list[str]) -> list[str]:
    """The run arguments as given: the command line less the gate's own options."""
    own = Parser(add_help=False, allow_abbrev=False)
    add_gate_options(own)
    for action in own._actions:
        action.required = False
    _, rest = own.parse_known_args(argv)
    return rest


def cmd_gate(args, runner: Runner | None = None) -> int:
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    tokens = run_tokens(argv[1:] if argv and argv[0] == "gate" else argv)
    side_args = {
        "base": split_args(args.base_args, "--base-args"),
        "head": split_args(args.head_args, "--head-args"),
    }
    design = Design(threshold=args.threshold, max_pairs=args.max_pairs)
    duet = None
    if args.duet:
        device = args.device if args.device != "auto" else ("cuda" if visible_gpus() else "cpu")
        ranks = args.gpus_per_node or args.gpus or 1
        duet = plan_duet(device, ranks, args.threads_per_worker, args.nodes or 1)
    repo = repository()
    trees = {"base": resolve_tree("base", args.base, repo), "head": resolve_tree("head", args.head, repo)}
    match = {
        "base": trees["base"].describe(),
        "head": trees["head"].describe(),
        "run_args": tokens,
        "base_args": side_args["base"],
        "head_args": side_args["head"],
        "statistic": args.statistic,
        "design": design.to_dict(),
        **({"duet": duet.to_dict()} if duet else {}),
    }
    digest = hashlib.sha256(json.dumps(match, sort_keys=True).encode()).hexdigest()[:10]
    out = Path(args.out) if args.out else Path("results") / f"gate-{digest}"
    settings = Settings(
        design,
        args.statistic,
        args.memory_threshold,
        args.max_minutes,
        args.inconclusive_exit,
        args.order_seed,
        match=match,
        duet=duet,
    )
    with checked_out(list(trees.values()), repo):
        if runner is None:
            for side in SIDES:
                probe_tree(trees[side], tokens + side_args[side])

            def runner(side: str, k: int) -> RunOutcome:
                return launch_run(
                    trees[side],
                    tokens + side_args[side],
                    out / side,
                    out / "logs" / f"pair-{k:03d}-{side}.log",
                    duet.placement(side, k) if duet else None,
                )

        p_alpha, _ = design.levels
        print(
            f"gate: base {trees['base'].text()} vs head {trees['head'].text()}; a slowdown of "
            f"{design.threshold:.0%} or more in the per-run {args.statistic} step time, "
            f"alpha {design.alpha}, beta {design.beta} (nominal level per look {p_alpha:.4f}); "
            f"at most {design.max_pairs} pairs / {args.max_minutes:g} min",
            flush=True,
        )
        if duet:
            a, b = (",".join(h) for h in duet.halves)
            print(f"duet: base and head at once, on {duet.kind} {a} and {b}, swapped every pair", flush=True)
        stop_on_sigterm()
        try:
            outcome = run_gate(settings, out, runner, say=lambda line: print(line, flush=True))
        except KeyboardInterrupt:
            print(
                f"gate: interrupted; the pairs recorded in {out} stay: the same command resumes", flush=True
            )
            raise
    if outcome.verdict == "ERROR":
        print(outcome.line, file=sys.stderr)
        return outcome.exit_code
    for detail in outcome.details:
        print(detail["line"])
    if line := anatomy_text(outcome.anatomy):
        print(line)
    print(outcome.line)
    return outcome.exit_code


def register(subparsers) -> None:
    p = add_verb(
        subparsers,
        "gate",
        "regression gate that runs its own experiment: base and head in pairs until it decides",
        __doc__,
        conflict_handler="resolve",  # the gate's --out (pairs and records) replaces the run's
        allow_abbrev=False,
    )
    add_flags(p, "--backend", "--gpus")
    add_run_arguments(p)
    add_gate_options(p)
    p.set_defaults(func=cmd_gate)
