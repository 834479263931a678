#!/usr/bin/env bash
# Install everything from nothing into .venv/ and run the main job (a 2-worker `tiny` DDP run).
# Horovod is built from a patched sdist once and cached outside the repo; if that fails, set-up still
# succeeds and `harness list` shows horovod as unavailable with the reason.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
mkdir -p .venv/distbench
if bash scripts/install_horovod.sh .venv/bin/python > .venv/distbench/horovod-install.log 2>&1; then
  rm -f .venv/distbench/horovod-unavailable
  echo "horovod: installed"
else
  tail -n 5 .venv/distbench/horovod-install.log > .venv/distbench/horovod-unavailable
  echo "horovod: build failed, continuing without it (see .venv/distbench/horovod-install.log)"
fi
# On CPU, DeepSpeed compiles its shared-memory collective op (cached in ~/.cache/torch_extensions) when its
# process group starts: minutes on 2 cores. Build it once now, not inside the first deepspeed run's timeout.
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  DS_ACCELERATOR=cpu .venv/bin/python -c 'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()' \
    > .venv/distbench/deepspeed-ops.log 2>&1 || echo "deepspeed: CPU comm op not built (see .venv/distbench/deepspeed-ops.log)"
fi
.venv/bin/harness list
.venv/bin/harness run --backend torch-ddp --gpus 2 --workload tiny
