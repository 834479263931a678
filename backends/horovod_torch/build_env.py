"""The environment of Horovod's source build (scripts/install_horovod.sh), decided here so that it can be
tested as data, without a GPU and without a six-minute build.

CPU: PyTorch and Gloo, no MPI, TensorFlow or MXNet (what setup.sh has always built).

GPU (HOROVOD_GPU_OPERATIONS=NCCL) needs three things that a pip-only venv does not lay out the way Horovod
0.28.1's build expects (its CMakeLists.txt, cmake/Modules/FindNCCL.cmake and cmake/build_utils.py):
- nvcc. The CUDA kernels are compiled with it: build_utils.get_nvcc_bin looks on PATH, then in
  $HOROVOD_CUDA_HOME/bin (default /usr/local/cuda), and CMake takes $HOROVOD_CUDA_HOME/bin/nvcc when that is
  set. HOROVOD_CUDA_HOME is set to the toolkit of the nvcc found, so both use the same one.
- NCCL. FindNCCL links libnccl_static.a unless HOROVOD_NCCL_LINK=SHARED. The nvidia-nccl-cu12/13 wheel that
  torch's CUDA build installs ships only include/nccl.h and lib/libnccl.so.2, and find_library(nccl) looks
  for an unversioned libnccl.so, so the build also gets a folder of its own holding libnccl.so -> the
  wheel's libnccl.so.2 (HOROVOD_NCCL_LIB). The linker records the soname, libnccl.so.2, which torch has
  already loaded from the same wheel by the time horovod.torch loads its extension.
- Compute capabilities. Without HOROVOD_BUILD_CUDA_CC_LIST, build_utils compiles the kernels for every
  architecture its nvcc knows; the device's own (nvidia-smi's compute_cap) is enough, and the cached wheel
  is keyed by them (the tag), so a machine with other GPUs builds its own.

The user's own HOROVOD_CUDA_HOME, HOROVOD_NCCL_HOME/INCLUDE/LIB/LINK and HOROVOD_BUILD_CUDA_CC_LIST win over
what is found here. A missing piece is one line on stderr that names it and how to get it (exit 2):
setup.sh keeps the install log's last lines, and `harness list` shows the last one as why horovod is
unavailable.

Run by install_horovod.sh with the venv's own interpreter (its site-packages are where the NCCL wheel is):
standard library only, no framework, nothing of this repository imported.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# What the CPU build has always been given (setup.sh on a machine without a GPU, and CI).
CPU_ENV = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MPI": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
}
USER_NCCL = ("HOROVOD_NCCL_HOME", "HOROVOD_NCCL_INCLUDE", "HOROVOD_NCCL_LIB")
CUDA_ROOTS = ("CUDA_HOME", "CUDA_PATH")
DEFAULT_CUDA = Path("/usr/local/cuda")
PREFIX = "horovod GPU build:"


class MissingPiece(Exception):
    """Something the GPU build needs is not here; the message names it and how to get it."""


@dataclass(frozen=True)
class BuildEnv:
    """What the build is given: `env` on top of the inherited environment; `links` (link -> target) to make
    before it starts; `tag`, the part of the cached wheel's name that tells builds apart."""

    env: dict[str, str]
    tag: str
    links: dict[Path, Path] = field(default_factory=dict)


def find_nvcc(environ: Mapping[str, str], which: Callable[[str], str | None] = shutil.which) -> Path | None:
    """The nvcc the build will use: $HOROVOD_CUDA_HOME/bin/nvcc when the user set it (and only that), else
    PATH's, else $CUDA_HOME, $CUDA_PATH or /usr/local/cuda's bin/nvcc."""
    if environ.get("HOROVOD_CUDA_HOME"):
        nvcc = Path(environ["HOROVOD_CUDA_HOME"]) / "bin" / "nvcc"
        return nvcc if nvcc.is_file() else None
    if found := which("nvcc"):
        return Path(found)
    roots = [Path(environ[k]) for k in CUDA_ROOTS if environ.get(k)] + [DEFAULT_CUDA]
    return next((root / "bin" / "nvcc" for root in roots if (root / "bin" / "nvcc").is_file()), None)


def find_nccl_wheel(paths: Iterable[str]) -> Path | None:
    """The installed nvidia/nccl package folder (of the nvidia-nccl-cuXX wheel) on these import paths."""
    for entry in paths:
        folder = Path(entry or ".") / "nvidia" / "nccl"
        if folder.is_dir():
            return folder
    return None


def compute_capabilities(text: str) -> list[str]:
    """'9.0\\n9.0\\n' (nvidia-smi --query-gpu=compute_cap --format=csv,noheader, one line a GPU) -> ['90']:
    the distinct capabilities as HOROVOD_BUILD_CUDA_CC_LIST spells them, in ascending order."""
    caps = set()
    for line in text.split():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and (minor.isdigit() or not minor):
            caps.add(int(major) * 10 + int(minor or 0))
    return [str(c) for c in sorted(caps)]


def toolkit_hint(torch_cuda: str) -> str:
    major_minor = "-".join(torch_cuda.split(".")[:2]) if torch_cuda else "X-Y"
    return (
        f"install the CUDA toolkit that matches torch's CUDA {torch_cuda or '(unknown)'} (e.g. NVIDIA's "
        f"cuda-toolkit-{major_minor} package) and put its bin/ on PATH, or set HOROVOD_CUDA_HOME to it"
    )


def nccl_settings(nccl_dir: Path | None, link_dir: Path, torch_cuda: str) -> tuple[dict, dict]:
    """HOROVOD_NCCL_* for the NCCL wheel at `nccl_dir`, and the unversioned link the build needs."""
    wheel = f"nvidia-nccl-cu{torch_cuda.split('.')[0] if torch_cuda else 'XX'}"
    if nccl_dir is None:
        raise MissingPiece(
            f"{PREFIX} NCCL not found: no nvidia/nccl folder (the {wheel} wheel) in this venv's "
            f"site-packages; pip install {wheel}, or set HOROVOD_NCCL_HOME to an NCCL with include/nccl.h "
            "and lib/libnccl.so"
        )
    if not (nccl_dir / "include" / "nccl.h").is_file():
        raise MissingPiece(
            f"{PREFIX} NCCL headers not found: {nccl_dir / 'include' / 'nccl.h'} is missing; reinstall "
            f"{wheel} (pip install --force-reinstall {wheel}) or set HOROVOD_NCCL_INCLUDE"
        )
    lib = nccl_dir / "lib"
    libraries = sorted(lib.glob("libnccl.so*")) if lib.is_dir() else []
    if not libraries:
        raise MissingPiece(
            f"{PREFIX} NCCL library not found: no libnccl.so* in {lib}; reinstall {wheel} or set "
            "HOROVOD_NCCL_LIB"
        )
    links = {}
    if not (lib / "libnccl.so").exists():  # the wheel's case: only the versioned file
        links[link_dir / "libnccl.so"] = libraries[-1]
        lib = link_dir
    env = {
        "HOROVOD_NCCL_HOME": str(nccl_dir),
        "HOROVOD_NCCL_INCLUDE": str(nccl_dir / "include"),
        "HOROVOD_NCCL_LIB": str(lib),
        "HOROVOD_NCCL_LINK": "SHARED",
    }
    return env, links


def build_env(
    device: str,
    environ: Mapping[str, str],
    nvcc: Path | None = None,
    nccl_dir: Path | None = None,
    capabilities: list[str] | None = None,
    link_dir: Path = Path("nccl-lib"),
    torch_cuda: str = "",
) -> BuildEnv:
    """The build's environment for `device` "cpu" or "cuda", from what was found on this machine (raises
    MissingPiece on a GPU machine that lacks something)."""
    if device == "cpu":
        return BuildEnv(dict(CPU_ENV), "cpu")
    if not torch_cuda:
        raise MissingPiece(
            f"{PREFIX} this venv's torch is a CPU build (torch.version.cuda is None); install torch's CUDA "
            "build first, then run scripts/install_horovod.sh again"
        )
    if nvcc is None:
        where = (
            f"$HOROVOD_CUDA_HOME/bin ({environ['HOROVOD_CUDA_HOME']})"
            if environ.get("HOROVOD_CUDA_HOME")
            else "PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin"
        )
        raise MissingPiece(
            f"{PREFIX} nvcc not found (looked in {where}): Horovod compiles its CUDA kernels with it; "
            + toolkit_hint(torch_cuda)
        )
    env = {**CPU_ENV, "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_CUDA_HOME": str(nvcc.parent.parent)}
    links: dict[Path, Path] = {}
    if not any(environ.get(k) for k in USER_NCCL):
        nccl_env, links = nccl_settings(nccl_dir, link_dir, torch_cuda)
        env.update(nccl_env)
    if environ.get("HOROVOD_BUILD_CUDA_CC_LIST"):
        caps = [c.strip() for c in environ["HOROVOD_BUILD_CUDA_CC_LIST"].split(",") if c.strip()]
    elif capabilities:
        caps = list(capabilities)
    else:
        raise MissingPiece(
            f"{PREFIX} no GPU compute capability: nvidia-smi --query-gpu=compute_cap and "
            "torch.cuda.get_device_capability gave none; set HOROVOD_BUILD_CUDA_CC_LIST (e.g. 90 for "
            "H100/H200)"
        )
    env["HOROVOD_BUILD_CUDA_CC_LIST"] = ",".join(caps)
    # what the user set stays theirs (their env reaches the build unchanged)
    env = {k: v for k, v in env.items() if not environ.get(k) or k in CPU_ENV}
    return BuildEnv(env, "nccl-sm" + "-".join(caps), links)


def device_capabilities(python: str) -> list[str]:
    """This machine's GPUs' compute capabilities: nvidia-smi's, else torch's (in a subprocess)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode == 0 and (caps := compute_capabilities(out.stdout)):
            return caps
    except (OSError, subprocess.TimeoutExpired):
        pass
    code = (
        "import torch; print(*('%d.%d' % torch.cuda.get_device_capability(i) "
        "for i in range(torch.cuda.device_count())))"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return compute_capabilities(out.stdout) if out.returncode == 0 else []


def main(argv: list[str] | None = None) -> int:
    """Print the build's tag on the first line, then one NAME=VALUE line per variable (the links made); or
    one line naming what is missing, on stderr, and exit 2."""
    p = argparse.ArgumentParser(description="Horovod's build environment for this venv and machine")
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--torch-cuda", default="", help="torch.version.cuda of this venv's torch ('' for CPU)")
    p.add_argument("--link-dir", type=Path, required=True, help="a scratch folder for the NCCL link")
    args = p.parse_args(argv)
    try:
        if args.device == "cpu":
            plan = build_env("cpu", os.environ)
        else:
            plan = build_env(
                "cuda",
                os.environ,
                nvcc=find_nvcc(os.environ),
                nccl_dir=find_nccl_wheel(sys.path),
                capabilities=[]
                if os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST")
                else device_capabilities(sys.executable),
                link_dir=args.link_dir,
                torch_cuda=args.torch_cuda,
            )
    except MissingPiece as exc:
        print(exc, file=sys.stderr)
        return 2
    for link, target in plan.links.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    print(plan.tag)
    for name, value in plan.env.items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
