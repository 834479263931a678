"""`harness doctor`: the checks an experienced engineer runs before a big job, each shown with the command
it ran, what it expected and what it got; exit 1 if any fails.

Frameworks are imported each in its own subprocess, with the interpreter its backend's workers run under
(backends.interpreter; two frameworks in one process can crash, and the harness imports none); the
collective check is a real 2-process all_reduce through torchrun, over gloo, and NCCL when GPUs
are visible; `--gpu` adds the driver, CUDA runtime and NCCL versions and a traced NCCL all_reduce over
every local GPU, one included (the GPU acceptance tier runs it: tests/test_gpu_tier.py). For a multi-node
plan, run it on every node with the same --hosts/--master.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from backends import all_backends, backend_names, get_backend, interpreter
from backends.base import NETWORK_SETTINGS, Check, network_settings
from core.config import DEVICES, BatchConfig
from core.process import REPO_ROOT, free_port
from harness.arguments import Layout, add_flags, add_layout_arguments
from harness.run.devices import gpu_query, query_gpus, visible_gpus
from harness.usage import EXIT_FAILED, EXIT_OK, choice
from workloads.data import Shard, make_source, micro_batches, token_dtype
from workloads.spec import PRESETS

MIN_FREE_BYTES = 1 << 30  # results are small, but logs and weight dumps are not
IMPORT_TIMEOUT_S = 180
COLLECTIVE_TIMEOUT_S = 120
CONNECT_TIMEOUT_S = 3.0
PROBE = REPO_ROOT / "backends" / "allreduce_probe.py"
TORCH_BUILD = REPO_ROOT / "backends" / "torch_build.py"  # torch's CUDA, cuDNN, NCCL and the driver's CUDA


def run(argv: list[str], timeout: float) -> tuple[int | None, str]:
    try:
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO_ROOT,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout:.0f} s"
    except OSError as exc:
        return None, str(exc)
    return out.returncode, (out.stdout + out.stderr).strip()


def last_line(text: str) -> str:
    return text.splitlines()[-1] if text else ""


# ----------------------------------------------------------------------------------------------- checks
def framework_name(module: str, python: str | None) -> str:
    """The check's name: the module, and the interpreter where it is not the harness's own."""
    return f"framework {module}" + ("" if interpreter.is_this_one(python) else f" ({python})")


def import_check(module: str, required: bool, python: str | None = None) -> Check:
    """Import `module` with `python` (None: the harness's interpreter), the one its backend's workers use."""
    code = f'import {module} as m; print("version", getattr(m, "__version__", "unknown"))'
    rc, out = run([python or sys.executable, "-c", code], IMPORT_TIMEOUT_S)
    version = next((line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("version ")), None)
    ok = rc == 0 and version is not None
    return Check(
        framework_name(module, python),
        f"{'python' if interpreter.is_this_one(python) else python} -c {shlex.quote(code)}",
        "imports and prints its version",
        version if ok and version is not None else f"exit {rc}: {last_line(out)}",
        "ok" if ok else ("FAIL" if required else "warn"),
    )


def device_check(device: str, per_node: int) -> Check:
    gpus = visible_gpus()
    want_gpus = device == "cuda"
    got = f"{len(gpus)} GPU(s): {', '.join(gpus)}" if gpus else "no GPU visible (runs use CPU workers)"
    if want_gpus:
        ok = len(gpus) >= per_node
        expected = f">= {per_node} GPU(s) for {per_node} rank(s) on this node"
    else:
        ok, expected = (
            True,
            f"{'CPU workers' if device == 'cpu' else 'any (auto: GPUs if visible, else CPU)'}",
        )
    return Check("devices", shlex.join(gpu_query(("name",))), expected, got, "ok" if ok else "FAIL")


def collective_check(backend: str, n: int = 2, python: str | None = None, trace: bool = False) -> Check:
    """A real all_reduce over `backend` among `n` torchrun processes; with `trace`, also one all_reduce of
    known size under torch's profiler, read by the runs' own trace reader (backends.allreduce_probe)."""
    port = free_port()
    argv = [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={n}",
        "--nnodes=1",
        f"--master-port={port}",
        str(PROBE),
        backend,
        *(["--trace"] if trace else []),
    ]
    rc, out = run(argv, COLLECTIVE_TIMEOUT_S)
    sums = dict(re.findall(r"rank (\d+): all_reduce sum (\S+)", out))  # the ranks' lines may interleave
    ok = rc == 0 and len(sums) == n and set(sums.values()) == {f"{n * (n + 1) // 2}"}
    got = (
        f"all_reduce sum {', '.join(sorted(set(sums.values())))} on {len(sums)} rank(s)"
        if sums
        else last_line(out)
    )
    expected = f"every rank gets the sum {n * (n + 1) // 2}"
    if trace:
        traced = re.findall(r"rank \d+: (traced all_reduce .*?) \(expected (.*?)\)", out)
        expected += f"; its profiler traces {traced[0][1] if traced else 'the call'}"
        got += "; " + (", ".join(sorted({t for t, _ in traced})) if traced else "no traced call reported")
    name = f"collective ({backend}, {n} rank{'s' if n > 1 else ''})" if trace else f"collective ({backend})"
    return Check(
        name,
        shlex.join([argv[0] if python else "python", *argv[1:]]).replace(str(REPO_ROOT) + "/", ""),
        expected,
        got if ok else f"exit {rc}: {got}",
        "ok" if ok else "FAIL",
    )


def version_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or ""))


def cuda_versions_check(python: str | None) -> Check:
    """The GPU driver, the CUDA runtime torch was built for and the NCCL it loads: a driver that supports
    an older CUDA than the runtime leaves torch without a GPU (or fails at the first kernel), and an NCCL
    that does not load leaves the runs without their collectives; both are cheaper to find here."""
    driver = ", ".join(sorted({g["driver_version"] for g in query_gpus(("driver_version",))})) or "none"
    argv = [python or sys.executable, str(TORCH_BUILD)]
    rc, out = run(argv, IMPORT_TIMEOUT_S)
    command = "nvidia-smi --query-gpu=driver_version; python backends/torch_build.py"
    expected = "torch sees CUDA; the driver's CUDA >= torch's CUDA runtime; NCCL loads"
    try:
        found = json.loads(last_line(out)) if rc == 0 else None
    except ValueError:
        found = None
    if not found:
        return Check("cuda versions", command, expected, f"exit {rc}: {last_line(out)}", "FAIL")
    got = (
        f"driver {driver} (CUDA {found['driver_cuda']}), torch {found['torch']} with CUDA runtime "
        f"{found['cuda']}, NCCL {found['nccl']}"
    )
    problems = []
    if not found["cuda_available"]:
        problems.append("torch.cuda.is_available() is False")
    if found["cuda"] is None:
        problems.append("torch is a CPU build")
    elif found["driver_cuda"] is None:
        problems.append("libcuda.so.1 does not load")
    elif version_tuple(found["driver_cuda"])[:2] < version_tuple(found["cuda"])[:2]:
        problems.append(f"the driver supports CUDA {found['driver_cuda']}, older than the runtime")
    if found["cuda"] is not None and not str(found["nccl"] or "").split(".")[0].isdigit():
        problems.append(f"NCCL does not load ({found['nccl']})")
    return Check(
        "cuda versions",
        command,
        expected,
        got + ("; " + "; ".join(problems) if problems else ""),
        "FAIL" if problems else "ok",
    )


def port_check(port: int | None) -> Check:
    if port is None:
        port = free_port()
        return Check(
            "ports",
            "bind 127.0.0.1:0",
            "the OS hands out a free port (one is chosen per run)",
            f"port {port}",
            "ok",
        )
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
        return Check(
            "ports",
            f"bind 0.0.0.0:{port}",
            f"master port {port} free (needed on the master node)",
            "free",
            "ok",
        )
    except OSError as exc:
        return Check(
            "ports",
            f"bind 0.0.0.0:{port}",
            f"master port {port} free (needed on the master node)",
            f"in use: {exc.strerror}",
            "FAIL",
        )


def reachable(host: str, port: int = 22) -> tuple[bool, str]:
    """Resolvable, and answering TCP (an accepted or refused connection both prove the host is up)."""
    try:
        addr = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])  # an IPv4/IPv6 address
    except socket.gaierror as exc:
        return False, f"cannot resolve: {exc.strerror}"
    try:
        with socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT_S):
            return True, f"{addr}, port {port} open"
    except ConnectionRefusedError:
        return True, f"{addr}, answers (port {port} closed)"
    except OSError as exc:
        reason = (
            "timed out" if isinstance(exc, TimeoutError) or exc.errno == errno.ETIMEDOUT else exc.strerror
        )
        return False, f"{addr}: {reason}"


def hosts_check(hosts: list[str]) -> list[Check]:
    checks = []
    for host in dict.fromkeys(hosts):
        ok, got = reachable(host)
        checks.append(
            Check(
                f"host {host}",
                f"getaddrinfo {host}; tcp connect {host}:22",
                "resolves and answers",
                got,
                "ok" if ok else "FAIL",
            )
        )
    return checks


def data_check(path: Path | None, workload: str, world: int, micro_batch: int, grad_accum: int) -> Check:
    """The token file the ranks will read: readable, long enough for one global batch, and every token of
    the first step's batches (read as each rank reads them) a valid id for the workload's vocabulary.
    Synthetic tokens are generated by each rank from the seed: there is nothing here to read."""
    if path is None:
        return Check("data", "-", "a token file (--data)", "synthetic tokens: nothing to read here", "ok")
    spec = PRESETS[workload]
    global_batch = world * micro_batch * grad_accum
    command = f"workloads.data.TokenFile({path}), step 0 of every rank's shard"
    expected = (
        f">= {global_batch * (spec.seq_len + 1):,} {token_dtype(spec.vocab_size)} tokens (one global batch), "
        f"ids < {spec.vocab_size:,} ({workload})"
    )
    try:
        source = make_source(spec.vocab_size, spec.seq_len, global_batch, path=str(path))
        for rank in range(world):
            micro_batches(source, Shard(rank, world, micro_batch, grad_accum), 0)
    except (OSError, ValueError) as exc:
        return Check("data", command, expected, f"{type(exc).__name__}: {exc}", "FAIL")
    n = len(source.tokens)
    enough = n >= global_batch * (spec.seq_len + 1)
    got = f"{n:,} tokens" + ("" if enough else ": the first step already wraps around the file")
    return Check("data", command, expected, got, "ok" if enough else "warn")


def disk_check(out: Path) -> Check:
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    writable = os.access(probe, os.W_OK)
    ok = free >= MIN_FREE_BYTES and writable
    return Check(
        "disk for results",
        f"statvfs {probe}",
        f">= {MIN_FREE_BYTES >> 30} GiB free, writable",
        f"{free / (1 << 30):.1f} GiB free, {'writable' if writable else 'NOT writable'}",
        "ok" if ok else "FAIL",
    )


IFF_LOOPBACK = 0x8  # in /sys/class/net/<interface>/flags
NET_DIR = Path("/sys/class/net")


def ipv4_interfaces(net_dir: Path = NET_DIR, addrs: dict | None = None) -> dict[str, list[str]]:
    """This node's network interfaces that NCCL or Gloo could open sockets on: an IPv4 address
    (psutil.net_if_addrs), not the loopback and not down (/sys/class/net/<interface>/flags, operstate)."""
    addrs = psutil.net_if_addrs() if addrs is None else addrs
    found = {}
    for name, entries in sorted(addrs.items()):
        ipv4 = [a.address for a in entries if a.family == socket.AF_INET]
        try:
            loopback = int((net_dir / name / "flags").read_text(), 16) & IFF_LOOPBACK
            down = (net_dir / name / "operstate").read_text().strip() == "down"
        except (OSError, ValueError):  # not listed there (another namespace's view): judged by its name
            loopback, down = name == "lo", False
        if ipv4 and not loopback and not down:
            found[name] = ipv4
    return found


def interface_check(interfaces: dict[str, list[str]], environ) -> Check | None:
    """On a multi-homed node (two or more interfaces in `interfaces`), NCCL and Gloo each pick the interface
    their sockets use by their own rules unless NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME say which: ranks
    that end up on one the other nodes cannot reach (or a slow management network) hang or crawl. None on a
    node with one interface: there is nothing to choose."""
    if len(interfaces) < 2:
        return None
    listed = ", ".join(f"{name} {'/'.join(ips)}" for name, ips in interfaces.items())
    chosen = network_settings(environ)
    got = f"{len(interfaces)} interfaces with IPv4 ({listed}); " + (
        ", ".join(f"{k}={v}" for k, v in chosen.items())
        if chosen
        else f"neither {' nor '.join(NETWORK_SETTINGS)} is set: NCCL and Gloo may each pick one the other "
        "nodes cannot reach; export both with the job network's interface (e.g. NCCL_SOCKET_IFNAME=ib0)"
    )
    return Check(
        "network interfaces",
        "psutil.net_if_addrs(); /sys/class/net/*/{flags,operstate}",
        f"{' or '.join(NETWORK_SETTINGS)} set on a node with several interfaces",
        got,
        "ok" if chosen else "warn",
    )


# ------------------------------------------------------------------------------------------------ command
def selected(text: str | None) -> tuple[list, bool]:
    """The backends to check, and whether the user named them (then a missing framework fails)."""
    if not text or text.strip() == "all":
        return all_backends(), False
    names = [choice(n.strip(), backend_names(), "backend") for n in text.split(",") if n.strip()]
    return [get_backend(n) for n in dict.fromkeys(names)], True


def cmd_doctor(args) -> int:
    backends, named = selected(args.backends)
    choice(args.workload, list(PRESETS), "workload")
    choice(args.device, DEVICES, "device")
    given = Layout.read(args)
    world = given.world(args.gpus)
    layout = given.settings(world, node_rank=args.node_rank or 0)
    per_node = world // layout["nodes"]
    device = args.device
    if args.gpu:  # the node's GPUs are the point: no GPU visible fails the device check
        device = "cuda"
    elif device == "auto":
        device = "cuda" if visible_gpus() else "cpu"

    pythons, checks = {}, []
    for b in backends:  # each backend's workers' interpreter: its imports are checked there
        try:
            pythons[b.name] = interpreter.configured(b.name, b.framework)[0]
        except interpreter.InterpreterError as exc:
            var = interpreter.env_var(b.name)
            checks.append(Check(f"python of {b.name}", f"test -x ${var}", "an interpreter", str(exc), "FAIL"))
    modules = list(
        dict.fromkeys((m, pythons[b.name]) for b in backends if b.name in pythons for m in b.requires)
    )
    required = {(m, pythons[b.name]) for b in backends if named and b.name in pythons for m in b.requires}
    with ThreadPoolExecutor(max_workers=len(modules) or 1) as pool:  # one subprocess per framework, at once
        checks += list(pool.map(lambda mp: import_check(mp[0], mp in required, mp[1]), modules))
    checks.append(device_check(device, per_node))
    for b in backends:  # what each stack checks of its own
        checks += b.doctor_checks(pythons.get(b.name), named)
    torch_python = next(
        (pythons[b.name] for b in backends if b.framework == "torch" and b.name in pythons), None
    )
    torch_python = None if interpreter.is_this_one(torch_python) else torch_python
    if any(c.name == framework_name("torch", torch_python) and c.status == "ok" for c in checks):
        checks.append(collective_check("gloo", python=torch_python))
        local_gpus = len(visible_gpus())
        if args.gpu and local_gpus:
            checks.append(cuda_versions_check(torch_python))
            checks.append(collective_check("nccl", n=local_gpus, python=torch_python, trace=True))
        elif device == "cuda" and local_gpus >= 2:
            checks.append(collective_check("nccl", python=torch_python))
    else:
        checks.append(
            Check("collective (gloo)", "-", "torch importable", "skipped: torch is not importable", "warn")
        )
    checks.append(port_check(layout["master_port"]))
    if interfaces := interface_check(ipv4_interfaces(), os.environ):
        checks.append(interfaces)
    hosts = layout["hosts"] or ([layout["master_addr"]] if layout["nodes"] > 1 else [])
    checks += hosts_check(hosts)
    micro, accum = args.micro_batch or BatchConfig.micro_batch, args.grad_accum or BatchConfig.grad_accum
    checks.append(data_check(Path(args.data) if args.data else None, args.workload, world, micro, accum))
    checks.append(disk_check(Path(args.out).resolve()))

    width = max(len(c.name) for c in checks)
    for c in checks:
        print(
            f"[{c.status:>4}] {c.name:<{width}}  ran: {c.command}\n"
            f"       {'':<{width}}  expected: {c.expected}; got: {c.got}"
        )
    failed = [c for c in checks if c.status == "FAIL"]
    print(
        f"doctor: {len(checks)} checks, {len(failed)} failed"
        + (f": {', '.join(c.name for c in failed)}" if failed else "")
    )
    return EXIT_FAILED if failed else EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="preflight checks before a big job (exit 1 if one fails)")
    add_flags(p, "--backends", "--gpus", "--device")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="this node's GPUs: driver, CUDA and NCCL versions, and a traced NCCL all_reduce over all of "
        "them (one GPU included)",
    )
    add_flags(p, "--workload", "--micro-batch", "--grad-accum", "--data", "--out")
    add_layout_arguments(p)
    p.set_defaults(func=cmd_doctor)
