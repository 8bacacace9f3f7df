"""The course notebooks run top to bottom, and are committed without outputs (so they diff well)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours in IPython tracebacks


def _code_cells(nb) -> list:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {ROOT / 'notebooks'}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    committed = path.read_bytes()
    # Work on a copy, in a scratch directory that is also the kernel's working directory.
    copy = tmp_path / path.name
    shutil.copyfile(path, copy)
    nb = nbformat.read(copy, as_version=4)
    # A learner's kernel starts without this session's device flags: the notebook chooses its own.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    failure = None
    try:
        client.execute()
    except CellExecutionError as error:
        failure = _ANSI.sub("", str(error))
    if failure:  # failed outside the except block, so the report shows the cell's error once
        pytest.fail(f"{path.name}: a cell raised\n{failure}", pytrace=False)
    assert all(cell.execution_count is not None for cell in _code_cells(nb)), "some cells did not run"
    assert path.read_bytes() == committed, "running the notebook must not modify the committed file"


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
    """The device count is fixed when JAX starts, so the first cell that imports calls simulate_devices."""
    nb = nbformat.read(path, as_version=4)
    first_import = next(cell for cell in _code_cells(nb) if "import " in cell.source)
    assert "import parallelkit as pk" in first_import.source
    assert "pk.simulate_devices(" in first_import.source
