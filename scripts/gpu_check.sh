#!/usr/bin/env bash
# The prepared GPU check for a session that is lent a GPU machine (see the device tool's README):
# exercises the CUDA paths that CPU CI cannot — NCCL process groups, autocast bf16/fp16 with GradScaler,
# the allocator's peak stats and NVML, and MFU from the device-peak table — with the machine's own python3
# (it ships torch with CUDA, pandas, rich, psutil, scipy). Records land in ${OUT:-gpu-results}.
#   bash scripts/gpu_check.sh            # about 3-5 minutes on one H200
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}; mkdir -p "$out"
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
run() { echo "== harness run $*"; PYTHONUNBUFFERED=1 "$py" -m harness run --device cuda --out "$out" --timeout 300 "$@" 2>&1 | tail -n 16; }
run --backend torch-ddp  --gpus 1 --workload small --precision bf16 --micro-batch 8 --steps 20
run --backend torch-ddp  --gpus 1 --workload small --precision fp16 --micro-batch 8 --steps 10
run --backend torch-ddp  --gpus 1 --workload small --precision fp32 --micro-batch 4 --steps 10
run --backend torch-fsdp --gpus 1 --workload small --precision bf16 --micro-batch 8 --steps 20
run --backend torch-ddp  --gpus 1 --workload 1b    --precision bf16 --micro-batch 2 --activation-checkpointing --steps 10
"$py" - "$out" <<'PY'
import json, sys, pathlib
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text()); s = r["summary"]; c = r["config"]
    mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a"
    alloc = f"{s['peak_allocated_bytes'] / 2**30:.1f} GiB" if s["peak_allocated_bytes"] else "n/a"
    tps = f"{s['throughput_tokens_per_s']:,.0f}" if s["throughput_tokens_per_s"] else "n/a"
    print(f"{r['backend_info']['label']:12s} {c['workload']:6s} {c['precision']:5s} {r['status']:7s} "
          f"tok/s {tps:>10s}  MFU {mfu:>6s}  peak alloc {alloc}  versions {r['environment']['versions']}")
PY
