"""`harness compare BASELINE CANDIDATE`: the regression gate.

Runs are matched by their configuration (core.records.ConfigKey). For each match:

- Samples are one value per run: its median step time (`--statistic min`: its fastest step). Runs are the
  independent unit: the steps of one run share its process placement, allocator state, background load and
  clock, so per-step samples are autocorrelated and launch-to-launch variation (a few percent on CPU) is
  invisible within one run; a test on pooled steps counts one run-level draw many times and is
  over-confident.
- Throughput (via its step time) regresses when the candidate is slower by more than `--threshold` AND
  significantly so: Welch's t-test on the logarithms of the per-run values (a ratio of geometric means;
  two-sided, at `--alpha`), which is valid at the run counts people use (2 or more per side; 4 to 6 give it
  power). The table shows the change with its confidence interval and the minimum detectable change
  (MDC): the smallest change this many runs with this spread would detect 80% of the time. With one run
  on a side there is no estimate of the launch-to-launch spread: only the threshold decides, and the
  table says so.
- `--statistic min` is steadier on a shared machine (contention only adds time) but blind to slowdowns
  that hit only some steps (stragglers, periodic stalls), so the median, the yardstick's t_step, is the
  default.
- Peak memory per rank (RSS on CPU, allocator peak on GPU) and model-state bytes per rank regress when
  they grow by more than `--memory-threshold`; they are near-deterministic, so there is no test.
- commbench records (`harness commbench`) are gated per op the same way: a run's value is its time index
  (harness.analyze.collectives.op_time_index), tested like step times, with the same threshold.
- Improvements (the same rules in the other direction) are reported and never fail the gate.

Exit codes: 0 no regression; 1 a regression, or a candidate run failing where the baseline ran;
2 bad input (missing files, schema mismatch, nothing matched, different device kinds without --force).
"""

from __future__ import annotations

from pathlib import Path

from core.records import write_json_atomic
from harness.analyze.baseline import InputError, load_all
from harness.analyze.compare import DEFAULT_ALPHA, DEFAULT_MEMORY_THRESHOLD, DEFAULT_THRESHOLD, compare_runs
from harness.analyze.compare_table import markdown
from harness.analyze.samples import COMPARE_STATISTICS
from harness.arguments import add_verb
from harness.usage import EXIT_FAILED, EXIT_OK, UsageError, fraction


def cmd_compare(args) -> int:
    try:
        base, cand = load_all([args.baseline]), load_all([args.candidate])
        result = compare_runs(
            base,
            cand,
            args.threshold,
            args.alpha,
            args.memory_threshold,
            args.statistic,
            args.force,
            (args.baseline, args.candidate),
        )
    except InputError as exc:
        raise UsageError(str(exc)) from None
    print(markdown(result), end="")
    if args.json:
        write_json_atomic(args.json, result)
    return EXIT_FAILED if result["result"] == "regression" else EXIT_OK


def register(subparsers) -> None:
    p = add_verb(subparsers, "compare", "regression gate: compare candidate runs with a baseline", __doc__)
    p.add_argument("baseline", type=Path, help="run record, directory of records, or saved baseline")
    p.add_argument("candidate", type=Path, help="run record, directory of records, or saved baseline")
    p.add_argument(
        "--threshold",
        type=fraction,
        default=DEFAULT_THRESHOLD,
        help=f"relative throughput loss that counts, e.g. 0.05 or 5%% (default {DEFAULT_THRESHOLD:.0%}%)",
    )
    p.add_argument(
        "--alpha",
        type=fraction,
        default=DEFAULT_ALPHA,
        help=f"significance level of Welch's t-test on the runs' log step times (default {DEFAULT_ALPHA})",
    )
    p.add_argument(
        "--memory-threshold",
        type=fraction,
        default=DEFAULT_MEMORY_THRESHOLD,
        help="relative growth of peak memory or model state that counts "
        f"(default {DEFAULT_MEMORY_THRESHOLD:.0%}%)",
    )
    p.add_argument(
        "--statistic",
        choices=COMPARE_STATISTICS,
        default="median",
        help="step time of a run: its median (default) or its fastest step (steadier on a shared machine)",
    )
    p.add_argument("--force", action="store_true", help="compare runs from different device kinds")
    p.add_argument("--json", type=Path, help="also write the full comparison as JSON here")
    p.set_defaults(func=cmd_compare)
