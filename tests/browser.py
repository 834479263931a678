"""A headless Chromium for the tests that check a page as a browser draws it (the report's plots, the
history page), where one is installed; None elsewhere, and those tests skip."""

from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def headless(profile: Path) -> list[str]:
    """The browser's command line before its action (--screenshot, --dump-dom) and URL: no GPU, no first-run
    screens, a profile of its own. --no-sandbox: Chromium will not start as root otherwise, as a CI
    container runs it."""
    assert CHROMIUM is not None
    return [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
    ]
