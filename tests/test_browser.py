"""A real browser runs course notebooks in JupyterLab and sees the widgets update live.

JupyterLab serves copies of the notebooks from a temporary root (Lab autosaves into
what it opens) on 127.0.0.1 with a token; Debian's ``chromium``, driven by Playwright
(``executable_path``: no browser download), opens a notebook, runs all cells, and
watches its widgets change while training runs: the timing dashboard (in a notebook of
its own, written here: a run long enough to watch), 01's gradient explorer, 13's strategy
race. Screenshots are saved to ``build/screenshots/``.

Without chromium or Playwright the test skips and says why; with
``PK_REQUIRE_BROWSER=1`` (set by ``.ci/run``) it fails instead, so CI cannot skip it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from helpers import CHROMIUM, CHROMIUM_ARGS

ROOT = Path(__file__).resolve().parents[1]
MIRRORED, LAB, LIVE = "01_mirrored.ipynb", "13_strategy_lab.ipynb", "live_dashboard.ipynb"
LIVE_STEPS = 400  # steps of the live-dashboard run: long enough to watch it update
LIVE_CELLS = (  # the dashboard's notebook: the course's setup, then one run with the dashboard (docs/views.md)
    'import parallelkit as pk\n\ndevices = pk.lesson.setup(8, batch=64, model="mlp")',
    "import optax\n\nimport parallelkit.viz\n\n"
    "dataset = pk.data.digits()\n"
    'apply, params = pk.models.build("mlp", dataset.input_shape, dataset.num_classes)\n'
    'dashboard = pk.viz.TimingDashboard(batch_size=64, title="live")\n'
    "pk.fit(pk.Mirrored(), pk.models.classifier_loss(apply), params, optax.adam(1e-3),\n"
    f"       pk.data.batches(dataset, 64, steps={LIVE_STEPS}), steps={LIVE_STEPS}, callbacks=[dashboard])\n"
    'print(f"{dashboard.redraws} redraws")',
)
SCREENSHOTS = ROOT / "build" / "screenshots"
RACE_ROWS = "() => [...document.querySelectorAll('.pk-race .pk-race-row')].map(r => Number(r.dataset.steps))"
# Every widget update the browser receives, in order. Lab handles kernel messages one after
# another and the first widget waits for the widget code to load, so a view can jump from
# nothing to the last value; the received updates still show each value the kernel sent.
RECORD_UPDATES = """() => {
    window.pkUpdates = [];
    const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
    kernel.iopubMessage.connect((_, msg) => {
        const data = msg.header.msg_type === 'comm_msg' ? msg.content.data : null;
        const value = data && data.method === 'update' && data.state ? data.state.value : null;
        if (typeof value === 'string' && value.includes('pk-')) window.pkUpdates.push(value);
    });
}"""
DASHBOARD_STEP = re.compile(r"step <b class='pk-value'>(\d+)</b>")
RACE_ROW_STEPS = re.compile(r"class='pk-race-row' data-name='[^']*' data-steps='(\d+)'")

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


def _setting(notebook: str, name: str) -> int:
    """An integer from a notebook's settings cell, e.g. ``LIVE_STEPS = 400``."""
    source = (ROOT / "notebooks" / notebook).read_text()
    return int(re.search(rf"\b{name} = (\d+)", source).group(1))


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
    kernel = nbformat.read(root / MIRRORED, as_version=4).metadata  # its kernel, so Lab asks for none
    live = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in LIVE_CELLS], metadata=kernel)
    nbformat.write(live, root / LIVE)
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    notebook_settings = home / "settings" / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True)
    # Keep every cell attached and rendered: by default Lab skips rendering cells outside the
    # viewport, and run-all scrolls away from the widgets this test reads.
    (notebook_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
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


def _screenshot(page, selector: str, name: str) -> None:
    """Keep a picture of the view ``selector`` finds, scrolled into sight, as ``SCREENSHOTS / name``."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(selector).scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOTS / name))


def _run_all(page, base: str, token: str, notebook: str) -> None:
    """Open ``notebook`` in Lab, wait for its kernel, record widget updates, and run every cell."""
    page.goto(f"{base}/lab/tree/{notebook}?token={token}")
    # a cell of the notebook in front: a tab restored from an earlier test keeps its cells, hidden, in the page
    page.wait_for_selector(".jp-Notebook .jp-Cell >> visible=true", timeout=60_000)
    # Lab restores the tabs a previous test opened: wait until the tab in front is this notebook's, or
    # run-all would run the other one.
    page.wait_for_function(
        "name => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " return w && w.context && w.context.path === name && w.sessionContext && w.sessionContext.session"
        " && w.sessionContext.session.kernel && w.sessionContext.session.kernel.status === 'idle'; }",
        arg=notebook,
        timeout=60_000,
    )
    page.evaluate(RECORD_UPDATES)
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")


def _no_traceback(page) -> None:
    assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                        has_text="Traceback").count() == 0  # fmt: skip


@contextlib.contextmanager
def _browser_page(name: str):
    """A Chromium page; on failure, a screenshot of what it showed (``build/screenshots/{name}_failure.png``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            yield page
        except Exception:
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOTS / f"{name}_failure.png"))
            raise
        finally:
            browser.close()


def test_timing_dashboard_updates_live_in_chromium(lab):
    base, token = lab
    with _browser_page("live_dashboard") as page:
        _run_all(page, base, token, LIVE)

        # The dashboard renders and ends at the last step; on the way, the browser received
        # the step counter's intermediate values, in order, while training ran.
        page.wait_for_function(
            "() => (document.querySelector('.pk-dashboard .pk-header')?.textContent || '').includes('done')",
            timeout=180_000,
        )
        shown = page.locator(".pk-dashboard .pk-steps .pk-value").text_content()
        assert shown == str(LIVE_STEPS), f"the dashboard shows step {shown!r}"
        received = [int(m) for u in page.evaluate("() => window.pkUpdates") for m in DASHBOARD_STEP.findall(u)]
        assert received == sorted(received) and received[-1] == LIVE_STEPS, f"updates out of order: {received}"
        assert len({v for v in received if 0 < v < LIVE_STEPS}) >= 2, f"no live updates received: {received}"
        median = page.locator(".pk-dashboard .pk-median .pk-value").text_content()
        assert median.endswith(" ms") and float(median.split()[0]) > 0
        assert page.locator(".pk-dashboard .widget-hprogress").count() == 1
        assert page.locator(".pk-dashboard svg.pk-line polyline").get_attribute("points")
        page.locator(".jp-OutputArea-output", has_text="redraws").wait_for(timeout=60_000)
        _no_traceback(page)
        _screenshot(page, ".pk-dashboard", "timing_dashboard.png")


def test_gradient_explorer_updates_in_chromium(lab):
    base, token = lab
    with _browser_page("01_mirrored") as page:
        _run_all(page, base, token, MIRRORED)

        # The gradient explorer and the last (proof) cell.
        proof = page.locator(".jp-OutputArea-output", has_text="PROOF Mirrored(pmap)")
        proof.wait_for(timeout=180_000)
        image = page.locator(".pk-gradsync img")
        assert image.count() == 1 and image.evaluate("img => img.naturalWidth") > 100
        first = image.get_attribute("src")
        slider = page.locator(".pk-layer-slider .noUi-handle, .pk-layer-slider .slider-handle").first
        slider.focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_function(
            "src => document.querySelector('.pk-gradsync img').src !== src", arg=first, timeout=30_000
        )
        _no_traceback(page)
        _screenshot(page, ".pk-gradsync", "01_mirrored_gradsync.png")


def test_strategy_race_updates_live_in_chromium(lab):
    base, token = lab
    steps = _setting(LAB, "STEPS")
    raced = len(re.search(r"STRATEGIES = \[([^\]]*)\]", (ROOT / "notebooks" / LAB).read_text()).group(1).split(","))
    with _browser_page("13_strategy_lab") as page:
        _run_all(page, base, token, LAB)

        # The race's table moves run by run (each run's first step compiles, so every state lasts
        # long enough to see), then every row is complete and the chart is drawn.
        page.wait_for_function(
            "() => (document.querySelector('.pk-race .pk-race-header')?.textContent || '').includes('done')",
            timeout=180_000,
        )
        final = tuple(page.evaluate(RACE_ROWS))
        assert final == (steps,) * raced, f"the race table shows steps {final}"
        tables = [tuple(map(int, RACE_ROW_STEPS.findall(u))) for u in page.evaluate("() => window.pkUpdates")]
        tables = [t for t in tables if len(t) == raced]
        assert tables == sorted(tables) and tables[-1] == final, f"race updates out of order: {tables}"
        assert len(set(tables)) >= raced, f"the race table did not update while it ran: {tables}"
        between = (steps,) + (0,) * (raced - 1)
        assert between in tables, f"no state between the first and second run: {sorted(set(tables))}"
        assert "simulated" in page.locator(".pk-race .pk-race-header").text_content()
        chart = page.locator(".pk-race img")
        chart.scroll_into_view_if_needed()
        assert chart.count() == 1 and chart.evaluate("img => img.naturalWidth") > 100

        # The last (proof) cell ran, and nothing raised on the way.
        page.locator(".jp-OutputArea-output", has_text="every raced strategy equals SingleDevice").wait_for(
            timeout=180_000
        )
        _no_traceback(page)
        _screenshot(page, ".pk-race", "13_strategy_lab_race.png")
