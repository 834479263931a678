#!/usr/bin/env bash
# The prepared GPU check for a session that is lent a GPU machine (see the device tool's README): exercises,
# on ONE GPU, the CUDA paths that CPU CI cannot, with the machine's own python3 (it ships torch with CUDA,
# pandas, rich, psutil, scipy; TensorFlow, Paddle and DeepSpeed are used only where they import with a GPU,
# else skipped with the reason printed):
#   - NCCL process groups, autocast bf16/fp16 with GradScaler, MFU from the device-peak table;
#   - (4) the fp32 math mode each worker records (TF32 or not) and the MFU taken from it;
#   - (6) batch preparation (data_prep, outside the timed region) against the step time;
#   - (7) tf-mwms: what synchronize() still waits for after the loss read-back (if TF sees the GPU);
#   - (9) allocator peaks reset after warm-up, against the model-state bytes; torch-fsdp vs torch-ddp, 1 rank;
#   - the device contract under CUDA_VISIBLE_DEVICES=0: the GPU each rank record says it ran on;
#   - the collective trace's GPU path (torch profiler: c10d ops paired with NCCL kernels, overlap from the
#     other kernels): runs trace only at 2+ ranks, so a probe runs NCCL all-reduces at world 1 under the
#     profiler and reads them with backends.comm_trace (what it pairs, and the NCCL kernels it saw);
#   - harness predict calibrated by this GPU's 1-rank runs (the device name must match the H200 profile),
#     whose optimizer steps are timed between CUDA synchronisations in steps after the measured ones;
# One summary line per record at the end. Records and logs land in ${CHECK_DIR:-gpu-results}; where OUT is
# set (the device tool's folder that comes back), the summary and a tarball of them are copied there.
#   bash scripts/gpu_check.sh            # about 4-6 minutes on one H200 (torch only); under 8 with all
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${CHECK_DIR:-gpu-results}; mkdir -p "$dir"
py=${PYTHON:-python3}
budget=${CHECK_BUDGET_S:-420}  # optional runs are skipped once this many seconds are spent
SECONDS=0
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,driver_version --format=csv | tee "$dir/nvidia-smi.txt"

run() {
    echo "== [${SECONDS}s] harness run $*"
    PYTHONUNBUFFERED=1 "$py" -m harness run --device cuda --out "$dir" --timeout 240 "$@" 2>&1 | tail -n 6
}
skip() { echo "== SKIPPED $1: $2"; }
in_budget() {  # in_budget NAME: false (and says so) once the budget is spent
    if ((SECONDS > budget)); then skip "$1" "${SECONDS}s spent of the ${budget}s budget"; return 1; fi
}
why_not() {  # why_not MODULE: empty if MODULE imports and sees a GPU, else the reason
    local said
    said=$("$py" - "$1" 2>/dev/null <<'PY' | sed -n 's/^WHY://p'
import sys
name = sys.argv[1]
try:
    if name == "tensorflow":
        import tensorflow as tf
        ok = bool(tf.config.list_physical_devices("GPU"))
    elif name == "paddle":
        import paddle
        ok = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    else:
        __import__(name)
        ok = True
except Exception as e:  # noqa: BLE001
    print(f"WHY:python3 -c 'import {name}' fails: {type(e).__name__}: {str(e)[:120]}")
else:
    print("WHY:ok" if ok else f"WHY:{name} imports but sees no GPU (a CPU-only build?)")
PY
)
    [[ $said == ok ]] || echo "${said:-the import check of $1 died without a word}"
}

# (4) + (6): fp32 on torch: the recorded math mode (torch's default: no TF32) and the MFU taken from it.
run --backend torch-ddp --gpus 1 --workload small --precision fp32 --micro-batch 4 --steps 10 --warmup 3
# (9): one rank each, same workload: peaks after warm-up, against the model-state bytes.
run --backend torch-fsdp --gpus 1 --workload small --precision fp32 --micro-batch 4 --steps 10 --warmup 3 \
    --compute-method none
# Device contract: the user's mask, the isolated method asked for (1 rank: no counterfactual to place).
CUDA_VISIBLE_DEVICES=0 run --backend torch-ddp --gpus 1 --workload tiny --steps 5 --warmup 2 \
    --compute-method isolated
reason=$(why_not deepspeed)
if [[ -n $reason ]]; then skip "deepspeed (device contract)" "$reason"
elif in_budget deepspeed; then
    CUDA_VISIBLE_DEVICES=0 run --backend deepspeed --gpus 1 --workload tiny --steps 5 --warmup 2 \
        --compute-method isolated
fi

# (7): TensorFlow on the GPU: a harness run (records TF's TF32 switch), then the synchronize() probe.
reason=$(why_not tensorflow)
if [[ -n $reason ]]; then skip "tf-mwms (7)" "$reason"
elif in_budget tf-mwms; then
    run --backend tf-mwms --gpus 1 --workload small --precision fp32 --micro-batch 4 --steps 10 --warmup 3 \
        --compute-method none
    echo "== [${SECONDS}s] tf-mwms synchronize() probe"
    CUDA_VISIBLE_DEVICES=0 PROBE_DEVICE=cuda "$py" - <<'PY' 2>&1 | grep -E "^probe|Error|Traceback"
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
from backends.tf_mwms.worker import make_trainer
from core.config import RunConfig
from workloads.data import Shard, make_source, micro_batches
from workloads.spec import resolve

workload = os.environ.get("PROBE_WORKLOAD", "small")
cfg = RunConfig("tf-mwms", workload, resolve(workload), 1, os.environ["PROBE_DEVICE"], micro_batch=4)
trainer = make_trainer(cfg)
source = make_source(cfg.spec.vocab_size, cfg.spec.seq_len, cfg.global_batch, cfg.seed)
shard = Shard(0, 1, cfg.micro_batch, cfg.grad_accum)
steps, tails, counted = [], [], []
for step in range(10):
    batches = micro_batches(source, shard, step)
    trainer.synchronize()
    t0 = time.perf_counter()
    trainer.step(batches)  # returns after the loss read-back
    t1 = time.perf_counter()
    trainer.synchronize()  # what it still waits for: the all-reduce and optimizer tail
    t2 = time.perf_counter()
    counted.append(int(trainer.optimizer.iterations.numpy()) == step + 1)
    steps.append(t1 - t0), tails.append(t2 - t1)
ms = lambda xs: f"{statistics.median(xs[3:]) * 1e3:.2f} ms"  # noqa: E731
print(f"probe tf-mwms {workload}: step to loss read-back {ms(steps)}, then synchronize() {ms(tails)} "
      f"(median of 7 after 3 warm-up); optimizer step counter == steps after every sync: {all(counted)}")
PY
fi

# Paddle on the GPU: records Paddle's cuBLAS TF32 switch, peaks after warm-up, a real device sync.
reason=$(why_not paddle)
if [[ -n $reason ]]; then skip "paddle-fleet" "$reason"
elif in_budget paddle-fleet; then
    run --backend paddle-fleet --gpus 1 --workload small --precision fp32 --micro-batch 4 --steps 10 --warmup 3 \
        --compute-method none
fi

# The trace's GPU path on one GPU: NCCL all-reduces at world 1 beside matmuls, under the profiler the torch
# workers use, read by backends.comm_trace.torch_collectives.
echo "== [${SECONDS}s] the collective trace's GPU path (NCCL at world 1, torch profiler)"
CUDA_VISIBLE_DEVICES=0 "$py" - <<'PY' 2>&1 | grep -E "^probe|Error|Traceback"
import json, os, sys, tempfile
sys.path.insert(0, os.getcwd())
import torch
import torch.distributed as dist
from torch.autograd import profiler
from backends.comm_trace import torch_collectives

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
a, g = torch.randn(2048, 2048, device="cuda"), torch.randn(1 << 20, device="cuda")
for _ in range(3):
    a @ a, dist.all_reduce(g)
torch.cuda.synchronize()
with profiler.profile(use_cpu=True, use_device="cuda", record_shapes=True, use_kineto=True) as prof:
    for _ in range(5):
        b = a @ a
        dist.all_reduce(g)
        c = a @ a
    torch.cuda.synchronize()
with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
kernels = sorted({e["name"][:70] for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()})
calls = torch_collectives(events, 1)
timed = [c for c in calls if c["time_s"] is not None]
print(f"probe trace on GPU: {len(calls)} c10d call(s), {len(timed)} paired with an NCCL kernel; "
      f"NCCL kernels seen: {kernels or 'none (NCCL may launch none at world 1)'}")
for c in timed[:3]:
    print(f"probe   {c['op']} {c['size_bytes']} B, {c['dtype']}: {c['time_s'] * 1e6:.1f} us, "
          f"other kernels during it {c['overlapped_s'] * 1e6:.1f} us")

# commbench's bursts on NCCL (async_op=True, each handle waited, then a device sync), checked like commbench
from types import SimpleNamespace
from backends.commbench import check_output, timed_bursts
from backends.torch_ddp.collectives import TorchCollectives

bench = TorchCollectives.__new__(TorchCollectives)  # the process group is up already
bench.comm, bench.device, bench.dtype, bench.world_size = dist, torch.device("cuda", 0), torch.float32, 1
bench.cfg = SimpleNamespace(device="cuda")
for op in ("all_reduce", "all_gather", "reduce_scatter"):
    burst = [bench.prepare(op, 1 << 16, 1.0) for _ in range(8)]
    bench.call_burst(op, burst)
    bench.synchronize()
    for got in bench.burst_results(op, burst):
        check_output(op, got, 1 << 16, 1, "fp32")
    times = timed_bursts(bench, op, [bench.prepare(op, 1 << 16, 0.0) for _ in range(8)], 5)
    print(f"probe burst {op} 256 KiB on NCCL, outputs checked: {min(times) * 1e6:.1f} us per call (least of 5)")
dist.destroy_process_group()
PY

# harness commbench on NCCL needs one GPU per rank and at least 2 ranks: not on this one-GPU machine. What
# it can check here: that asking for it is refused before anything launches (exit 2, one line).
echo "== [${SECONDS}s] harness commbench --gpus 2 on one GPU (must be refused: exit 2)"
"$py" -m harness commbench --backend torch-ddp --gpus 2 --device cuda --out "$dir/commbench" 2>&1 | tail -n 2
echo "   exit ${PIPESTATUS[0]}"
skip "commbench on NCCL (torch.distributed, deepspeed.comm, horovod, paddle, tf)" "needs 2+ GPUs; this machine has one"

# Mixed precision and a large model (as before this check covered the issues above).
in_budget "torch-ddp bf16" && run --backend torch-ddp --gpus 1 --workload small --precision bf16 --micro-batch 8 --steps 10
in_budget "torch-ddp fp16" && run --backend torch-ddp --gpus 1 --workload small --precision fp16 --micro-batch 8 --steps 10
in_budget "torch-ddp 1b" && run --backend torch-ddp --gpus 1 --workload 1b --precision bf16 --micro-batch 2 \
    --activation-checkpointing --steps 5 --warmup 2

# harness predict calibrated by this GPU's 1-rank runs: the driver's device name must match the profile's
# (compute "measured", not "assumed MFU"), and N = 1 must give back the measured bf16 step.
echo "== [${SECONDS}s] harness predict --hardware h200-sxm --calibrate (compute must say: measured)"
"$py" -m harness predict --backend torch-ddp --workload small --precision bf16 --micro-batch 8 --gpus 1,8,64 \
    --hardware h200-sxm --calibrate "$dir" 2>&1 | grep -E "PREDICTED|^│|note:|error" | cut -c1-160

echo "== [${SECONDS}s] one line per record"
"$py" - "$dir" <<'PY' | tee "$dir/summary.txt"
import csv, json, pathlib, statistics, sys

root = pathlib.Path(sys.argv[1])
smi = list(csv.reader((root / "nvidia-smi.txt").read_text().splitlines()))[1:]
physical = {}  # device name -> the nvidia-smi indices of GPUs of that name
for row in smi:
    physical.setdefault(row[1].strip(), []).append(row[0].strip())


def per_step_max(ranks, key):
    return [max(s) for s in zip(*[r.get(key) or [] for r in ranks])]


def med_ms(xs):
    return f"{statistics.median(xs) * 1e3:8.2f} ms" if xs else "     n/a   "


def gib(b):
    return f"{b / 2**30:5.2f} GiB" if b else "  n/a    "


for p in sorted(root.glob("*.json")):
    r = json.loads(p.read_text()); s = r.get("summary") or {}; c = r["config"]
    ranks = [k for k in r.get("ranks", []) if k.get("status") == "ok"]
    mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else "n/a"
    tps = f"{s['throughput_tokens_per_s']:,.0f}" if s.get("throughput_tokens_per_s") else "n/a"
    tf32 = sorted({str((k.get("math_mode") or {}).get("tf32")) for k in ranks}) or ["n/a"]
    settings = sorted({(k.get("math_mode") or {}).get("tf32_setting") or "-" for k in ranks})
    state = s.get("model_state_bytes_per_rank")
    alloc = s.get("peak_allocated_bytes")
    scope = sorted({(k.get("memory") or {}).get("peak_rss_scope", "?") for k in ranks})
    step, prep = per_step_max(ranks, "step_times"), per_step_max(ranks, "data_prep")
    opt = [t for k in ranks for t in k.get("optimizer_step_times") or []]  # 1 rank: timed after the measured
    timed = per_step_max(ranks, "optimizer_timed_step_times")  # those steps whole: their excess is the syncs'
    gap = f" (those steps {med_ms(timed)}, +{(statistics.median(timed) - statistics.median(step)) * 1e3:.2f} ms on the measured)" if timed and step else ""
    ratio = f"{statistics.median(prep) / statistics.median(step):.1%}" if prep and step else "n/a"
    devices = [k.get("device") for k in r.get("ranks", [])]
    iso = [k.get("device") for k in r.get("isolated_ranks", [])]
    where = ", ".join(f"{d} = GPU {'/'.join(physical.get(d, ['?']))}" for d in devices)
    print(
        f"{r['backend_info']['label']:12s} {c['workload']:5s} {c['precision']:4s} {r['status']:6s} "
        f"tok/s {tps:>9s}  MFU {mfu:>6s} (peak {s.get('device_peak_precision', '?')})  tf32 {'/'.join(tf32)}  "
        f"peak alloc {gib(alloc)} vs model state {gib(state)}"
        f"{f' (x{alloc / state:.2f})' if alloc and state else ''} [{'/'.join(scope)}]  "
        f"data_prep {med_ms(prep)} vs step {med_ms(step)} ({ratio})"
    )
    print(f"    math mode: {'; '.join(settings)}   ranks on: {where or 'n/a'}   isolated workers on: "
          f"{', '.join(iso) if iso else 'none (1 rank: no counterfactual)' if c['world_size'] == 1 else 'none'}"
          f"   optimizer step {med_ms(opt)} in {len(opt)} steps after the measured ones{gap}"
          f"{'   error: ' + str(r.get('error'))[:200] if r['status'] != 'ok' else ''}")
    for k in ranks:  # a traced run (2+ ranks; none on one GPU): its calls as the trace paired them
        trace = k.get("comm_trace")
        if trace is None:
            continue
        calls = trace.get("collectives")
        if calls is None:
            print(f"    rank {k['rank']} comm trace: none ({trace.get('reason')})")
            continue
        by_op = {}
        for c in calls:
            o = by_op.setdefault(c["op"], [0, 0, 0.0, 0.0, 0])
            o[0] += 1
            o[1] += c["size_bytes"] or 0
            o[2] += c["time_s"] or 0.0
            o[3] += c["overlapped_s"] or 0.0
            o[4] += c["time_s"] is None
        ops = "; ".join(
            f"{op} x{n} {b / 2**20:.2f} MiB {t * 1e3:.2f} ms overlap {ov / t if t else 0:.0%}"
            + (f" ({u} without a kernel)" if u else "")
            for op, (n, b, t, ov, u) in by_op.items()
        )
        print(f"    rank {k['rank']} comm trace ({trace.get('method')}, {trace.get('steps')} steps): {ops or 'no calls'}")
PY
echo "== done in ${SECONDS}s"
if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then
    cp "$dir/summary.txt" "$OUT/gpu_check_summary.txt"
    tar czf "$OUT/gpu_check_results.tar.gz" "$dir"
fi
