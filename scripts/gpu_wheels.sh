#!/usr/bin/env bash
# Prepares, on a machine with network access, the wheels that scripts/gpu_check.sh installs on a GPU machine
# that has none: DeepSpeed 0.19.8 and the requirements of it that the GPU image lacks, for CPython 3.12 on
# x86-64 Linux. They go to wheels/ (git-ignored), which the device tool carries when a call names it:
#   bash scripts/gpu_wheels.sh            # then: run(command="bash scripts/gpu_check.sh", carry=["wheels"])
# Why these: the image ships torch and most of DeepSpeed's requirements (einops, msgpack, ninja, numpy,
# packaging, psutil, py-cpuinfo, tqdm) but not hjson or pydantic, and pydantic brings pydantic-core,
# annotated-types and typing-inspection; typing-extensions travels too, as pydantic needs 4.16 or newer and
# the image's may be older (pip keeps the image's where it is new enough). The versions are the ones this
# project's .venv runs with DeepSpeed 0.19.8, so the GPU machine gets a combination the CPU suite exercised.
# DeepSpeed publishes only an sdist; it is built here into a py3-none-any wheel with no ops compiled
# (DS_BUILD_OPS=0: DeepSpeed then JIT-builds any op it needs where it runs; the torch AdamW the suite uses
# needs none). The build imports torch, so PYTHON must have torch (the project's .venv does).
# The device tool sends at most 64 MiB (the working tree and the carried paths together): the script checks
# the total and prints the size. Exit 1 if a download or the build fails, a requirement is neither on the
# image nor among the wheels, or the size would not travel.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
dest=${WHEELS_DIR:-wheels}
limit=$((64 * 1024 * 1024))
mkdir -p "$dest"

# Binary and pure-python wheels for cp312 manylinux x86-64 (pip matches each manylinux tag exactly).
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --dest "$dest" \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0

# DeepSpeed: its sdist, built into a wheel without compiled ops.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$py" -m pip download --quiet --no-deps --no-binary=:all: --dest "$build" deepspeed==0.19.8
DS_BUILD_OPS=0 "$py" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$dest" \
    "$build"/deepspeed-0.19.8.tar.gz

# Every requirement of every wheel (no extras; markers evaluated for Linux x86-64 CPython 3.12) must be on
# the image or among the wheels: the GPU machine cannot fetch anything.
"$py" - "$dest" <<'PY'
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# From the device README's list of the H200 image's Python packages: the ones these wheels require.
ON_IMAGE = {"einops", "msgpack", "ninja", "numpy", "packaging", "psutil", "py-cpuinfo", "torch", "tqdm"}
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
have = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
missing = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(ENV):
            continue
        if canonicalize_name(req.name) not in have | ON_IMAGE:
            missing.append(f"{w.name} needs {req}")
for w in wheels:
    print(f"  {w.name}  {w.stat().st_size / 2**20:.2f} MiB")
if missing:
    sys.exit("requirements neither on the image nor in the wheels:\n  " + "\n  ".join(missing))
PY

# What travels: the tracked and untracked-not-ignored files plus the wheels.
wheels_bytes=$(du -cb "$dest"/*.whl | tail -n 1 | cut -f 1)
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null \
    | awk '$2 == "total" { s += $1 } END { print s + 0 }')
total=$((wheels_bytes + tree_bytes))
awk -v w="$wheels_bytes" -v t="$tree_bytes" -v d="$dest" 'BEGIN { m = 1048576;
    printf "wheels: %.2f MiB in %s; with the working tree (%.2f MiB): %.2f MiB of the 64 MiB a call carries\n",
        w / m, d, t / m, (w + t) / m }'
if ((total > limit)); then
    echo "too large to travel: remove something from the working tree or the wheels" >&2
    exit 1
fi
