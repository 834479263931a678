#!/usr/bin/env bash
# The prepared GPU check: on the day a session is lent a GPU machine (see the device tool's README), one call
#   run(command="bash scripts/gpu_check.sh", carry=["wheels"], timeout_s=540)
# checks on ONE GPU the CUDA paths CPU CI cannot, and its output is the verdict: one line per check,
#   PASS <name>: <evidence> | FAIL <name>: <why> | NOT CHECKED <name>: <why>
# then 'N passed, N failed, N not checked'; the exit status is non-zero on any FAIL, including a missing
# import the check needs (torch with CUDA, the harness's own requirements).
#
# What it covers (the checks and their rules live in scripts/gpu_check.py, whose docstring lists them, so
# that tests/test_gpu_check.py can hold the decisions to records on a CPU): torch-ddp, torch-fsdp and
# DeepSpeed ZeRO-1/ZeRO-3 at 1 GPU in fp32, bf16 and fp16; torch-ddp and torch-fsdp `--tuned` in bf16
# (torch.compile, fused AdamW: the compile time and the throughput against the default run); two ranks on
# cuda:0 over gloo; NCCL at world 1
# under the profiler; the TF32 state of fp32 runs with and without --tf32; the allocator peak reset after
# warm-up; 1b bf16 MFU; the precision facts each record states.
#
# DeepSpeed is not on the GPU image: the check installs it from wheels/ when the call carries that folder
# (made by `bash scripts/gpu_wheels.sh` on a machine that reaches PyPI), else says NOT CHECKED with that
# command. It uses the machine's python3 (torch with CUDA); PYTHON overrides it.
#
# Time: about 5 minutes on one H200, estimated (tiny runs share the GPU, 7 at a time; the 1b run alone). No
# check group starts after GPU_CHECK_BUDGET_S seconds (default 420), and every command is killed by the
# budget + 45 s at the latest, so the call ends inside 8 minutes; a skipped group says NOT CHECKED and why.
#
# CPU rehearsal (proves the plumbing where there is no GPU; the GPU-only checks say NOT CHECKED and why):
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh          # ~10 minutes on 2 cores, runs one at a time
#
# Records, logs and probe outputs land in ${CHECK_DIR:-results/gpu-check/<time>}; where OUT is set (the
# folder the device tool brings back) the verdict and a tarball of that folder are copied there.
set -euo pipefail
cd "$(dirname "$0")/.."

device=${GPU_CHECK_DEVICE:-cuda}
case $device in
    cuda | cpu) ;;
    *)
        echo "GPU_CHECK_DEVICE must be cuda or cpu, not '$device'" >&2
        exit 2
        ;;
esac
if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
elif [[ $device == cpu && -x .venv/bin/python ]]; then
    py=.venv/bin/python  # the rehearsal uses the project's environment
else
    py=python3
fi
if ! command -v "$py" >/dev/null; then
    echo "FAIL preflight: no Python interpreter '$py'"
    echo "0 passed, 1 failed, 0 not checked"
    exit 1
fi
dir=${CHECK_DIR:-results/gpu-check/$(date -u +%Y%m%dT%H%M%S)}
mkdir -p "$dir"
budget=${GPU_CHECK_BUDGET_S:-$([[ $device == cuda ]] && echo 420 || echo 1800)}

status=0
PYTHONUNBUFFERED=1 "$py" scripts/gpu_check.py all --device "$device" --out "$dir" --budget "$budget" \
    --python "$py" 2>&1 | tee "$dir/gpu_check.txt" || status=$?

if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then
    cp "$dir/gpu_check.txt" "$OUT/gpu_check.txt"
    tar czf "$OUT/gpu_check_results.tar.gz" -C "$(dirname "$dir")" "$(basename "$dir")"
fi
exit "$status"
