"""Debian's Chromium, headless, driven by Playwright (no browser download: the machine has no internet).

``python -m tests.dashboard.browser RUN_DIR OUT.png`` saves a screenshot of a run's dashboard (the README's).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
INSTALL_HINT = "install it with `make browser` (runs `apt-get install -y chromium`; `make test` does it)"


def chromium_path() -> Path:
    """The system Chromium; an AssertionError that says how to install it when it is missing."""
    found = CHROMIUM if CHROMIUM.is_file() else None
    assert found is not None, f"Debian's chromium is not at {CHROMIUM}: {INSTALL_HINT}"
    return found


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A Playwright page in headless Chromium."""
    try:
        from playwright.sync_api import sync_playwright  # deferred: only the browser tests need it
    except ImportError as exc:
        raise AssertionError(
            "playwright is not installed: `make setup` installs the test extra (pip install -e '.[test]')"
        ) from exc
    executable = chromium_path()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(executable), args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            yield page
        finally:
            browser.close()


def wait_for_view(page: Any, view: str) -> None:
    """Wait until the page has rendered ``view`` (``main#view[data-view=...]``)."""
    page.wait_for_selector(f"main#view[data-ready='true'][data-view='{view}']", timeout=30_000)


def save_screenshot(run_dir: Path, out: Path) -> None:
    from miles_core.builtin.dashboard.server import DashboardServer

    server = DashboardServer(run_dir).start()
    try:
        with browser_page(width=1400, height=1100) as page:
            page.goto(server.url)
            wait_for_view(page, "overview")
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
    finally:
        server.stop()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.dashboard.browser RUN_DIR OUT.png")
    save_screenshot(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"saved {sys.argv[2]}")
