"""The course's prose a learner can read: short sentences in every notebook's Markdown.

A sentence is counted in words after code, formulas, tables, HTML tags and link targets are
taken out (an inline code span or a formula counts as one word). Headings and list items are
sentences of their own. Run this file with notebook paths to list a notebook's long sentences:
``python tests/test_prose.py notebooks/01_mirrored.ipynb``.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import nbformat
import pytest
from helpers import NOTEBOOKS

MEDIAN_WORDS = 18  # the median sentence of a notebook, at most
LONGEST_WORDS = 45  # no sentence longer
ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "Fig.", "approx.", "no.", "al.")


def sentences(markdown: str) -> list[str]:
    """The sentences of one Markdown text, each as its plain words."""
    text = re.sub(r"```.*?```", "\n\n", markdown, flags=re.S)  # code blocks
    text = re.sub(r"\$\$.*?\$\$", " FORMULA ", text, flags=re.S)
    text = re.sub(r"\$[^$\n]+\$", "FORMULA", text)
    text = re.sub(r"`[^`\n]+`", "CODE", text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"<[^>\n]+>", " ", text)  # HTML tags
    for short in ABBREVIATIONS:  # whole words only: "al." of "et al.", not the end of "real."
        text = re.sub(rf"(?<![\w.]){re.escape(short)}", short.replace(".", ""), text)
    blocks: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|"):  # a table row
            continue
        starts_block = not stripped or re.match(r"(#+|[-*+]|\d+[.)])\s", stripped)
        if starts_block or not blocks:
            blocks.append("")
        blocks[-1] += " " + re.sub(r"^(#+|[-*+]|\d+[.)]|>)\s+", "", stripped)
    found = []
    for block in blocks:
        for sentence in re.split(r"(?<=[.!?])[)\"']?\s+(?=[\"'(*_]*[A-Z0-9])", block):
            words = re.sub(r"[*_#>]", " ", sentence).split()
            if words:
                found.append(" ".join(words))
    return found


def notebook_sentences(path: Path) -> list[str]:
    """Every sentence of a notebook's Markdown cells, in order."""
    nb = nbformat.read(path, as_version=4)
    return [s for cell in nb.cells if cell.cell_type == "markdown" for s in sentences(cell.source)]


def test_sentences_are_counted_as_a_reader_would():
    text = (
        "# A heading\n\nOne `jax.lax.psum(x, 'data')` call, e.g. this one, for real. "
        "Then [a link](http://x.org/a.b) here!\n"
        "- an item\n- another item, with $x^2$ in it\n\n| a | table |\n|---|---|\n\n```python\nnot. Prose.\n```\n"
    )
    assert sentences(text) == [
        "A heading",
        "One CODE call, eg this one, for real.",
        "Then a link here!",
        "an item",
        "another item, with FORMULA in it",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebooks_sentences_are_short(path: Path):
    lengths = [len(s.split()) for s in notebook_sentences(path)]
    long = [s for s in notebook_sentences(path) if len(s.split()) > LONGEST_WORDS]
    assert not long, f"{len(long)} sentences over {LONGEST_WORDS} words, the first: {long[0]!r}"
    assert statistics.median(lengths) <= MEDIAN_WORDS, f"median sentence {statistics.median(lengths)} words"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_what_holds_only_on_a_laptop_is_one_aside_at_most(path: Path):
    """Remarks about simulated CPU devices sit in one block quote, "On a laptop", not across the main line."""
    cells = nbformat.read(path, as_version=4).cells
    asides = [cell for cell in cells if cell.cell_type == "markdown" and "**On a laptop.**" in cell.source]
    assert len(asides) <= 1
    for aside in asides:
        assert aside.source.startswith("> **On a laptop.**")
        assert all(line.startswith(">") for line in aside.source.splitlines()), "the aside is one block quote"


if __name__ == "__main__":
    for name in sys.argv[1:] or map(str, NOTEBOOKS):
        found = notebook_sentences(Path(name))
        lengths = [len(s.split()) for s in found]
        print(f"{Path(name).name}: {len(found)} sentences, median {statistics.median(lengths)} words")
        for sentence, n in zip(found, lengths, strict=True):
            if n > LONGEST_WORDS:
                print(f"  {n} words: {sentence}")
