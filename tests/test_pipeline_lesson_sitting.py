"""Notebook 09 in one sitting: its laptop remarks in one aside, and what it moved out on its page.

The one-program pipeline (`circular_pipeline`) and what a pipeline refuses left the notebook for
sections of docs/pipelines.md that the notebook links; their code must still run as the page
shows it, and print what the page says it prints.
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import nbformat
import pytest
from helpers import NOTEBOOKS, ROOT, docs_section

PAGE = ROOT / "docs" / "pipelines.md"
MOVED = {  # the page's section anchor: a sentence of the section that says what it teaches
    "a-pipeline-in-one-program": "It prints `2 collective-permutes in the compiled program`",
    "what-a-pipeline-here-refuses": "`init` probes the optimizer once on the host.",
}
LAPTOP = re.compile(r"simulated|laptop|\bcores?\b", re.IGNORECASE)  # what only this machine shows


def _cells() -> list:
    return nbformat.read(next(p for p in NOTEBOOKS if p.stem == "09_pipeline"), as_version=4).cells


@pytest.mark.parametrize("anchor", MOVED)
def test_what_09_moved_out_is_on_the_page_it_links(anchor):
    markdown = " ".join(c.source for c in _cells() if c.cell_type == "markdown")
    assert f"../docs/pipelines.md#{anchor}" in markdown
    assert MOVED[anchor] in docs_section(PAGE, anchor)


def test_the_moved_code_runs_as_the_page_shows_it():
    """Both snippets run in one namespace (they need 2 and 4 devices) and print what the page quotes."""
    assert len(jax.devices()) >= 4
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for anchor in MOVED:
            (snippet,) = re.findall(r"```python\n(.*?)```", docs_section(PAGE, anchor), re.S)
            exec(compile(snippet, f"docs/pipelines.md#{anchor}", "exec"), {})
    printed = out.getvalue()
    assert "2 collective-permutes in the compiled program" in printed
    assert "bubble (p-1)/(v m+p-1) = 11%" in printed
    assert "a dropout key: refused:" in printed and "clip_by_global_norm: refused:" in printed


def test_what_only_the_laptop_shows_is_said_in_the_aside_only():
    """The main text neither qualifies its lesson by this machine nor points at the aside for it."""
    main = [c for c in _cells() if c.cell_type == "markdown" and not c.source.startswith("> **On a laptop.**")]
    found = [(c.id, m.group(0)) for c in main for m in LAPTOP.finditer(c.source)]
    assert not found, f"remarks about this machine outside the aside: {found}"
