#!/usr/bin/env bash
# Install everything from nothing into .venv/ and run the main job (a 2-worker `tiny` DDP run).
# Horovod is built from a patched sdist once and cached outside the repo; if that fails, set-up still
# succeeds and `harness list` shows horovod as unavailable with the reason.
set -euo pipefail
cd "$(dirname "$0")"
# With arguments (--stack torch|tf|paddle, --gpu): each stack in its own venv under .venvs/, for GPU machines
# where one venv cannot hold every stack's CUDA wheels (scripts/setup_stacks.sh). Without: everything below.
[ $# -eq 0 ] || exec bash scripts/setup_stacks.sh "$@"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Every stack (pyproject.toml's extras, the one list of dependencies) and the test suite's tools. One stack
# alone: .venv/bin/pip install -e '.[torch]' (or tf, paddle, deepspeed, horovod; `harness list` names them).
.venv/bin/python -m pip install -q -e '.[all,dev]'
# `harness history --detect` uses Apache Otava's E-divisive detector, which needs only numpy and scipy; its
# package pins numpy 2.2 and scipy < 1.17 and brings database and Slack clients, so it goes in without them.
.venv/bin/python -m pip install -q --no-deps apache-otava==0.8.0
mkdir -p .venv/distbench
if bash scripts/install_horovod.sh .venv/bin/python > .venv/distbench/horovod-install.log 2>&1; then
  rm -f .venv/distbench/horovod-unavailable
  echo "horovod: installed"
else
  tail -n 5 .venv/distbench/horovod-install.log > .venv/distbench/horovod-unavailable
  echo "horovod: build failed, continuing without it (see .venv/distbench/horovod-install.log)"
fi
# On CPU, DeepSpeed compiles its shared-memory collective op when its process group starts, and its CPU Adam
# (a --tuned run's optimizer) when that is built: a minute or more each on 2 cores. Build both once now, not
# inside the first deepspeed run's timeout, in this environment's own folder
# (where the deepspeed adapter points its workers): a build killed in a shared ~/.cache leaves a `lock` file
# on which every later build waits for ever. Set-up is the only builder of its own folder: it clears such a lock.
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  if [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
    export TORCH_EXTENSIONS_DIR=$PWD/.venv/distbench/torch_extensions
    find "$TORCH_EXTENSIONS_DIR" -name lock -type f -delete 2>/dev/null || true
  fi
  DS_ACCELERATOR=cpu timeout 1800 .venv/bin/python -c \
    'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder as A; A().load()' \
    > .venv/distbench/deepspeed-ops.log 2>&1 || echo "deepspeed: CPU ops not built (see .venv/distbench/deepspeed-ops.log)"
fi
.venv/bin/harness list
.venv/bin/harness run --backend torch-ddp --gpus 2 --workload tiny
