#!/usr/bin/env bash
# Per-stack environments, started by `./setup.sh --stack ...` or `./setup.sh --gpu`. One venv cannot hold the
# CUDA builds of every stack (torch's, tensorflow[and-cuda]'s and paddlepaddle-gpu's pinned nvidia-* wheels
# conflict), so each stack gets .venvs/<stack>, where the harness finds it and runs that stack's launchers and
# workers (backends/interpreter.py; `harness list` shows which interpreter each backend uses):
#   ./setup.sh --gpu                  # .venvs/torch, .venvs/tf and .venvs/paddle, CUDA builds
#   ./setup.sh --gpu --stack tf       # only .venvs/tf, CUDA build
#   ./setup.sh --stack paddle         # only .venvs/paddle, the CPU build pyproject.toml pins
#   ./setup.sh --gpu --dry-run        # print each stack's venv and pip specs; install nothing
# Stacks: torch (torch-ddp, torch-fsdp, deepspeed, horovod), tf (tf-mwms), paddle (paddle-fleet). Versions are
# the pins of pyproject.toml's extras; --gpu swaps tensorflow-cpu for tensorflow[and-cuda] and paddlepaddle
# for paddlepaddle-gpu (PyPI's Linux torch wheel is already its CUDA build). A spec can be replaced with
# TORCH_SPEC, DEEPSPEED_SPEC, TF_SPEC or PADDLE_SPEC (e.g. PADDLE_SPEC="paddlepaddle-gpu==3.3.1 -i <index>").
# The harness itself imports no framework: it runs from .venv, which is made here (without any framework)
# only when missing. Each stack's venv gets its framework and what the workers import (numpy, psutil).
set -euo pipefail
set -f  # specs such as tensorflow[and-cuda]==2.21.* go to pip as they are, never as file globs
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STACKS="torch, tf, paddle"
fail() { echo "setup.sh: $*" >&2; exit 2; }

gpu=0; dry_run=0; stacks=()
while [ $# -gt 0 ]; do
  case $1 in
    --gpu) gpu=1 ;;
    --dry-run) dry_run=1 ;;
    --stack) [ $# -ge 2 ] || fail "--stack needs a stack; valid: $STACKS"; stacks+=("$2"); shift ;;
    --stack=*) stacks+=("${1#--stack=}") ;;
    *) fail "unknown option '$1'; valid: --stack STACK (repeatable; $STACKS), --gpu, --dry-run" ;;
  esac
  shift
done
for stack in "${stacks[@]}"; do
  case $stack in torch|tf|paddle) ;; *) fail "unknown stack '$stack'; valid: $STACKS" ;; esac
done
[ ${#stacks[@]} -gt 0 ] || stacks=(torch tf paddle)

# pyproject.toml's pin of a package ("torch==2.13.0" in an extra's list), read with grep: the interpreter
# that runs this may predate tomllib (Python 3.11). A pin that is not there stops set-up here.
pin() {
  grep -oE "\"$1(==|~=|>=|<=|!=|<|>)[^\";]*\"" pyproject.toml | head -n 1 | tr -d '"' | grep . \
    || fail "pyproject.toml has no pin of $1"
}
for package in torch deepspeed tensorflow-cpu paddlepaddle; do pin "$package" > /dev/null; done  # here, not
# inside the $(...) below, where a failure would only leave the spec empty
specs() {  # the pip specs of one stack
  case $1 in
    torch) echo "${TORCH_SPEC:-$(pin torch)} ${DEEPSPEED_SPEC:-$(pin deepspeed)}" ;;
    tf) if ((gpu)); then echo "${TF_SPEC:-$(pin tensorflow-cpu | sed 's/^tensorflow-cpu/tensorflow[and-cuda]/')}"
        else echo "${TF_SPEC:-$(pin tensorflow-cpu)}"; fi ;;
    paddle) if ((gpu)); then echo "${PADDLE_SPEC:-$(pin paddlepaddle | sed 's/^paddlepaddle/paddlepaddle-gpu/')}"
            else echo "${PADDLE_SPEC:-$(pin paddlepaddle)}"; fi ;;
  esac
}

describe() { echo "$1: .venvs/$1 ($( ((gpu)) && echo CUDA || echo CPU ) build: $(specs "$1"))"; }

if ((dry_run)); then
  for stack in "${stacks[@]}"; do describe "$stack"; done
  exit 0
fi
if [ ! -x .venv/bin/harness ]; then  # the harness's own environment: no framework
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
fi
for stack in "${stacks[@]}"; do
  venv=.venvs/$stack
  describe "$stack"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2046  # the specs are words on purpose (a spec may carry its own pip options)
  "$venv/bin/python" -m pip install -q $(specs "$stack") numpy psutil
  mkdir -p "$venv/distbench"
  [ "$stack" = torch ] || continue
  # Horovod is built against this venv's torch (CUDA and NCCL on a GPU machine: scripts/install_horovod.sh)
  if bash scripts/install_horovod.sh "$venv/bin/python" > "$venv/distbench/horovod-install.log" 2>&1; then
    rm -f "$venv/distbench/horovod-unavailable"; echo "horovod: installed in $venv"
  else
    tail -n 5 "$venv/distbench/horovod-install.log" > "$venv/distbench/horovod-unavailable"
    echo "horovod: build failed, continuing without it (see $venv/distbench/horovod-install.log)"
  fi
  # DeepSpeed's CPU ops, built once here instead of by the first run that needs each: its all-reduce
  # (every CPU run) and its CPU Adam (a --tuned run's optimizer, backends/deepspeed_zero)
  if ((!gpu)) && [ -z "${TORCH_EXTENSIONS_DIR:-}" ]; then
    extensions=$PWD/$venv/distbench/torch_extensions
    find "$extensions" -name lock -type f -delete 2>/dev/null || true
    TORCH_EXTENSIONS_DIR=$extensions DS_ACCELERATOR=cpu timeout 1800 "$venv/bin/python" -c \
      'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder as A; A().load()' \
      > "$venv/distbench/deepspeed-ops.log" 2>&1 || echo "deepspeed: CPU ops not built (see $venv/distbench/deepspeed-ops.log)"
  fi
done
.venv/bin/harness list
