"""What `harness run` (and sweep, plan, slurm, k8s and the gate) adds to the one path from arguments to a
RunConfig (harness.arguments): the devices of this machine, whether a run's ranks fit its memory
(harness.run.footprint), and the checks of where records go.

Everything is checked here, before anything launches: bad input is a UsageError (one line, exit 2).
"""

from __future__ import annotations

import errno
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from backends.base import Backend
from core.config import RunConfig
from harness.arguments import RunRequest
from harness.run.devices import resolve_device
from harness.run.footprint import check_fits
from harness.usage import UsageError


def run_request(args, backends: list[str] | None = None, fills: bool = False) -> RunRequest:
    """The command line of a run on this machine, read once (harness.arguments.RunRequest), its devices
    those visible here, each config's ranks checked against this node's memory (memory_check). `fills`:
    the verb chooses `--micro-batch max` itself (harness.run.fill)."""
    return RunRequest(
        args, backends, resolve_device=resolve_device, check_memory=memory_check(args), fills=fills
    )


def memory_check(args) -> Callable[[Backend, RunConfig], None] | None:
    """harness.run.footprint.check_fits for each config a command line builds, unless --skip-memory-check;
    a stack it cannot estimate for is said once, on stderr, and runs."""
    if getattr(args, "skip_memory_check", False):
        return None
    noted: set[str] = set()

    def check(backend: Backend, cfg: RunConfig) -> None:
        note = check_fits(backend, cfg)
        if note and backend.name not in noted:
            noted.add(backend.name)
            print(f"harness: note: {note}", file=sys.stderr)

    return check


def build_config(
    args, backend_name: str, n: int, *more, backends_in_use: list[str] | None = None, **kw
) -> RunConfig:
    """One config from a command line read for it alone: run_request(args).config(backend_name, n, ...),
    which a verb that builds several from one command line calls itself. `backends_in_use`: the backends a
    sweep runs, whose options may all be given (default: this one)."""
    names = backends_in_use or [backend_name]
    request = run_request(args, names if backend_name in names else [*names, backend_name])
    return request.config(backend_name, n, *more, **kw)


def check_out_dir(out: Path) -> None:
    """`--out` must be a folder this process can write records into: checked before anything launches,
    so a typo or a read-only mount is one line, not a traceback after the run."""
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out, prefix=".write-check.").close()
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write records there ({exc.strerror or exc})") from None


# Errors of a filesystem that no longer takes writes: full, over quota, read-only.
FILESYSTEM_FULL_OR_SHUT = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def os_error_line(exc: OSError, out: Path) -> str:
    """One line for an OSError that ended a run: one on a path under the results folder (full, read-only,
    over quota) names the folder; any other (a launcher that cannot start, a pipe) says what it was."""
    what = exc.strerror or str(exc)
    where = Path(exc.filename).resolve() if exc.filename else None
    root = Path(out).resolve()
    under_out = where is not None and (where == root or root in where.parents)
    if under_out or (where is None and exc.errno in FILESYSTEM_FULL_OR_SHUT):
        return f"harness: error: cannot write under {out}: {what}"
    return f"harness: error: {what}" + (f": {exc.filename}" if exc.filename else "")
