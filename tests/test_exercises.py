"""The notebooks' exercises: the learner writes the code, the checker judges it, the solution stays hidden.

A write-exercise is a code cell tagged ``exercise`` whose stub a checker rejects (``not yet: ...``).
The next code cell, tagged ``solution`` and hidden (``jupyter.source_hidden``), passes the same
checker. A predict-a-number cell shows the measurement only beside a prediction; the assertion of
what it teaches lives in the hidden solution cell after it, not in plain sight. The notebook test
runs every cell and checks the stubs' and solutions' outputs with :func:`assert_exercises_judged`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from helpers import NOTEBOOKS


def _code_cells(path: Path) -> list:
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]


def _tags(cell) -> list[str]:
    return cell.metadata.get("tags", [])


def _asserts(source: str) -> list[str]:
    return [ast.unparse(node) for node in ast.parse(source).body if isinstance(node, ast.Assert)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_solution_is_hidden_and_follows_its_exercise(path: Path):
    cells = _code_cells(path)
    for before, cell in zip(cells, cells[1:], strict=False):
        if "solution" in _tags(cell):
            assert cell.metadata.get("jupyter", {}).get("source_hidden") is True, cell.source[:80]
            assert "exercise" in _tags(before) or "pk.lesson.check(" in before.source, cell.source[:80]
        if "exercise" in _tags(before):
            assert "solution" in _tags(cell), f"the exercise {before.source[:60]!r} has no solution after it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_an_exercise_does_not_show_its_answer(path: Path):
    """A predict cell asserts nothing in plain sight; a stub holds no call to the kit's answer."""
    for cell in _code_cells(path):
        if "solution" in _tags(cell):
            continue
        if "pk.lesson.check(" in cell.source or "exercise" in _tags(cell):
            assert not _asserts(cell.source), f"move {_asserts(cell.source)} into the hidden solution cell after it"


def assert_exercises_judged(nb: nbformat.NotebookNode) -> None:
    """In an executed notebook, every stub's checker said "not yet" and its solution's "right".

    Called by the notebook test on each notebook it runs.
    """
    cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    for stub, solution in zip(cells, cells[1:], strict=False):
        if "exercise" not in _tags(stub):
            continue
        rejected, passed = _printed(stub), _printed(solution)
        assert "not yet:" in rejected, f"the stub was not rejected: {stub.source[:80]!r} printed {rejected!r}"
        assert "right" in passed and "not yet" not in passed, f"{solution.source[:80]!r} printed {passed!r}"


def _printed(cell) -> str:
    return "".join(output.get("text", "") for output in cell.get("outputs", []) if output.output_type == "stream")


@pytest.mark.parametrize("path", NOTEBOOKS[1:], ids=lambda p: p.stem)
def test_every_notebook_after_the_first_asks_the_learner_to_write_code(path: Path):
    stubs = [cell for cell in _code_cells(path) if "exercise" in _tags(cell)]
    assert stubs, f"{path.name} has no exercise where the learner writes code (a cell tagged exercise)"
