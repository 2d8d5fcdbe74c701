"""Debian's chromium driven by playwright, for the browser tests and the screenshot script.

The browser is the system's (`/usr/bin/chromium`, Debian package `chromium`); playwright never
downloads one. Every launch gets a fresh profile directory and no network chatter of its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

CHROMIUM = os.environ.get("FREETOKEN_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def chromium_context(**context_args) -> Iterator:
    """A playwright browser context on the system chromium with a throwaway profile."""
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        raise FileNotFoundError(f"no chromium at {CHROMIUM}: install Debian's `chromium` package")
    os.environ["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] = "1"
    profile = tempfile.mkdtemp(prefix="freetoken-chromium-")
    try:
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                profile, executable_path=CHROMIUM, headless=True, args=ARGS, **context_args
            )
            try:
                yield context
            finally:
                context.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
