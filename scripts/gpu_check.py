"""The verdict half of the prepared GPU check (scripts/gpu_check.sh): runs the check's sequence on one GPU
(or, for a rehearsal, on the CPU) and prints, for every check, exactly one line

    PASS <name>: <evidence>  |  FAIL <name>: <why>  |  NOT CHECKED <name>: <why>

then `N passed, N failed, N not checked`; exit 1 on any FAIL (a missing import the check needs is one).

Why a Python half: the decisions (read a run record or a probe's output, hold it to the project's rules)
must be testable where CI runs, on a CPU: tests/test_gpu_check.py feeds the `judge_*` functions records and
shows a good one passes and a broken one fails. So this module imports only the standard library at its top;
torch and the project's backends are imported by the probes (`probe-*` subcommands), each in its own process.

What it runs, in this order (later groups are skipped as NOT CHECKED once the time budget is spent):
  preflight        torch (with CUDA on a GPU), the harness's own requirements, `import harness.cli`
  deepspeed        installed from carried wheels (scripts/gpu_wheels.sh) when the image lacks it
  stacks           `harness run --gpus 1` of torch-ddp and torch-fsdp in fp32, bf16, fp16 (+ fp32 --tf32),
                   then DeepSpeed ZeRO-1 and ZeRO-3 in the same three: status ok, finite loss that falls,
                   throughput above zero, on the device asked for
  tuned            torch-ddp and torch-fsdp `--tuned` in bf16 (torch.compile, fused AdamW): sound runs that
                   list their tuned set, with the first step's time (compilation) and the throughput
                   against the default bf16 run
  probes           two ranks on cuda:0 over gloo (DDP in sync, a traced step's bytes), NCCL at world 1
                   under the profiler (over gloo on the CPU rehearsal), the allocator peak reset after a
                   warm-up that held a known transient
  mfu-1b-bf16      the 1b workload in bf16 (micro-batch 2, activation checkpointing) inside MFU_BAND
  from the records TF32 as each fp32 record states it, peak memory >= model state, the precision facts,
                   the GPU each rank says it ran on
  other stacks     tf-mwms, paddle-fleet, horovod: a tiny run where the framework imports, else NOT CHECKED
Several `harness run`s share the GPU at once (--jobs): tiny runs are start-up bound, so together they fit
in minutes; the 1b run, whose figure is a measurement, runs alone. The CPU rehearsal (--device cpu) runs the
same sequence one run at a time with the smallest shapes; what needs a GPU says NOT CHECKED and why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PASS, FAIL, NOT_CHECKED = "PASS", "FAIL", "NOT CHECKED"

# The 1b bf16 MFU a sound run lands in, as a fraction of the datasheet's dense bf16 peak that
# harness.analyze.metrics uses for the H200 (989 TFLOP/s). Upper bound: a plain 8192^3 bf16 matmul on this
# workplace's H200s ran at 769-798 TFLOP/s (the device README), i.e. at most 0.81 of that peak; a whole
# training step (attention, LayerNorm, the optimizer, the recomputed forward of activation checkpointing,
# which model FLOPs do not count) cannot beat its own matmuls, so above 0.75 the FLOPs or the peak are
# counted wrong. Lower bound: fp32 without TF32 peaks at 67 of 989 (0.07) and TF32 at 0.5, so a run whose
# matmuls silently left bf16, or one stalled by host syncs or a mis-sized batch, falls below 0.15; eager
# PyTorch GPT training at this size reports about 0.3-0.5 on H100-class GPUs.
MFU_BAND = (0.15, 0.75)
# The transient the memory probe allocates inside its first warm-up step: far above the probe's whole
# steady-state step (the tiny workload holds ~17 MB of model state), so a peak that still includes it
# cannot be mistaken for one that does not.
TRANSIENT_BYTES = 2 << 30
# The harness's own requirements (pyproject.toml's dependencies), by import name.
HARNESS_DEPS = ("numpy", "pandas", "matplotlib", "scipy", "rich", "psutil", "yaml", "pyarrow")
WHEELS_COMMAND = (
    "bash scripts/gpu_wheels.sh (where pip reaches PyPI), then call the device tool with carry=['wheels']"
)

# The runs' shapes. GPU: the tiny preset, enough steps that a falling loss shows through the batch-to-batch
# noise (13 losses at 1,024 tokens each), 2 CPU threads per run so that 7 runs at once fit the machine's 16
# cores. CPU rehearsal: the smallest shape whose loss still falls in 8 steps.
SHAPES = {
    "cuda": "--workload tiny --steps 10 --warmup 3 --threads-per-worker 2".split(),
    "cpu": (
        "--workload tiny --layers 1 --d-model 64 --heads 2 --ffn 128 --seq-len 64 --vocab 256 "
        "--micro-batch 4 --steps 6 --warmup 2"
    ).split(),
}
PROBE_SPEC = {
    "cuda": {},
    "cpu": {"n_layers": 1, "d_model": 64, "n_heads": 2, "d_ff": 128, "seq_len": 64, "vocab_size": 256},
}
MFU_ARGS = {
    "cuda": ["--workload", "1b", "--micro-batch", "2", "--steps", "5", "--warmup", "2"],
    "cpu": SHAPES["cpu"],
}
PRECISIONS = ("fp32", "bf16", "fp16")
TORCH_STACKS = {"torch-ddp": ["--backend", "torch-ddp"], "torch-fsdp": ["--backend", "torch-fsdp"]}
DEEPSPEED_STACKS = {
    "deepspeed-zero1": ["--backend", "deepspeed", "--zero-stage", "1"],
    "deepspeed-zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
}
OTHER_STACKS = {"tf-mwms": "tensorflow", "paddle-fleet": "paddle", "horovod": "horovod.torch"}
# Seconds one run (or the probes together) is expected to take, by device: start-up dominates the tiny runs.
# A group of n runs at --jobs at a time takes about ceil(n / jobs) of these; the budget skips a group whose
# estimate no longer fits.
ESTIMATE_S = {
    "cuda": {"torch": 35, "tuned": 90, "deepspeed": 50, "probes": 45, "mfu": 100, "other": 45},
    "cpu": {"torch": 35, "tuned": 90, "deepspeed": 45, "probes": 60, "mfu": 35, "other": 60},
}


@dataclass
class Verdict:
    outcome: str
    name: str
    text: str

    def line(self) -> str:
        return f"{self.outcome} {self.name}: {' '.join(self.text.split())}"


# ------------------------------------------------------------------------------------------------------
# Judging records and probe outputs (pure functions: the part tests feed)
# ------------------------------------------------------------------------------------------------------


def ok_ranks(record: dict) -> list[dict]:
    return [r for r in record.get("ranks") or [] if r.get("status") == "ok"]


def finite(xs) -> bool:
    return bool(xs) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)


def loss_trend(losses: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last third of a loss series: one batch's noise cannot fake a fall."""
    k = max(1, len(losses) // 3)
    return statistics.fmean(losses[:k]), statistics.fmean(losses[-k:])


def judge_run(name: str, record: dict, device: str) -> Verdict:
    """A training run is sound: status ok, on the device asked for, every rank's losses (warm-up and
    measured) finite and falling (last third below first third), and a throughput above zero."""
    status = record.get("status")
    if status != "ok":
        error = record.get("error") or {}
        message = error.get("message") if isinstance(error, dict) else error
        return Verdict(FAIL, name, f"status {status}: {str(message)[:300]}")
    ran_on = (record.get("environment") or {}).get("device_type")
    if ran_on != device:
        return Verdict(FAIL, name, f"ran on {ran_on}, not {device}")
    ranks = ok_ranks(record)
    if not ranks:
        return Verdict(FAIL, name, "status ok but no rank record says ok")
    for rank in ranks:
        series = list(rank.get("warmup_losses") or []) + list(rank.get("losses") or [])
        if not finite(series):
            return Verdict(FAIL, name, f"rank {rank.get('rank')} losses not all finite: {series}")
        first, last = loss_trend(series)
        if not last < first:
            return Verdict(
                FAIL,
                name,
                f"rank {rank.get('rank')} loss did not fall: first third {first:.4f}, "
                f"last third {last:.4f} over {len(series)} steps",
            )
    summary = record.get("summary") or {}
    tps = summary.get("throughput_tokens_per_s")
    if not (isinstance(tps, (int, float)) and math.isfinite(tps) and tps > 0):
        return Verdict(FAIL, name, f"throughput {tps!r} tokens/s")
    first, last = loss_trend(list(ranks[0].get("warmup_losses") or []) + list(ranks[0].get("losses") or []))
    step = (summary.get("step_time_s") or {}).get("median")
    return Verdict(
        PASS,
        name,
        f"ok on {ranks[0].get('device')}; loss {first:.3f} -> {last:.3f} (first/last "
        f"third); {tps:,.0f} tokens/s; step {step * 1e3 if step else float('nan'):.1f} ms",
    )


def record_tf32(record: dict) -> list:
    return [(r.get("math_mode") or {}).get("tf32") for r in ok_ranks(record)]


def model_setting(record: dict, name: str):
    """A setting of the record's model section (core.config.ModelConfig): records this harness wrote."""
    return ((record.get("config") or {}).get("model") or {}).get(name)


def asked_tf32(record: dict) -> bool:
    return bool(model_setting(record, "tf32"))


def judge_tuned(name: str, record: dict, default: dict | None, device: str) -> Verdict:
    """A `--tuned` run: a sound run (judge_run) that says it is tuned and lists every setting of its set
    as applied, with the first step's time (compilation) recorded; its throughput against the same
    stack's default run at the same shape and precision is evidence, not a pass/fail (a tuned setting
    may be slower at this size)."""
    verdict = judge_run(name, record, device)
    if verdict.outcome != PASS:
        return verdict
    info, summary = record.get("backend_info") or {}, record.get("summary") or {}
    tuned = info.get("tuned") or {}
    if info.get("variant") != "tuned" or not tuned:
        return Verdict(FAIL, name, f"not recorded as tuned (variant {info.get('variant')}, set {tuned})")
    off = [k for k, v in tuned.items() if v.get("value") != v.get("tuned_value")]
    if off:
        return Verdict(FAIL, name, f"tuned settings not applied: {off}")
    first = summary.get("first_step_s")
    if first is None:
        return Verdict(FAIL, name, "no first-step time (the compile cost) in the record")
    base = ((default or {}).get("summary") or {}).get("throughput_tokens_per_s")
    mine = summary.get("throughput_tokens_per_s")
    versus = f", {mine / base:.2f}x the default's {base:,.0f} tokens/s" if base and mine else ""
    settings = ", ".join(f"{k}={v['value']}" for k, v in tuned.items())
    return Verdict(PASS, name, f"{settings}; first step {first:.1f}s{versus}")


def judge_tf32_default(records: dict[str, dict], device: str) -> Verdict:
    """The project's rule: fp32 means IEEE fp32, so an fp32 run that did not ask for --tf32 must say
    tf32 False on every rank, and its MFU is taken against the fp32 peak."""
    name = "tf32-default"
    fp32 = {
        n: r
        for n, r in records.items()
        if r.get("status") == "ok" and model_setting(r, "precision") == "fp32" and not asked_tf32(r)
    }
    if not fp32:
        return Verdict(NOT_CHECKED, name, "no ok fp32 record without --tf32 to read")
    states = {n: record_tf32(r) for n, r in fp32.items()}
    if device == "cpu" and all(s is None for v in states.values() for s in v):
        return Verdict(
            NOT_CHECKED, name, "every fp32 record says tf32 None (cpu: TF32 is a CUDA matmul mode)"
        )
    bad = [f"{n}: tf32 {v}" for n, v in states.items() if any(s is not False for s in v)]
    peaks = {n: (r.get("summary") or {}).get("device_peak_precision") for n, r in fp32.items()}
    bad += [f"{n}: MFU against the {p} peak" for n, p in peaks.items() if p not in (None, "fp32")]
    if bad:
        return Verdict(FAIL, name, "fp32 without --tf32 must be IEEE: " + "; ".join(bad))
    setting = (ok_ranks(next(iter(fp32.values())))[0].get("math_mode") or {}).get("tf32_setting")
    return Verdict(PASS, name, f"tf32 False on every rank of {', '.join(fp32)} ({setting})")


def judge_tf32_opt_in(record: dict | None, flag: bool, device: str, why_no_record: str = "") -> Verdict:
    """`--tf32` turns TF32 on for an fp32 run: the record says tf32 True and takes MFU at the TF32 peak."""
    name = "tf32-opt-in"
    if not flag:
        return Verdict(
            NOT_CHECKED, name, "`harness run` has no --tf32 flag here (its --help does not list it)"
        )
    if record is None:
        return Verdict(FAIL, name, f"no record: {why_no_record}")
    if record.get("status") != "ok":
        return Verdict(FAIL, name, f"status {record.get('status')}")
    if not asked_tf32(record):
        return Verdict(FAIL, name, "the record's config does not say tf32 true although --tf32 was given")
    states = record_tf32(record)
    if all(s is None for s in states):
        return Verdict(
            NOT_CHECKED,
            name,
            f"the record says tf32 None ({device}: no TF32 to switch on); the flag "
            f"was accepted and recorded (config.model.tf32 true)",
        )
    peak = (record.get("summary") or {}).get("device_peak_precision")
    if any(s is not True for s in states) or peak not in (None, "tf32"):
        return Verdict(
            FAIL, name, f"--tf32 given, but ranks say tf32 {states} and MFU is against the {peak} peak"
        )
    return Verdict(PASS, name, f"tf32 True on every rank, MFU against the {peak} peak")


def peak_and_state(rank: dict) -> tuple[int | None, int | None]:
    """A rank's allocator peak (after warm-up) and the model state it counted, in bytes (None: absent)."""
    memory, state = rank.get("memory") or {}, rank.get("model_state_bytes") or {}
    return memory.get("allocated_peak"), state.get("total")


def mib(n) -> str:
    return f"{n / 2**20:.1f} MiB" if isinstance(n, (int, float)) else str(n)


def judge_memory_vs_state(records: dict[str, dict], device: str) -> Verdict:
    """Every rank's allocator peak (after warm-up) holds at least the model state the rank counted in its
    own tensors (parameters, gradients, optimizer state all live at the optimizer step): a peak below it
    means the peak misses allocations or the state is over-counted."""
    name = "memory-vs-state"
    pairs = {
        n: peak_and_state(r)
        for n, rec in records.items()
        if rec.get("status") == "ok"
        for r in ok_ranks(rec)[:1]
    }
    pairs = {n: p for n, p in pairs.items() if p[0] is not None}
    if not pairs:
        return Verdict(
            NOT_CHECKED,
            name,
            f"no record has an allocator peak ({device}: memory holds only the process RSS)",
        )
    bad = [f"{n}: peak {mib(p)} < model state {mib(s)}" for n, (p, s) in pairs.items() if s is None or p < s]
    if bad:
        return Verdict(FAIL, name, "; ".join(bad))
    return Verdict(
        PASS, name, "peak / model state: " + ", ".join(f"{n} {p / s:.2f}x" for n, (p, s) in pairs.items())
    )


def judge_peak_reset(probe: dict | None, device: str) -> Verdict:
    """The memory probe held TRANSIENT_BYTES on the device inside its first warm-up step, so the process's
    lifetime peak is at least that; the record's peak, reset after warm-up, must not contain it (below the
    transient) and must still hold the model state."""
    name = "peak-reset-after-warmup"
    if probe is None:
        return Verdict(FAIL, name, "the memory probe wrote no result")
    if probe.get("error"):
        return Verdict(FAIL, name, f"the memory probe failed: {probe['error'][:300]}")
    record = probe.get("record") or {}
    if record.get("status") != "ok":
        return Verdict(FAIL, name, f"the probe's training loop says status {record.get('status')}")
    peak, state = peak_and_state(record)
    if peak is None:
        return Verdict(
            NOT_CHECKED,
            name,
            f"the probe ran its warm-up and steps, but {device} has no allocator "
            f"peak to reset (memory: {sorted(record.get('memory') or {})})",
        )
    transient, lifetime = probe.get("transient_bytes"), probe.get("lifetime_peak_bytes")
    if not transient or lifetime is None or lifetime < transient:
        return Verdict(FAIL, name, f"the transient did not register: lifetime peak {lifetime} < {transient}")
    if peak >= transient:
        return Verdict(
            FAIL,
            name,
            f"peak {peak / 2**30:.2f} GiB includes the warm-up's {transient / 2**30:.0f} GiB "
            f"transient: not reset after warm-up",
        )
    if state is None or peak < state:
        return Verdict(FAIL, name, f"peak {mib(peak)} below the model state {mib(state)}")
    return Verdict(
        PASS,
        name,
        f"after warm-up {mib(peak)} (model state {mib(state)}) vs a "
        f"lifetime peak of {lifetime / 2**30:.2f} GiB with the {transient / 2**30:.0f} GiB "
        f"warm-up transient",
    )


def trace_summary(calls: list[dict]) -> str:
    by_op: dict[str, list] = {}
    for c in calls:
        o = by_op.setdefault(c.get("op"), [0, 0, 0])
        o[0] += 1
        o[1] += c.get("size_bytes") or 0
        o[2] += c.get("time_s") is not None
    return "; ".join(f"{op} x{n} {b / 2**20:.2f} MiB ({t} timed)" for op, (n, b, t) in by_op.items())


def judge_trace(name: str, calls: list[dict] | None, why_none: str = "") -> Verdict:
    """A traced step's collectives, as backends.comm_trace read them: at least one, each with its bytes
    known and above zero (an unknown dtype or an empty shape leaves size_bytes None or 0)."""
    if calls is None:
        return Verdict(FAIL, name, f"no trace: {why_none}")
    if not calls:
        return Verdict(FAIL, name, "the trace holds no collective")
    bad = [c for c in calls if not c.get("size_bytes")]
    if bad:
        return Verdict(FAIL, name, f"{len(bad)} of {len(calls)} calls without bytes, e.g. {bad[0]}")
    return Verdict(PASS, name, trace_summary(calls))


def judge_gloo(ranks: list[dict | None], device: str) -> list[Verdict]:
    """Two ranks on one device over gloo (DDP, the harness's own trainer and loop): both finish with finite
    losses on the same device, their weights end identical (DDP's all-reduces kept them in sync although
    each rank trained on its own shard), and the traced steps' collectives carry the gradients' bytes."""
    name, tname = "ddp-gloo-2ranks-1gpu", "trace-gloo"
    missing = [i for i, r in enumerate(ranks) if r is None]
    if missing or len(ranks) != 2:
        why = f"rank(s) {missing} wrote no result" if missing else f"{len(ranks)} rank results, not 2"
        return [Verdict(FAIL, name, why), Verdict(FAIL, tname, why)]
    errors = [r.get("error") for r in ranks if r.get("error")]
    if errors:
        return [Verdict(FAIL, name, errors[0][:300]), Verdict(FAIL, tname, "the probe failed")]
    records = [r["record"] for r in ranks]
    bad = [f"rank {r['rank']}: status {r['status']}" for r in records if r.get("status") != "ok"]
    bad += [
        f"rank {r['rank']}: losses {r.get('losses')}"
        for r in records
        if r.get("status") == "ok" and not finite(r.get("losses"))
    ]
    bad += [f"process group {p['backend']}, not gloo" for p in ranks if p.get("backend") != "gloo"]
    where = sorted({p.get("device") for p in ranks})
    if device == "cuda" and where != ["cuda:0"]:
        bad.append(f"ranks on {where}, not both on cuda:0")
    if len({p.get("weights_sha256") for p in ranks}) != 1:
        bad.append("the ranks' final weights differ: DDP did not keep them in sync")
    verdicts = [
        Verdict(FAIL, name, "; ".join(bad))
        if bad
        else Verdict(
            PASS,
            name,
            f"2 ranks on {'/'.join(map(str, where))} over gloo, {len(records[0]['losses'])} steps, "
            f"losses {records[0]['losses'][0]:.3f} -> {records[0]['losses'][-1]:.3f}, final weights "
            f"identical",
        )
    ]
    traces = [(r.get("comm_trace") or {}) for r in records]
    calls = traces[0].get("collectives")
    verdict = judge_trace(tname, calls, str(traces[0].get("reason")))
    if verdict.outcome == PASS:
        # DDP all-reduces every fp32 gradient once per step: the traced bytes per step are the parameters'.
        steps = traces[0].get("steps") or 1
        reduced = sum(c["size_bytes"] for c in calls if c.get("op") == "all_reduce") / steps
        grads = (records[0].get("model_state_bytes") or {}).get("params")
        if not grads or abs(reduced / grads - 1) > 0.01:
            verdict = Verdict(
                FAIL,
                tname,
                f"all-reduced {reduced:,.0f} B per step, the fp32 gradients are "
                f"{grads} B ({trace_summary(calls)})",
            )
        else:
            verdict.text += f"; {reduced:,.0f} B all-reduced per step = the fp32 gradients"
    return verdicts + [verdict]


def judge_mfu(record: dict | None, device: str, why_no_record: str = "", band=MFU_BAND) -> Verdict:
    """The 1b bf16 run's MFU against the device's bf16 peak, inside `band` (see MFU_BAND)."""
    name = "mfu-1b-bf16"
    if record is None:
        return Verdict(FAIL, name, f"no record: {why_no_record}")
    run = judge_run(name, record, device)
    if run.outcome != PASS:
        return run
    summary = record.get("summary") or {}
    mfu, peak = summary.get("mfu"), summary.get("device_peak_precision")
    kind = (record.get("environment") or {}).get("device_kind")
    if mfu is None:
        if device == "cpu":
            return Verdict(NOT_CHECKED, name, "the run is sound, but a CPU has no device peak, so no MFU")
        return Verdict(FAIL, name, f"no MFU: no peak known for {kind!r} (harness.analyze.metrics.PEAK_FLOPS)")
    if peak != "bf16":
        return Verdict(FAIL, name, f"MFU taken against the {peak} peak, not bf16")
    lo, hi = band
    text = (
        f"MFU {mfu:.1%} of the {summary.get('device_peak_flops', 0) / 1e12:.0f} TFLOP/s bf16 peak of {kind}, "
        f"band {lo:.0%}-{hi:.0%}; {summary.get('throughput_tokens_per_s', 0):,.0f} tokens/s"
    )
    return Verdict(PASS if lo <= mfu <= hi else FAIL, name, text)


FACT_ORDER = (
    "compute",
    "forward_params",
    "activations",
    "grad_reduce",
    "master_weights",
    "optimizer_state",
    "loss_scaling",
    "tf32",
)


def precision_facts(record: dict) -> dict | None:
    """The per-run precision facts (compute dtype, parameter dtype in forward, reduction dtype, master
    weights, ...): where the workers record them (rank math_mode.numerics), else record-level."""
    for rank in ok_ranks(record)[:1]:
        for facts in (
            (rank.get("math_mode") or {}).get("numerics"),
            rank.get("numerics"),
            rank.get("precision_facts"),
        ):
            if isinstance(facts, dict) and facts:
                return facts
    for facts in (record.get("numerics"), (record.get("backend_info") or {}).get("numerics")):
        if isinstance(facts, dict) and facts:
            return facts
    return None


def judge_precision_facts(records: dict[str, dict]) -> Verdict:
    """Each record states its precision facts, and their compute dtype is the precision the run asked for;
    the facts are printed (they are what a reader compares across stacks)."""
    name = "precision-facts"
    ok = {n: r for n, r in records.items() if r.get("status") == "ok"}
    if not ok:
        return Verdict(NOT_CHECKED, name, "no ok record to read")
    facts = {n: precision_facts(r) for n, r in ok.items()}
    absent = [n for n, f in facts.items() if f is None]
    if len(absent) == len(facts):
        return Verdict(
            NOT_CHECKED, name, "no record states precision facts (looked for ranks[].math_mode.numerics)"
        )
    bad = [f"{n}: no facts" for n in absent]
    bad += [
        f"{n}: compute {f.get('compute')} in a {model_setting(ok[n], 'precision')} run"
        for n, f in facts.items()
        if f is not None and "compute" in f and f["compute"] != model_setting(ok[n], "precision")
    ]

    def brief(f: dict) -> str:
        parts = [f"{k}={f[k]}" for k in FACT_ORDER if k in f]
        return " ".join(parts) + (f" deviations={f['deviations']}" if f.get("deviations") else "")

    listing = " | ".join(f"{n}: {brief(f)}" for n, f in facts.items() if f is not None)
    if bad:
        return Verdict(FAIL, name, "; ".join(bad) + " | " + listing)
    return Verdict(PASS, name, listing)


def judge_device_contract(records: dict[str, dict], gpu_names: list[str], device: str) -> Verdict:
    """Each rank says it ran on the GPU nvidia-smi lists (an independent reading of the device name), as
    local rank 0 under the default mask."""
    name = "device-contract"
    if device != "cuda":
        return Verdict(NOT_CHECKED, name, "GPU only: a CPU worker has no device id to check")
    if not gpu_names:
        return Verdict(NOT_CHECKED, name, "nvidia-smi listed no GPU name to compare with")
    seen = {n: [(r.get("device"), r.get("local_rank")) for r in ok_ranks(rec)] for n, rec in records.items()}
    bad = [f"{n}: {s}" for n, s in seen.items() for d, lr in s if d not in gpu_names or lr not in (0, None)]
    if bad:
        return Verdict(FAIL, name, f"nvidia-smi lists {gpu_names}; " + "; ".join(bad))
    return Verdict(PASS, name, f"every rank of {len(seen)} records ran on {gpu_names[0]} as local rank 0")


def judge_world1(probe: dict | None, device: str) -> list[Verdict]:
    """The world-1 probe: its profiled all-reduces read by torch_collectives (bytes known), and commbench's
    torch collectives with their outputs checked as commbench checks them. On a GPU over NCCL; on the CPU
    rehearsal the same probe runs over gloo, which proves its plumbing but not NCCL (NOT CHECKED, with what
    it saw)."""
    names = ("trace-nccl-world1", "commbench-nccl-world1")
    if probe is None or probe.get("error"):
        why = (probe or {}).get("error") or "the world-1 probe wrote no result"
        return [Verdict(FAIL, n, why[:300]) for n in names]
    trace = judge_trace(names[0], probe.get("calls"))
    if trace.outcome == PASS and device == "cuda":
        seen = probe.get("kernels") or "none (NCCL may launch none at world 1)"
        trace.text += f"; NCCL kernels seen: {seen}"
    timed = probe.get("commbench") or {}
    bad = [f"{op}: {b['error']}" for op, b in timed.items() if b.get("error")]
    if not timed or bad:
        bench = Verdict(FAIL, names[1], "; ".join(bad) or "no commbench call ran")
    else:
        bench = Verdict(
            PASS,
            names[1],
            ", ".join(f"{op} {b['us']:.1f} us" for op, b in timed.items())
            + " per 256 KiB call (least of 5), outputs checked",
        )
    verdicts = [trace, bench]
    if device != "cuda":
        for v in verdicts:
            if v.outcome == PASS:
                v.outcome, v.text = NOT_CHECKED, f"GPU only (NCCL needs CUDA); rehearsed over gloo: {v.text}"
    return verdicts


# ------------------------------------------------------------------------------------------------------
# Running the sequence
# ------------------------------------------------------------------------------------------------------


@dataclass
class Context:
    device: str
    py: str
    out: Path
    budget: float
    jobs: int
    t0: float = field(default_factory=time.monotonic)
    verdicts: list[Verdict] = field(default_factory=list)
    records: dict[str, dict] = field(default_factory=dict)
    gpu_names: list[str] = field(default_factory=list)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def hard_left(self) -> float:
        """Seconds any command may still take: the budget plus the slack a started group may use."""
        return max(10.0, self.budget + 30 - self.elapsed)

    def say(self, verdict: Verdict) -> None:
        self.verdicts.append(verdict)
        print(verdict.line(), flush=True)

    def note(self, text: str) -> None:
        print(f"# [{self.elapsed:5.0f}s] {text}", flush=True)

    def over_budget(self, estimate: float) -> str | None:
        if self.elapsed + estimate > self.budget:
            return (
                f"budget: {self.elapsed:.0f}s of {self.budget:.0f}s spent, this needs about {estimate:.0f}s "
                f"(raise GPU_CHECK_BUDGET_S to include it)"
            )
        return None


def run_cmd(
    ctx: Context, argv: list[str], log: Path, timeout: float, env: dict | None = None
) -> tuple[int, str]:
    """Run a command (its own process group, killed whole at the timeout); all output to `log`; returns
    the exit code (124 on timeout) and the last non-empty line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = 124
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else ""
    return rc, (f"timed out after {timeout:.0f}s; " if rc == 124 else "") + last


@dataclass
class Run:
    name: str
    args: list[str]
    timeout: float


def harness_run(ctx: Context, run: Run) -> tuple[dict | None, int, str]:
    """One `harness run` with a known run id; its record (None if none was written), exit code, last line."""
    run_id = "gc-" + run.name.replace("/", "-")
    limit = min(run.timeout, ctx.hard_left())
    argv = [
        ctx.py,
        "-m",
        "harness",
        "run",
        "--device",
        ctx.device,
        "--gpus",
        "1",
        "--quiet",
        "--out",
        str(ctx.out),
        "--run-id",
        run_id,
        "--timeout",
        str(int(limit)),
        "--compute-method",
        "none",
        *run.args,
    ]
    ctx.note(f"harness run {' '.join(shlex.quote(a) for a in argv[4:])}")
    rc, last = run_cmd(ctx, argv, ctx.out / "console" / f"{run_id}.log", limit + 15)
    path = ctx.out / f"{run_id}.json"
    record = json.loads(path.read_text()) if path.exists() else None
    if record is not None:
        ctx.records[run.name] = record
    return record, rc, last


def run_many(ctx: Context, runs: list[Run]) -> list[tuple[dict | None, int, str]]:
    with ThreadPoolExecutor(max(1, ctx.jobs)) as pool:
        return list(pool.map(lambda r: harness_run(ctx, r), runs))


def no_record_verdict(ctx: Context, name: str, rc: int, last: str) -> Verdict:
    """A run that wrote no record: on the CPU rehearsal, the harness refusing it (exit 2, bad input) means
    the configuration needs a GPU; anywhere else it is a failure."""
    if rc == 2 and ctx.device == "cpu":
        return Verdict(NOT_CHECKED, name, f"the harness refuses it on a CPU: {last}")
    return Verdict(FAIL, name, f"no record (harness exit {rc}): {last}")


def stack_group(ctx: Context, stacks: dict[str, list[str]], extra: list[Run] = ()) -> list[tuple]:
    runs = [
        Run(f"{label}/{p}", [*args, *SHAPES[ctx.device], "--precision", p], 180)
        for label, args in stacks.items()
        for p in PRECISIONS
    ]
    results = run_many(ctx, [*runs, *extra])
    for run, (record, rc, last) in zip(runs, results):
        ctx.say(
            judge_run(run.name, record, ctx.device) if record else no_record_verdict(ctx, run.name, rc, last)
        )
    return results[len(runs) :]


def py_probe(ctx: Context, code: str, *args: str, timeout: float = 120) -> dict:
    """Run a short Python snippet that prints one JSON line (last line of its output)."""
    log = ctx.out / "console" / f"probe-{hashlib.sha1((code + repr(args)).encode()).hexdigest()[:8]}.log"
    rc, last = run_cmd(ctx, [ctx.py, "-c", code, *args], log, min(timeout, ctx.hard_left()))
    try:
        return json.loads(last)
    except ValueError:
        return {"error": f"exit {rc}: {last}"}


PREFLIGHT = r"""
import importlib, json, sys
device, deps = sys.argv[1], sys.argv[2].split(",")
out = {"missing": []}
for name in deps:
    try:
        importlib.import_module(name)
    except Exception as e:
        out["missing"].append(f"{name} ({type(e).__name__}: {e})"[:160])
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.cuda.is_available()
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name(0)
        out["capability"] = list(torch.cuda.get_device_capability(0))
except Exception as e:
    out["missing"].append(f"torch ({type(e).__name__}: {e})"[:160])
try:
    import harness.cli  # noqa: F401
except Exception as e:
    out["missing"].append(f"harness.cli ({type(e).__name__}: {e})"[:160])
print(json.dumps(out))
"""

IMPORTS = r"""
import importlib, json, sys
name, device = sys.argv[1], sys.argv[2]
try:
    module = importlib.import_module(name)
    version = getattr(module, "__version__", "?")
    gpu = None
    if device == "cuda":
        if name == "tensorflow":
            gpu = bool(module.config.list_physical_devices("GPU"))
        elif name == "paddle":
            gpu = module.is_compiled_with_cuda() and module.device.cuda.device_count() > 0
    why = None if gpu in (None, True) else f"{name} {version} imports but sees no GPU (a CPU-only build?)"
    print(json.dumps({"version": version, "why": why}))
except Exception as e:
    print(json.dumps({"why": f"`import {name}` fails: {type(e).__name__}: {str(e)[:160]}"}))
"""


def preflight(ctx: Context) -> bool:
    name = "preflight"
    facts = py_probe(ctx, PREFLIGHT, ctx.device, ",".join(HARNESS_DEPS), timeout=120)
    missing = list(facts.get("missing", [])) + ([facts["error"]] if facts.get("error") else [])
    if ctx.device == "cuda" and not missing and not facts.get("cuda"):
        missing.append(f"torch {facts.get('torch')} sees no CUDA device")
    if ctx.device == "cuda":
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            rows = [row.split(",") for row in smi.stdout.strip().splitlines() if row.strip()]
            ctx.gpu_names = [row[0].strip() for row in rows]
            smi_text = "; ".join(",".join(c.strip() for c in row) for row in rows)
        except (OSError, subprocess.SubprocessError) as e:
            smi_text = f"nvidia-smi unavailable ({type(e).__name__})"
    if missing:
        ctx.say(Verdict(FAIL, name, "missing: " + "; ".join(missing)))
        return False
    where = (
        f"{facts['gpu']} (sm {'.'.join(map(str, facts['capability']))}; nvidia-smi: {smi_text})"
        if ctx.device == "cuda"
        else "CPU rehearsal"
    )
    ctx.say(Verdict(PASS, name, f"{ctx.py}: torch {facts['torch']} on {where}; harness requirements import"))
    return True


def has_tf32_flag(ctx: Context) -> bool:
    rc, _ = run_cmd(ctx, [ctx.py, "-m", "harness", "run", "--help"], ctx.out / "console" / "run-help.log", 60)
    return rc == 0 and "--tf32" in (ctx.out / "console" / "run-help.log").read_text()


def deepspeed_ready(ctx: Context) -> str | None:
    """Make DeepSpeed importable (from wheels/ on a GPU machine without it); None when it is, else why
    not, after saying the deepspeed-install verdict."""
    name = "deepspeed-install"
    have = py_probe(ctx, IMPORTS, "deepspeed", "cpu")
    if ctx.device == "cpu":
        if have.get("why"):
            ctx.say(Verdict(NOT_CHECKED, name, f"CPU rehearsal: {have['why']}"))
            return have["why"]
        ctx.say(
            Verdict(
                NOT_CHECKED,
                name,
                f"CPU rehearsal: wheels are installed on a GPU machine only; this "
                f"environment's deepspeed {have.get('version')} is used",
            )
        )
        return None
    if not have.get("why"):
        ctx.say(Verdict(PASS, name, f"deepspeed {have.get('version')} already importable"))
        return None
    wheels = sorted((ROOT / "wheels").glob("deepspeed-*.whl"))
    if not wheels:
        why = f"{have['why']}; no wheels/deepspeed-*.whl in the tree: prepare with {WHEELS_COMMAND}"
        ctx.say(Verdict(NOT_CHECKED, name, why))
        return why
    argv = [
        ctx.py,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-cache-dir",
        "--find-links",
        str(ROOT / "wheels"),
        "deepspeed==0.19.8",
    ]
    ctx.note(" ".join(argv))
    rc, last = run_cmd(ctx, argv, ctx.out / "console" / "pip-deepspeed.log", min(300, ctx.hard_left()))
    have = py_probe(ctx, IMPORTS, "deepspeed", "cpu")
    if rc != 0 or have.get("why"):
        why = f"pip exit {rc}: {last}" if rc else have["why"]
        ctx.say(Verdict(FAIL, name, why))
        return f"deepspeed did not install: {why}"
    size = sum(w.stat().st_size for w in (ROOT / "wheels").glob("*.whl")) / 2**20
    ctx.say(Verdict(PASS, name, f"deepspeed {have.get('version')} installed from wheels/ ({size:.1f} MiB)"))
    return None


def probes(ctx: Context) -> None:
    """The three probes at once (each its own processes): two ranks over gloo, world 1 over NCCL (gloo on the
    CPU rehearsal), and the allocator peak's reset."""
    probe_dir = ctx.out / "probes"
    probe_dir.mkdir(parents=True, exist_ok=True)
    me = str(Path(__file__).resolve())
    left = min(150, ctx.hard_left())
    probe = [ctx.py, me]
    commands = {
        "gloo": [ctx.py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", me],
        "world1": probe.copy(),
        "memory": probe.copy(),
    }
    commands["gloo"] += ["probe-gloo", "--device", ctx.device, "--out", str(probe_dir)]
    commands["world1"] += ["probe-world1", "--device", ctx.device, "--out", str(probe_dir / "world1.json")]
    commands["memory"] += ["probe-memory", "--device", ctx.device, "--out", str(probe_dir / "memory.json")]
    ctx.note("probes: " + ", ".join(commands))

    def start(key: str) -> tuple[int, str]:
        return run_cmd(ctx, commands[key], ctx.out / "console" / f"probe-{key}.log", left)

    with ThreadPoolExecutor(max(1, min(ctx.jobs, len(commands)))) as pool:
        rcs = dict(zip(commands, pool.map(start, commands)))

    def load(path: Path, key: str) -> dict | None:
        if path.exists():
            return json.loads(path.read_text())
        rc, last = rcs.get(key, (None, ""))
        return {"error": f"exit {rc}: {last}"} if key in rcs else None

    gloo = [load(probe_dir / f"gloo-rank{r}.json", "gloo") for r in range(2)]
    for verdict in judge_gloo(gloo, ctx.device):
        ctx.say(verdict)
    for verdict in judge_world1(load(probe_dir / "world1.json", "world1"), ctx.device):
        ctx.say(verdict)
    ctx.say(judge_peak_reset(load(probe_dir / "memory.json", "memory"), ctx.device))


def other_stacks(ctx: Context) -> None:
    runs = []
    for label, module in OTHER_STACKS.items():
        have = py_probe(ctx, IMPORTS, module, ctx.device)
        if have.get("why") or have.get("error"):
            ctx.say(Verdict(NOT_CHECKED, f"{label}/fp32", have.get("why") or have["error"]))
        else:
            runs.append(
                Run(f"{label}/fp32", ["--backend", label, *SHAPES[ctx.device], "--precision", "fp32"], 240)
            )
    for run, (record, rc, last) in zip(runs, run_many(ctx, runs)):
        ctx.say(
            judge_run(run.name, record, ctx.device) if record else no_record_verdict(ctx, run.name, rc, last)
        )


def run_all(ctx: Context) -> int:
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.note(
        f"device {ctx.device}, python {ctx.py}, records in {ctx.out}, budget {ctx.budget:.0f}s, "
        f"{ctx.jobs} run(s) at a time"
    )
    if not preflight(ctx):
        for rest in ("deepspeed-install", "stacks, probes, MFU, record checks"):
            ctx.say(Verdict(NOT_CHECKED, rest, "the preflight failed"))
        return finish(ctx)

    def est(kind: str, runs: int = 1) -> float:
        return ESTIMATE_S[ctx.device][kind] * math.ceil(runs / max(1, ctx.jobs))

    tf32_flag = has_tf32_flag(ctx)
    ds_why = deepspeed_ready(ctx)

    # torch-ddp and torch-fsdp in three precisions, and fp32 with --tf32, all at once.
    skip = ctx.over_budget(est("torch", 7))
    opt_in = (
        [
            Run(
                "tf32-opt-in",
                [*TORCH_STACKS["torch-ddp"], *SHAPES[ctx.device], "--precision", "fp32", "--tf32"],
                180,
            )
        ]
        if tf32_flag and not skip
        else []
    )
    if skip:
        for label in TORCH_STACKS:
            for p in PRECISIONS:
                ctx.say(Verdict(NOT_CHECKED, f"{label}/{p}", skip))
        ctx.say(Verdict(NOT_CHECKED, "tf32-opt-in", skip))
    else:
        extra = stack_group(ctx, TORCH_STACKS, opt_in)
        if opt_in:
            record, rc, last = extra[0]
            ctx.say(judge_tf32_opt_in(record, True, ctx.device, f"harness exit {rc}: {last}"))
        else:
            ctx.say(judge_tf32_opt_in(None, False, ctx.device))

    # The torch family's tuned sets (torch.compile, fused AdamW, DDP's buckets) in bf16, beside the
    # default bf16 runs above.
    skip = ctx.over_budget(est("tuned", len(TORCH_STACKS)))
    if skip:
        for label in TORCH_STACKS:
            ctx.say(Verdict(NOT_CHECKED, f"{label}/tuned/bf16", skip))
    else:
        runs = [
            Run(f"{label}/tuned/bf16", [*args, *SHAPES[ctx.device], "--precision", "bf16", "--tuned"], 300)
            for label, args in TORCH_STACKS.items()
        ]
        for run, (record, rc, last) in zip(runs, run_many(ctx, runs)):
            default = ctx.records.get(run.name.replace("/tuned", ""))
            ctx.say(
                judge_tuned(run.name, record, default, ctx.device)
                if record
                else no_record_verdict(ctx, run.name, rc, last)
            )

    skip = ctx.over_budget(est("probes"))
    if skip:
        for n in (
            "ddp-gloo-2ranks-1gpu",
            "trace-gloo",
            "trace-nccl-world1",
            "commbench-nccl-world1",
            "peak-reset-after-warmup",
        ):
            ctx.say(Verdict(NOT_CHECKED, n, skip))
    else:
        probes(ctx)

    skip = ctx.over_budget(est("mfu"))
    if skip:
        ctx.say(Verdict(NOT_CHECKED, "mfu-1b-bf16", skip))
    else:
        mfu = Run(
            "mfu-1b-bf16",
            [
                *TORCH_STACKS["torch-ddp"],
                *MFU_ARGS[ctx.device],
                "--precision",
                "bf16",
                "--activation-checkpointing",
            ],
            300,
        )
        record, rc, last = harness_run(ctx, mfu)
        ctx.say(judge_mfu(record, ctx.device, f"harness exit {rc}: {last}"))

    skip = ds_why or ctx.over_budget(est("deepspeed", 6))
    if skip:
        for label in DEEPSPEED_STACKS:
            for p in PRECISIONS:
                ctx.say(Verdict(NOT_CHECKED, f"{label}/{p}", skip))
    else:
        stack_group(ctx, DEEPSPEED_STACKS)

    ctx.say(judge_tf32_default(ctx.records, ctx.device))
    ctx.say(judge_memory_vs_state(ctx.records, ctx.device))
    ctx.say(judge_precision_facts(ctx.records))
    ctx.say(judge_device_contract(ctx.records, ctx.gpu_names, ctx.device))

    skip = ctx.over_budget(est("other", len(OTHER_STACKS)))
    if skip:
        for label in OTHER_STACKS:
            ctx.say(Verdict(NOT_CHECKED, f"{label}/fp32", skip))
    else:
        other_stacks(ctx)
    return finish(ctx)


def finish(ctx: Context) -> int:
    count = {o: sum(v.outcome == o for v in ctx.verdicts) for o in (PASS, FAIL, NOT_CHECKED)}
    print(
        f"{count[PASS]} passed, {count[FAIL]} failed, {count[NOT_CHECKED]} not checked "
        f"(in {ctx.elapsed:.0f}s on {ctx.device})",
        flush=True,
    )
    return 1 if count[FAIL] else 0


# ------------------------------------------------------------------------------------------------------
# Probes (each in its own process; these import torch and the project's backends)
# ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe_config(device: str, world: int, **fields):
    sys.path.insert(0, str(ROOT))
    from core.config import RunConfig
    from workloads.spec import resolve

    return RunConfig.build(
        "torch-ddp",
        workload="tiny",
        spec=resolve("tiny", **PROBE_SPEC[device]),
        world_size=world,
        device=device,
        compute_method="none",
        **fields,
    )


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)


def probe_gloo(device: str, out: Path) -> int:
    """One of two ranks (started by torchrun) of DDP over gloo, both on cuda:0 (or the CPU): the harness's
    own DDP trainer and timed loop, with a traced step at the end; writes out/gloo-rank<R>.json."""
    rank = int(os.environ.get("RANK", 0))
    result: dict = {"rank": rank}
    try:
        from datetime import timedelta

        import torch.distributed as dist

        cfg = probe_config(device, 2, micro_batch=4, steps=4, warmup=2, trace_steps=2, timeout_s=120)
        os.environ["LOCAL_RANK"] = "0"  # both ranks on device 0: the trainer picks cuda:<LOCAL_RANK>
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # the trainer then keeps this group
        from backends.loop import run_to_record
        from backends.torch_ddp.worker import make_trainer

        trainer = make_trainer(cfg)
        record = run_to_record(trainer, cfg, out / f"gloo-rank{rank}.events.jsonl")
        weights = trainer.final_weights()
        digest = hashlib.sha256(b"".join(weights[k].tobytes() for k in sorted(weights))).hexdigest()
        result.update(
            record=record,
            weights_sha256=digest,
            backend=dist.get_backend(),
            device=str(next(trainer.model.parameters()).device),
        )
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the probe's failure is the verdict's input
        result["error"] = f"{type(e).__name__}: {e}"
    write_json(out / f"gloo-rank{rank}.json", result)
    return 0


def probe_memory(device: str, out: Path) -> int:
    """The harness's timed loop on the torch-ddp trainer at world 1, with TRANSIENT_BYTES allocated and freed
    inside the first warm-up step: the record's allocator peak must be reset after warm-up."""
    result: dict = {"transient_bytes": TRANSIENT_BYTES if device == "cuda" else None}
    try:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
        cfg = probe_config(device, 1, micro_batch=8, steps=3, warmup=2, timeout_s=120)
        import torch

        from backends.loop import run_to_record
        from backends.torch_ddp.worker import make_trainer

        trainer = make_trainer(cfg)
        step = trainer.step

        def step_with_transient(batches, sync_grads=True):
            if device == "cuda" and "lifetime_peak_bytes" not in result:
                block = torch.empty(TRANSIENT_BYTES, dtype=torch.uint8, device=trainer.device)
                del block
                result["lifetime_peak_bytes"] = torch.cuda.max_memory_allocated(trainer.device)
            return step(batches, sync_grads)

        trainer.step = step_with_transient
        result["record"] = run_to_record(trainer, cfg, out.with_suffix(".events.jsonl"))
        trainer.close()
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    write_json(out, result)
    return 0


def probe_world1(device: str, out: Path) -> int:
    """Collectives at world 1 (NCCL on a GPU; gloo on a CPU, to rehearse the probe) beside matmuls under the
    torch profiler the workers use, read by backends.torch_trace.torch_collectives; then commbench's calls
    on the same process group, each output checked as commbench checks it."""
    result: dict = {}
    try:
        import tempfile
        from types import SimpleNamespace

        sys.path.insert(0, str(ROOT))
        import torch
        import torch.distributed as dist
        from torch.autograd import profiler

        from backends.commbench import check_output, timed_calls
        from backends.torch_ddp.collectives import TorchCollectives
        from backends.torch_trace import torch_collectives

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        cuda = device == "cuda"
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
        where = torch.device("cuda", 0) if cuda else torch.device("cpu")
        a, g = torch.randn(1024, 1024, device=where), torch.randn(1 << 20, device=where)

        def sync():
            if cuda:
                torch.cuda.synchronize()

        for _ in range(3):
            a @ a, dist.all_reduce(g)
        sync()
        with profiler.profile(
            use_cpu=True, use_device="cuda" if cuda else None, record_shapes=True, use_kineto=True
        ) as prof:
            for _ in range(5):
                a @ a
                dist.all_reduce(g)
                a @ a
            sync()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            prof.export_chrome_trace(path)
            events = json.loads(Path(path).read_text())["traceEvents"]
        result["kernels"] = sorted(
            {e["name"][:70] for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()}
        )
        result["calls"] = torch_collectives(events, 1)

        bench = TorchCollectives.__new__(TorchCollectives)  # its __init__ would start a second group
        bench.comm, bench.device, bench.dtype, bench.world_size = dist, where, torch.float32, 1
        bench.cfg = SimpleNamespace(topology=SimpleNamespace(device=device))
        result["commbench"] = {}
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            try:
                buffers = bench.prepare(op, 1 << 16, 1.0)
                bench.call(op, buffers)
                bench.synchronize()
                check_output(op, bench.result(op, buffers), 1 << 16, 1, "fp32")
                times = timed_calls(bench, op, bench.prepare(op, 1 << 16, 0.0), 5)
                result["commbench"][op] = {"us": min(times) * 1e6}
            except Exception as e:  # noqa: BLE001
                result["commbench"][op] = {"error": f"{type(e).__name__}: {e}"[:200]}
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
    write_json(out, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all", help="run the whole check and print the verdict")
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a.add_argument("--out", type=Path, required=True, help="folder for records, logs and probe outputs")
    a.add_argument(
        "--budget",
        type=float,
        help="seconds after which no further check group starts (default: 420 on cuda, 1800 on cpu)",
    )
    a.add_argument("--jobs", type=int, help="harness runs at once (default: 7 on cuda, 1 on cpu)")
    a.add_argument("--python", default=sys.executable, help="the interpreter of the runs and probes")
    for name in ("probe-gloo", "probe-memory", "probe-world1"):
        q = sub.add_parser(name)
        q.add_argument("--out", type=Path, required=True)
        q.add_argument("--device", choices=("cuda", "cpu"), required=True)
    args = p.parse_args(argv)
    if args.cmd == "probe-gloo":
        return probe_gloo(args.device, args.out)
    if args.cmd == "probe-memory":
        return probe_memory(args.device, args.out)
    if args.cmd == "probe-world1":
        return probe_world1(args.device, args.out)
    budget = args.budget if args.budget is not None else (420 if args.device == "cuda" else 1800)
    jobs = args.jobs if args.jobs is not None else (7 if args.device == "cuda" else 1)
    return run_all(Context(args.device, args.python, args.out.resolve(), budget, jobs))


if __name__ == "__main__":
    sys.exit(main())
