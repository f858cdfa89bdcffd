"""The documentation site: built with ``mkdocs build --strict``, served from 127.0.0.1 and opened in a real headless
Chromium (Debian's, driven by Playwright, as the dashboard's browser test does). The reference pages are generated
from the code: the CLI flags page lists exactly the config flags of ``miles train --help``, the hooks page every
hookspec, the plugin API page every public name of ``miles_core``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

import miles_core
from miles_core import hookspecs
from tests.conftest import MILES, REPO
from tests.dashboard.browser import browser_page

pytestmark = pytest.mark.slow  # builds the site, then Chromium
COMMAND_OPTIONS = {"--help", "--config", "--no-progress", "--plugin"}
"""Options of ``miles train`` that are not config flags (the CLI page shows them with the commands)."""
OPTION_LINE = re.compile(r"^  (-\S.*?)(?:\s{2,}|$)")
"""An option's line in argparse's help: two spaces, its flags and metavars, then (after two spaces or more) its help."""


def train_config_flags() -> set[str]:
    """The config flags that ``miles train --help`` lists: the options of its lines that start with one (flags named
    inside a help text are not counted)."""
    result = subprocess.run([str(MILES), "train", "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    invocations = [match.group(1) for line in result.stdout.splitlines() if (match := OPTION_LINE.match(line))]
    return {flag for text in invocations for flag in re.findall(r"--[a-z][a-z0-9-]*", text)} - COMMAND_OPTIONS


def heading(text: str) -> str:
    """A heading's text without its permalink sign and code marks."""
    return text.removesuffix("¶").strip().strip("`")


def test_front_page_and_its_navigation_in_chromium(site_url: str) -> None:
    with browser_page() as page:
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(site_url)
        assert heading(page.inner_text("article h1")) == "Miles"
        commands = page.locator("article pre code").first.inner_text()
        assert "make run" in commands and "make test" in commands  # the two fresh-machine commands
        hrefs = page.eval_on_selector_all("nav.md-nav--primary a.md-nav__link[href]", "links => links.map(a => a.href)")
        pages = {url.split("#")[0] for url in hrefs if urlsplit(url).netloc == urlsplit(site_url).netloc}
        sections = {"getting-started", "concepts", "how-to", "reference", "benchmarks"}
        assert sections <= {urlsplit(url).path.strip("/").split("/")[0] for url in pages}, sorted(pages)
        for url in sorted(pages):
            response = httpx.get(url, timeout=30)
            assert response.status_code == 200, url
            assert "<article" in response.text, url  # a page of the site, not a directory listing
        page.click("nav.md-nav--primary a.md-nav__link:has-text('Command-line flags')")
        page.wait_for_url(urljoin(site_url, "reference/cli-flags/"))
        assert heading(page.inner_text("article h1")) == "Command-line flags"
        assert errors == []


def test_cli_flags_page_lists_every_flag_of_miles_train(site_url: str) -> None:
    with browser_page() as page:
        page.goto(urljoin(site_url, "reference/cli-flags/"))
        headings = page.locator("article h2").all_inner_texts()
        assert {"run", "rollout", "train", "engine", "weight_transfer", "megatron", "sglang"} <= {
            heading(text) for text in headings
        }, headings
        first_cells = page.locator("article table tbody tr td:first-child").all_inner_texts()
        listed = {word for cell in first_cells for word in cell.split() if word.startswith("--")}  # not metavars
        assert "--rollout-batch-size" in listed and "--num-steps" in listed and "--run-num-steps" in listed
        assert listed == train_config_flags()
        row = page.locator("article table tbody tr", has=page.locator("td:first-child", has_text="--rollout-top-p"))
        assert row.locator("td").all_inner_texts()[1] == "float (> 0.0, <= 1.0), default 1.0"  # from the pydantic field


def test_reference_pages_are_generated_from_the_code(built_site: Path) -> None:
    assert not (REPO / "docs" / "reference" / "cli-flags.md").exists()  # generated while the site builds
    hooks_html = (built_site / "reference" / "hooks" / "index.html").read_text()
    specs = [name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), f"{hookspecs.PROJECT_NAME}_spec")]
    assert len(specs) >= 25 and "provide_training_backends" in specs
    missing = [name for name in specs if f'id="miles_core.hookspecs.{name}"' not in hooks_html]
    assert missing == []
    api_html = (built_site / "reference" / "plugin-api" / "index.html").read_text()
    public = [name for name in miles_core.__all__ if not name.startswith("__")]
    assert [name for name in public if f'id="miles_core.{name}"' not in api_html] == []
    assert ":class:" not in hooks_html + api_html  # Sphinx roles rendered as code (tools/docs/griffe_sphinx_roles.py)
