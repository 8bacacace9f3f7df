"""A real browser runs a course notebook in JupyterLab and sees the widgets update live.

JupyterLab serves copies of the notebooks from a temporary root (Lab autosaves into
what it opens) on 127.0.0.1 with a token; Debian's ``chromium``, driven by Playwright
(``executable_path``: no browser download), opens a notebook, runs all cells, and
watches the timing dashboard change while training runs. A screenshot is saved to
``build/screenshots/``.

Without chromium or Playwright the test skips and says why; with
``PK_REQUIRE_BROWSER=1`` (set by ``.ci/run``) it fails instead, so CI cannot skip it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
NOTEBOOK = "01_mirrored.ipynb"
SCREENSHOTS = ROOT / "build" / "screenshots"

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} not found: install Debian's chromium (apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[dev]' (never `playwright install`)"
    return None


@pytest.fixture(scope="module")
def browser_ready():
    reason = _missing()
    if reason and os.environ.get("PK_REQUIRE_BROWSER") == "1":
        pytest.fail(f"PK_REQUIRE_BROWSER=1 but the browser test cannot run: {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(browser_ready, tmp_path_factory):
    """JupyterLab on 127.0.0.1 over copies of the notebooks; yields (base url, token)."""
    home = tmp_path_factory.mktemp("lab")
    root = home / "root"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    # Keep the "Jupyter news" toast away: it would cover the notebook.
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    port, token = _free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the notebook picks its own devices
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
    )
    log = (home / "lab.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
         "--ServerApp.allow_root=True", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{(home / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.3)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_notebook_widgets_update_live_in_chromium(lab):
    from playwright.sync_api import sync_playwright

    base, token = lab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                " && window.jupyterapp.shell.currentWidget.sessionContext"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
                " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                timeout=60_000,
            )
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")

            # The dashboard renders, then its step counter moves while training runs.
            steps = page.locator(".pk-dashboard .pk-steps .pk-value")
            steps.wait_for(timeout=120_000)
            seen, deadline = [], time.monotonic() + 120
            while time.monotonic() < deadline:
                seen.append(steps.inner_text())
                if "done" in page.locator(".pk-dashboard .pk-header").inner_text():
                    break
                time.sleep(0.05)
            values = sorted({int(v) for v in seen if v.strip().isdigit()})  # empty while a redraw is in flight
            assert values[-1] == 400, f"the dashboard stopped at step {values[-1]}"
            assert len([v for v in values if 0 < v < 400]) >= 2, f"no live updates seen, only {values}"
            median = page.locator(".pk-dashboard .pk-median .pk-value").inner_text()
            assert median.endswith(" ms") and float(median.split()[0]) > 0
            assert page.locator(".pk-dashboard .widget-hprogress").count() == 1
            assert page.locator(".pk-dashboard svg.pk-line polyline").get_attribute("points")

            # The gradient explorer and the last (proof) cell.
            proof = page.locator(".jp-OutputArea-output", has_text="PROOF Mirrored(pmap)")
            proof.wait_for(timeout=120_000)
            image = page.locator(".pk-gradsync img")
            assert image.count() == 1 and image.evaluate("img => img.naturalWidth") > 100
            first = image.get_attribute("src")
            slider = page.locator(".pk-layer-slider .noUi-handle, .pk-layer-slider .slider-handle").first
            slider.focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_function(
                "src => document.querySelector('.pk-gradsync img').src !== src", arg=first, timeout=30_000
            )
            assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                                has_text="Traceback").count() == 0  # fmt: skip

            page.locator(".pk-dashboard").scroll_into_view_if_needed()
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / "01_mirrored_dashboard.png"))
        finally:
            browser.close()
