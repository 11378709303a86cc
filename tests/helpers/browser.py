"""A real browser for the profile page's tests: headless Chromium from the system's packages (Debian's chromium,
which tools/setup_env.sh installs where it can), driven by Playwright's Python package pointed at it. Where either is
missing, the tests skip with one line that says which and how to get it.

    with opened(path) as page:      # the page loaded from disk, its console errors and network requests recorded
        page.evaluate("window.profilePage.ready")
"""
import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import List

import pytest

# As a machine with no network needs it: no background connections, no first-run work, a fresh profile.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium_path() -> str:
    """The system's Chromium ($CHROMIUM, else chromium on the PATH), or a skip saying how to get it."""
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no Chromium: apt-get install chromium (tools/setup_env.sh does where it runs as root), or set "
                    "$CHROMIUM to a Chromium binary")
    return path


@dataclass
class OpenedPage:
    page: object  # playwright's Page
    load_s: float  # from navigation to the page's script done
    console_errors: List[str] = field(default_factory=list)
    requests: List[str] = field(default_factory=list)  # every request that left the file


@contextlib.contextmanager
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("no Playwright: pip install playwright (the 'test' extra)")
    executable = chromium_path()
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


@contextlib.contextmanager
def opened(instance, path, width=1400):
    """The page at `path` in a new tab of `instance`, loaded and drawn."""
    page = instance.new_page(viewport={"width": width, "height": 900})
    result = OpenedPage(page, 0.0)
    page.on("console", lambda message: result.console_errors.append(message.text)
            if message.type == "error" else None)
    page.on("pageerror", lambda error: result.console_errors.append(str(error)))
    page.on("request", lambda request: result.requests.append(request.url)
            if not request.url.startswith(("file:", "data:", "blob:")) else None)
    start = time.perf_counter()
    page.goto(f"file://{os.path.abspath(path)}")
    page.wait_for_function("window.profilePage && window.profilePage.ready")
    result.load_s = time.perf_counter() - start
    try:
        yield result
    finally:
        page.close()
