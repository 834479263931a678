#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 into the given venv, which must hold torch and what the build
# imports (pyproject.toml's `horovod` extra: `pip install -e '.[horovod]'` first).
# PyPI's 0.28.1 sets C++14 but torch>=2.1 headers need C++17, so we patch the two CMakeLists and build
# the sdist ourselves. The built wheel is cached outside the repo, keyed by horovod, torch and Python
# versions, so a second set-up (and CI on the same machine) installs it in seconds instead of ~6 minutes.
# On a GPU machine the build also needs nvcc, the NCCL wheel's headers and library and the device's compute
# capability: backends/horovod_torch/build_env.py decides the build's environment (and names what is missing,
# as the log's last line); see its docstring. `--print-env` prints that environment and the cache folder, and
# builds nothing.
# Exit status is non-zero on failure; setup.sh treats that as "horovod unavailable", not as a failed set-up.
set -euo pipefail
PY=${1:?usage: install_horovod.sh PATH/TO/python [--print-env]}
HVD_VERSION=0.28.1
torch_v=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
py_v=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
device=cpu; command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && device=cuda
torch_cuda=; [ "$device" = cuda ] && torch_cuda=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# line 1: the build's tag (cpu, or nccl-sm<capabilities>); then NAME=VALUE lines
plan=$("$PY" "$(dirname "$0")/../backends/horovod_torch/build_env.py" --device "$device" \
  --torch-cuda "$torch_cuda" --link-dir "$work/nccl-lib")
tag=$(head -n 1 <<<"$plan")
mapfile -t build_env < <(tail -n +2 <<<"$plan")
cache=${DISTBENCH_CACHE:-$HOME/.cache/distbench}/horovod-$HVD_VERSION-torch$torch_v-$py_v-$tag
if [ "${2:-}" = --print-env ]; then
  echo "cache=$cache"; printf '%s\n' "${build_env[@]}"; exit 0
fi
if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
  echo "building horovod $HVD_VERSION for torch $torch_v ($tag); cached in $cache (about 6 minutes on 2 cores)"
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$work"
  tar xzf "$work/horovod-$HVD_VERSION.tar.gz" -C "$work"
  src=$work/horovod-$HVD_VERSION
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  env "${build_env[@]}" MAKEFLAGS=-j"$(nproc)" \
      "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$work/wheel" "$src"
  mkdir -p "$cache"; cp "$work"/wheel/horovod-*.whl "$cache/"
fi
# With the wheel's own requirements (cloudpickle, psutil, pyyaml, packaging, cffi): torch is only in its
# `pytorch` extra, which is not asked for, so pip leaves the venv's torch as it is.
"$PY" -m pip install -q "$cache"/horovod-*.whl
"$(dirname "$PY")/horovodrun" --check-build
