"""`harness env`: what a bug report needs, in one paste: distbench's version and commit, Python, the OS, the
CPU and memory, the GPUs, CUDA and NCCL, every backend's interpreter with the versions of its frameworks
there, and the launchers' and cluster tools' versions. `--json` prints the same as one JSON object.

The harness imports no framework (two in one process can crash): each backend's interpreter
(backends.interpreter) is asked in a subprocess, where versions come from the installed distributions'
metadata. Only torch is imported there, and only where it may be a CUDA build, because its CUDA, cuDNN
and NCCL versions are known to torch alone (NCCL may be linked into it); PyTorch's CPU wheels say so in
their version (`+cpu`) and are not imported. Also here: the one command that adds a stack that is
missing (`install_command`), which `harness list` prints too.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from backends import all_backends, interpreter
from backends.base import Backend
from backends.process_stats import cpu_name
from core.process import REPO_ROOT, available_cpus
from core.records import git_commit
from harness.run.devices import query_gpus
from harness.run.doctor import IMPORT_TIMEOUT_S, TORCH_BUILD, last_line, run
from harness.usage import EXIT_OK

TOOL_TIMEOUT_S = 20
GPU_FIELDS = ("name", "driver_version", "memory.total")
# Commands whose first line of output is a version, run where they are on PATH: MPI (Horovod can run over
# it), the Slurm and Kubernetes clients `harness slurm` / `harness k8s` hand jobs to, and the CUDA toolkit
# Horovod's GPU build compiles with.
TOOLS = {
    "mpirun": ["mpirun", "--version"],
    "sinfo": ["sinfo", "--version"],
    "kubectl": ["kubectl", "version", "--client"],
    "nvcc": ["nvcc", "--version"],
}
# What `harness env` shows of the facts TORCH_BUILD prints (run by an interpreter that holds torch).
BUILD_FIELDS = ("cuda", "hip", "cudnn", "nccl")


def shown(path: str | Path) -> str:
    """`path` as the user would type it here: relative to the working directory when it is under it."""
    full = os.path.abspath(path)
    cwd = os.getcwd()
    return os.path.relpath(full, cwd) if full == cwd or full.startswith(cwd + os.sep) else full


def install_command(backend: Backend, python: str) -> str | None:
    """The one command that installs `backend`'s stack for `python` (its workers' interpreter): the
    adapter's pyproject extra, then scripts/install_<extra>.sh where pip alone cannot install the stack
    (an installed wheel has neither the tree nor its scripts: the extra's requirements alone).
    None for an adapter that names no extra."""
    if not backend.extra:
        return None
    py = shown(python)
    if (REPO_ROOT / "pyproject.toml").is_file():  # a source tree, installed editable
        command = f"{py} -m pip install -e {shlex.quote(f'{shown(REPO_ROOT)}[{backend.extra}]')}"
    else:  # an installed wheel: no tree to name, so the extra's requirements, as its metadata lists them
        marker = re.compile(rf";\s*extra\s*==\s*['\"]{re.escape(backend.extra)}['\"]\s*$")
        required = [
            marker.sub("", r) for r in importlib.metadata.requires("distbench") or [] if marker.search(r)
        ]
        command = f"{py} -m pip install {shlex.join(required)}"
    script = REPO_ROOT / "scripts" / f"install_{backend.extra}.sh"
    if script.is_file():
        command += f" && bash {shown(script)} {py}"
    return command


# --------------------------------------------------------------------------------------------- collection
def tool_version(argv: list[str]) -> str | None:
    """The first line `argv` prints, None when it is not on PATH."""
    if not shutil.which(argv[0]):
        return None
    rc, out = run(argv, TOOL_TIMEOUT_S)
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if rc != 0 or not lines:
        return f"fails (exit {rc}): {last_line(out)}"
    # nvcc prints its copyright first; its release line is the one with the version
    return next((line for line in lines if "release" in line), lines[0]) if argv[0] == "nvcc" else lines[0]


def driver_cuda() -> str | None:
    """The CUDA version the GPU driver supports, from nvidia-smi's header (no --query-gpu field has it)."""
    if not shutil.which("nvidia-smi"):
        return None
    rc, out = run(["nvidia-smi"], TOOL_TIMEOUT_S)
    found = re.search(r"CUDA Version:\s*(\S+)", out) if rc == 0 else None
    return found.group(1) if found else None


def torch_build(python: str, torch_version: str | None) -> dict | None:
    """CUDA, cuDNN and NCCL as `python`'s torch was built with them; None without torch. A CPU wheel
    (`+cpu`) is not imported: it has none of them."""
    if torch_version is None:
        return None
    if torch_version.endswith("+cpu"):
        return {"cuda": None, "hip": None, "cudnn": None, "nccl": None, "note": "CPU build (+cpu)"}
    rc, out = run([python, str(TORCH_BUILD)], IMPORT_TIMEOUT_S)
    try:
        if rc != 0:
            return {"error": f"exit {rc}: {last_line(out)}"}
        facts = json.loads(out.splitlines()[-1])
        return {field: facts[field] for field in BUILD_FIELDS}
    except (IndexError, KeyError, ValueError):
        return {"error": f"unreadable answer: {last_line(out)}"}


def interpreter_facts(python: str, modules: list[str]) -> dict:
    """What `python` holds: its Python, the versions of `modules` there (None: not installed) and its
    torch's build."""
    try:
        where = interpreter.facts(python, [*modules, "numpy"], versions=True)
    except interpreter.InterpreterError as exc:
        return {"error": str(exc)}
    versions = {m: v for m, v in where.versions.items()}
    return {
        "python_version": where.python_version,
        "prefix": where.prefix,
        "versions": versions,
        "torch_build": torch_build(python, versions.get("torch")),
    }


def distbench_version() -> str | None:
    try:
        return importlib.metadata.version("distbench")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that was never pip-installed
        return None


def os_facts() -> dict:
    try:
        distribution = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        distribution = None
    libc, libc_version = platform.libc_ver()
    return {
        "platform": platform.platform(),
        "distribution": distribution,
        "libc": f"{libc} {libc_version}".strip() or None,
    }


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5', as taskset and Slurm write CPU lists."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def cpu_facts() -> dict:
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "model": cpu_name().removeprefix("cpu: "),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "affinity": cpu_ranges(affinity) if affinity is not None else None,
        "usable": available_cpus(),
    }


def collect() -> dict:
    """Everything `harness env` shows. The interpreters, nvidia-smi and the tools are asked at once."""
    backends = all_backends()
    pythons: dict[str, tuple[str, str]] = {}  # backend -> (interpreter, where that choice came from)
    rows: dict[str, dict] = {}
    for b in backends:
        try:
            pythons[b.name] = interpreter.configured(b.name, b.framework)
        except interpreter.InterpreterError as exc:
            rows[b.name] = {"python": None, "python_source": interpreter.env_var(b.name), "error": str(exc)}
    modules: dict[str, list[str]] = {}
    for b in backends:
        if b.name in pythons:
            asked = modules.setdefault(pythons[b.name][0], [])
            asked += [m for m in b.requires if m not in asked]
    with ThreadPoolExecutor(max_workers=len(modules) + len(TOOLS) + 2) as pool:
        interpreters = {py: pool.submit(interpreter_facts, py, mods) for py, mods in modules.items()}
        tools = {name: pool.submit(tool_version, argv) for name, argv in TOOLS.items()}
        gpus = pool.submit(query_gpus, GPU_FIELDS)
        cuda = pool.submit(driver_cuda)
        interpreter_rows = {py: f.result() for py, f in interpreters.items()}
        tool_rows = {name: f.result() for name, f in tools.items()}
        gpu_rows, cuda_version = gpus.result(), cuda.result()
    for b in backends:
        if b.name not in pythons:
            continue
        python, source = pythons[b.name]
        ok, reason = b.availability(python)
        versions = interpreter_rows[python].get("versions", {})
        rows[b.name] = {
            "python": python,
            "python_source": source,
            "available": ok,
            "reason": reason or None,
            "versions": {m: versions.get(m) for m in b.requires},
            # an adapter's launcher ships with the last module it requires: torchrun with torch, the
            # deepspeed launcher with DeepSpeed, horovodrun with Horovod, paddle.distributed.launch with
            # Paddle (TensorFlow's workers are started by the harness, with TF_CONFIG)
            "launcher": {"name": b.launcher, "from": b.requires[-1], "version": versions.get(b.requires[-1])},
            "install": None if ok else install_command(b, python),
        }
    memory = psutil.virtual_memory()
    return {
        "distbench": {"version": distbench_version(), "root": str(REPO_ROOT), **git_commit()},
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "os": os_facts(),
        "cpu": cpu_facts(),
        "memory": {"total_bytes": memory.total, "available_bytes": memory.available},
        "gpus": gpu_rows,
        "cuda": {
            "driver_supports": cuda_version,
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
        "tools": tool_rows,
        "interpreters": interpreter_rows,
        "backends": rows,
    }


# ------------------------------------------------------------------------------------------------ display
def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def text_lines(env: dict) -> list[str]:
    """`harness env`'s text: one line per fact, backends and interpreters one line each."""
    d, cpu, cuda = env["distbench"], env["cpu"], env["cuda"]
    commit = (d["commit"] or "unknown")[:12] + (" (uncommitted changes)" if d["dirty"] else "")
    lines = [
        f"distbench     {d['version'] or 'not pip-installed'}, commit {commit}, {d['root']}",
        f"python        {env['python']['version']} ({env['python']['implementation']}, "
        f"{env['python']['executable']})",
        f"os            {env['os']['platform']}"
        + "".join(f"; {env['os'][k]}" for k in ("distribution", "libc") if env["os"][k]),
        f"cpu           {cpu['model']}; {cpu['logical_cores']} logical, {cpu['physical_cores']} physical "
        f"cores; affinity {cpu['affinity']}; {cpu['usable']} usable",
        f"memory        {gib(env['memory']['total_bytes'])} total, {gib(env['memory']['available_bytes'])} "
        "available",
    ]
    gpus = env["gpus"]
    lines.append(
        "gpus          "
        + (
            "; ".join(f"{g['name']} ({g['memory.total']}, driver {g['driver_version']})" for g in gpus)
            if gpus
            else "none (nvidia-smi lists no GPU)"
        )
    )
    mask = cuda["CUDA_VISIBLE_DEVICES"]
    lines.append(
        f"cuda          driver supports {cuda['driver_supports'] or '-'}; "
        f"CUDA_VISIBLE_DEVICES={'(unset)' if mask is None else mask}"
    )
    lines.append("tools         " + "; ".join(f"{k}: {v or 'not found'}" for k, v in env["tools"].items()))
    lines.append("interpreters")
    for python, facts in env["interpreters"].items():
        if "error" in facts:
            lines.append(f"  {python}: {facts['error']}")
            continue
        installed = ", ".join(f"{m} {v}" for m, v in facts["versions"].items() if v) or "no framework"
        build = facts["torch_build"]
        if build is None:
            torch_text = ""
        elif "error" in build:
            torch_text = f"; torch's build: {build['error']}"
        elif build.get("cuda") or build.get("hip"):
            kind = f"CUDA {build['cuda']}" if build.get("cuda") else f"ROCm {build['hip']}"
            torch_text = f"; torch built with {kind}, cuDNN {build['cudnn']}, NCCL {build['nccl']}"
        else:
            torch_text = f"; torch: {build.get('note') or 'no CUDA'}"
        lines.append(f"  {python} (Python {facts['python_version']}): {installed}{torch_text}")
    lines.append("backends")
    width = max(map(len, env["backends"]), default=0)
    for name, row in env["backends"].items():
        if row.get("error"):
            lines.append(f"  {name:<{width}}  no: {row['error']}")
            continue
        launcher = row["launcher"]
        version = f" ({launcher['from']} {launcher['version']})" if launcher["version"] else ""
        if row["available"]:
            state = "yes: " + ", ".join(f"{m} {v}" for m, v in row["versions"].items())
        else:
            state = f"no: {row['reason']}" + (f"; add it: {row['install']}" if row["install"] else "")
        lines.append(
            f"  {name:<{width}}  {state}; launcher {launcher['name']}{version}; python {row['python_source']}"
        )
    return lines


def cmd_env(args) -> int:
    env = collect()
    print(json.dumps(env, indent=2) if args.json else "\n".join(text_lines(env)))
    return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "env", help="versions, devices and launchers for a bug report (every backend's interpreter asked)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=cmd_env)
