"""The course notebooks run top to bottom, and are committed without outputs (so they diff well)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest
from helpers import NOTEBOOKS
from nbclient.exceptions import CellExecutionError
from test_exercises import assert_exercises_judged

from parallelkit.course import build as course

ROOT = Path(__file__).resolve().parents[1]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours in IPython tracebacks


def _code_cells(nb) -> list:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {ROOT / 'notebooks'}"


EXECUTED: dict[str, nbformat.NotebookNode] = {}  # the runs below, kept for the static course test


def _execute(path: Path, workdir: Path) -> nbformat.NotebookNode:
    """Run a notebook as a learner's fresh kernel would; fail the test with the cell's error."""
    failure = None
    try:
        return course.execute(path, workdir)
    except CellExecutionError as error:
        failure = _ANSI.sub("", str(error))
    pytest.fail(f"{path.name}: a cell raised\n{failure}", pytrace=False)  # outside the except: the error once


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path):
    committed = path.read_bytes()
    nb = _execute(path, tmp_path)  # the kernel works in a scratch directory
    assert all(cell.execution_count is not None for cell in _code_cells(nb)), "some cells did not run"
    assert path.read_bytes() == committed, "running the notebook must not modify the committed file"
    assert_exercises_judged(nb)
    EXECUTED[path.name] = nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_stripped(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    dirty = [i for i, cell in enumerate(nb.cells) if cell.get("outputs") or cell.get("execution_count") is not None]
    assert not dirty, (
        f"{path.name}: cells {dirty} carry outputs or execution counts; "
        f"strip them (nbstripout {path.relative_to(ROOT)}) before committing"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_devices_are_chosen_before_any_jax_work(path: Path):
    """The device count is fixed when JAX starts, so the first cell that imports checks the settings and
    chooses the devices (pk.lesson.setup calls pk.simulate_devices)."""
    nb = nbformat.read(path, as_version=4)
    first_import = next(cell for cell in _code_cells(nb) if "import " in cell.source)
    assert "import parallelkit as pk" in first_import.source
    assert "pk.lesson.setup(" in first_import.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_settings_come_first_tagged_parameters(path: Path):
    """The first code cell holds only the settings, tagged so that papermill-style tools can override them."""
    settings = _code_cells(nbformat.read(path, as_version=4))[0]
    assert "parameters" in settings.metadata.get("tags", [])
    statements = ast.parse(settings.source).body
    assert statements and all(isinstance(s, ast.Assign) for s in statements), "only NAME = value lines"
    names = [target.id for s in statements for target in s.targets]
    assert all(name.isupper() for name in names), names


def _with_settings(path: Path, tmp_path: Path, **overrides) -> Path:
    """A copy of the notebook with a cell after the settings that overrides some (as papermill injects)."""
    nb = nbformat.read(path, as_version=4)
    index = nb.cells.index(_code_cells(nb)[0]) + 1
    nb.cells.insert(index, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in overrides.items())))
    copy = tmp_path / path.name
    nbformat.write(nb, copy)
    return copy


@pytest.mark.notebook
def test_a_setting_the_lesson_cannot_use_is_refused_with_a_sentence(tmp_path: Path):
    copy = _with_settings(ROOT / "notebooks" / "00_devices_and_placement.ipynb", tmp_path, BATCH=63)
    with pytest.raises(CellExecutionError, match="BATCH=63 does not split evenly over 8 devices: choose a multiple"):
        course.execute(copy, tmp_path)


@pytest.mark.notebook
def test_the_first_notebook_runs_with_another_model_on_forced_cpu(tmp_path: Path):
    copy = _with_settings(ROOT / "notebooks" / "00_devices_and_placement.ipynb", tmp_path, MODEL="cnn", FORCE_CPU=True)
    nb = _execute(copy, tmp_path)
    printed = "".join(o.get("text", "") for cell in _code_cells(nb) for o in cell.outputs)
    assert "cnn parameters:" in printed and "8 simulated CPU devices" in printed


# Per cell of a page, each output's text and figures that an earlier output of the same cell already showed.
REPEATED_OUTPUTS = """() => [...document.querySelectorAll('.jp-Cell')].flatMap(cell => {
    const shown = [...cell.querySelectorAll('.jp-OutputArea-output')].map(
        o => (o.innerText.trim() + ' ' + [...o.querySelectorAll('img')].map(i => i.src).join(' ')).trim());
    return shown.filter((text, i) => text && shown.indexOf(text) !== i);
})"""


def _widget_labels(nb: nbformat.NotebookNode) -> list[str]:
    """The description of every widget the executed ``nb`` shows, inside boxes and output areas too."""
    states = nb.metadata.get("widgets", {}).get(course.WIDGET_STATE, {}).get("state", {})
    labels = []

    def visit(output: dict) -> None:
        view = output.get("data", {}).get(course.WIDGET_VIEW)
        if view is not None:
            visit_model(view["model_id"])

    def visit_model(model_id: str) -> None:
        state = states.get(model_id, {}).get("state", {})
        labels.extend([state["description"]] if state.get("description") else [])
        for child in state.get("children", []):
            visit_model(child.removeprefix("IPY_MODEL_"))
        for output in state.get("outputs", []):
            visit(output)

    for cell in nb.cells:
        for output in cell.get("outputs", []):
            visit(output)
    return labels


@pytest.mark.notebook
@pytest.mark.browser
def test_static_course_builds_and_its_pages_load_in_chromium(tmp_path: Path, browser_ready):
    """`make course`: every page opens from disk with every figure loaded, the widgets as their final snapshot
    (each control with its label and value), no output shown twice in a cell, and nothing fetched from the
    network."""
    from helpers import CHROMIUM, CHROMIUM_ARGS
    from playwright.sync_api import sync_playwright

    for path in NOTEBOOKS:  # the notebooks the runs above did not execute (when run alone)
        if path.name not in EXECUTED:
            (tmp_path / path.stem).mkdir()
            EXECUTED[path.name] = _execute(path, tmp_path / path.stem)
    labels = {name: sorted(_widget_labels(nb)) for name, nb in EXECUTED.items()}
    assert any(labels.values()), "no widget with a label in the whole course"
    index, *pages = course.build(tmp_path / "course", executed=EXECUTED)
    assert [p.stem for p in pages] == [p.stem for p in (*NOTEBOOKS, *course.REFERENCES)]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            remote = []
            page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
            page.goto(index.as_uri())
            assert page.locator("ol li a").evaluate_all("links => links.map(a => a.getAttribute('href'))") == [
                p.name for p in pages
            ]
            figures = 0
            for html_page, notebook in zip(pages, (*NOTEBOOKS, *course.REFERENCES), strict=True):
                page.goto(html_page.as_uri(), wait_until="load")
                sizes = page.locator("img").evaluate_all("imgs => imgs.map(i => i.complete ? i.naturalWidth : -1)")
                assert all(w > 0 for w in sizes), f"{notebook.name}: figures not loaded: {sizes}"
                assert len(sizes) == html_page.read_text().count("<img"), f"{notebook.name}: figures missing"
                figures += len(sizes)
                assert page.locator(".pk-widget-missing").count() == 0, f"{notebook.name}: a widget lost its state"
                shown = sorted(page.locator(".pk-control-label").all_text_contents())
                assert shown == labels.get(notebook.name, []), f"{notebook.name}: widget labels {shown}"
                valueless = page.locator(".pk-control:not(:has(.pk-control-value))").count()
                assert valueless == 0, f"{notebook.name}: {valueless} controls show no value"
                repeated = page.evaluate(REPEATED_OUTPUTS)
                assert not repeated, f"{notebook.name}: a cell shows this output twice: {repeated[0][:300]!r}"
                assert page.get_by_text("Traceback").count() == 0, f"{notebook.name}: a cell shows an error"
            assert figures >= len(NOTEBOOKS), f"only {figures} figures in the whole course"
            references = dict(zip((r.stem for r in course.REFERENCES), pages[len(NOTEBOOKS) :], strict=True))
            page.goto(references["rosetta"].as_uri())  # the Rosetta reference: its tables rendered
            assert page.locator("table").count() >= 5
            page.goto(references["glossary"].as_uri())  # every term an anchor the notebooks link to
            assert page.locator("a[id]").count() >= 50
            solutions = sum("solution" in c.metadata.get("tags", []) for nb in EXECUTED.values() for c in nb.cells)
            closed = 0
            for html_page in pages[: len(NOTEBOOKS)]:
                page.goto(html_page.as_uri())
                assert page.locator("details.pk-solution[open]").count() == 0, f"{html_page.name}: a solution open"
                closed += page.locator("details.pk-solution").count()
            assert closed == solutions, f"{closed} closed solutions in the pages, {solutions} solution cells"
            page.goto(pages[1].as_uri())  # 01: its links to the references
            assert page.locator("a[href='rosetta.html']").count() == 1
            assert page.locator("a[href^='glossary.html#']").count() >= 10
            page.goto(pages[3].as_uri())  # 03: a strategy's live timing dashboard as it ended
            assert "done" in page.locator(".pk-dashboard .pk-header").first.text_content()
            page.goto(next(p for p in pages if p.stem == "13_strategy_lab").as_uri())  # the race as it ended
            assert "done" in page.locator(".pk-race .pk-race-header").first.text_content()
        finally:
            browser.close()
    assert not remote, f"the pages fetched from the network: {remote[:5]}"


def _table_rows(markdown: str) -> list[str]:
    return [line.strip() for line in markdown.splitlines() if line.strip().startswith("|")]


def test_the_first_notebooks_rosetta_table_is_the_references_first_table():
    """Notebook 00's table of moves is docs/rosetta.md's first (devices and placement), row for row."""
    nb = nbformat.read(ROOT / "notebooks" / "00_devices_and_placement.ipynb", as_version=4)
    shown = _table_rows(nb.cells[0].source)
    section = (ROOT / "docs" / "rosetta.md").read_text().split("\n## ")[1]  # the first topic's section
    assert shown == _table_rows(section), "notebook 00's Rosetta table differs from docs/rosetta.md's first table"
