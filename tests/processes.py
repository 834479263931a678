"""Is anything still running? The fault and multi-node tests assert that no process outlives its run."""

from __future__ import annotations

import time

import psutil


def leftovers(path, wait_s: float = 0.0) -> list[str]:
    """Command lines of processes that name `path` (a run dir or results dir), after up to `wait_s` seconds
    for them to go (a launcher being torn down needs a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(path) in arg for arg in (p.info["cmdline"] or [])):
                    found.append(" ".join(p.info["cmdline"]))
            except psutil.Error:
                pass
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)
