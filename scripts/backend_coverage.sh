#!/usr/bin/env bash
# Which lines of backends/ and workloads/ never run on a CPU machine: every stack's training runs (fp32 and
# the mixed precision its framework has on CPU, 1 and 2 ranks, the collective trace on), ZeRO's stages and
# Paddle's stage 1, then the unit tier, all under coverage with its subprocess patch (launchers and workers
# are measured too), each stack's commbench. What it lists is what only a GPU or a multi-node job reaches: the lines to read with care,
# keep typed (tests/test_types.py) and contract-tested, and to run first on the day a GPU is lent.
#   bash scripts/backend_coverage.sh [OUT_DIR]     # about 12 minutes on 2 cores; the report is OUT_DIR/missing.txt
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=$(realpath -m "${1:-coverage-backends}")
mkdir -p "$out"
rm -f "$out"/.coverage*
"$py" -c 'import coverage' 2>/dev/null || { echo "coverage is not installed: $py -m pip install coverage" >&2; exit 2; }
rc="$out/coveragerc"
cat > "$rc" <<EOF
[run]
patch = subprocess
parallel = true
data_file = $out/.coverage
source = backends, workloads
[report]
show_missing = true
skip_covered = false
EOF

train() {  # train ARGS...: one tiny run, its status line
    echo "== harness run $*"
    "$py" -m coverage run --rcfile="$rc" -m harness run --workload tiny --steps 3 --warmup 1 --compute-steps 2 \
        --isolated-repeats 1 --dump-weights --timeout 300 --out "$out/records" "$@" 2>&1 | grep -E "^record:|error" || true
}
for precision in fp32 bf16; do
    train --backend torch-ddp --gpus 2 --precision "$precision"
    train --backend torch-fsdp --gpus 2 --precision "$precision"
    train --backend deepspeed --gpus 2 --zero-stage 3 --precision "$precision"
    train --backend horovod --gpus 2 --precision "$precision"
    train --backend tf-mwms --gpus 2 --precision "$precision"
done
train --backend torch-ddp --gpus 1 --precision fp16
train --backend deepspeed --gpus 2 --zero-stage 1
train --backend deepspeed --gpus 2 --zero-stage 2 --offload-optimizer
train --backend paddle-fleet --gpus 2
train --backend paddle-fleet --gpus 2 --sharding-stage 1
for backend in torch-ddp torch-fsdp deepspeed horovod tf-mwms paddle-fleet; do  # each stack's collectives
    echo "== harness commbench --backend $backend"
    "$py" -m coverage run --rcfile="$rc" -m harness commbench --backend "$backend" --gpus 2 --sizes 4K,64K \
        --iters 3 --warmup-iters 1 --timeout 300 --out "$out/records" 2>&1 | grep -E "^record:|error" || true
done
echo "== unit tier"
"$py" -m coverage run --rcfile="$rc" -m pytest -q -m unit -p no:cacheprovider tests 2>&1 | tail -n 1
"$py" -m coverage combine --rcfile="$rc" -q
"$py" -m coverage report --rcfile="$rc" | tee "$out/missing.txt"
