"""The bounds the documentation is held to, measured on the files: each test names what breaks its bound.

- module docstrings at most 3 % of the package's lines (a caption and what the module holds; the
  derivations and history live in ``docs/`` and the notebooks);
- the README, the front page, at most 300 lines;
- every relative link of the README and of ``docs/`` points at a file that exists;
- every page of ``docs/`` is a page of the static course (``make course``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

import parallelkit as pk
from parallelkit.course import build as course

PACKAGE = Path(pk.__file__).parent
ROOT = PACKAGE.parent
DOCSTRING_SHARE, README_LINES = 0.03, 300
LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target: [text](target)


def module_docstring_lines(path: Path) -> int:
    """How many lines the module docstring of ``path`` spans (0 without one)."""
    body = ast.parse(path.read_text()).body
    first = body[0] if body else None
    is_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return first.end_lineno - first.lineno + 1 if is_docstring and isinstance(first.value.value, str) else 0


def docstring_share(package: Path) -> tuple[float, list[str]]:
    """Module docstring lines over all lines of ``package``'s modules, and the ten longest as ``path (lines)``."""
    paths = sorted(package.rglob("*.py"))
    docstrings = {path: module_docstring_lines(path) for path in paths}
    total = sum(len(path.read_text().splitlines()) for path in paths)
    longest = sorted(docstrings, key=docstrings.get, reverse=True)[:10]
    return sum(docstrings.values()) / total, [f"{p.relative_to(package.parent)} ({docstrings[p]})" for p in longest]


CODE = re.compile(r"```.*?```|`[^`\n]*`|^(?: {4}|\t).*$", re.S | re.M)  # fenced, inline and indented code


def broken_links(page: Path) -> list[str]:
    """The relative link targets of the Markdown ``page`` whose file does not exist (anchors and code left out)."""
    targets = (target.split("#")[0] for target in LINK.findall(CODE.sub("", page.read_text())))
    relative = (t for t in targets if t and not re.match(r"[a-z]+:", t))
    return [f"{page.name}: {t}" for t in relative if not (page.parent / t).exists()]


def test_module_docstrings_are_at_most_3_percent_of_the_package():
    share, longest = docstring_share(PACKAGE)
    assert share <= DOCSTRING_SHARE, (
        f"Module docstrings are {share:.1%} of parallelkit's lines, over the bound of {DOCSTRING_SHARE:.0%}. "
        f"Keep a caption and what the module holds; move derivations and history to docs/. Longest: {longest}"
    )


def test_the_docstring_measure_counts_module_docstrings_only(tmp_path):
    (tmp_path / "a.py").write_text('"""One.\n\nTwo.\n"""\n\n\ndef f():\n    """Not counted."""\n')
    (tmp_path / "b.py").write_text("x = 1\n'not a docstring'\n")
    assert module_docstring_lines(tmp_path / "a.py") == 4
    assert docstring_share(tmp_path)[0] == 4 / 10


def test_the_readme_is_at_most_300_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, (
        f"README.md has {lines} lines, over the bound of {README_LINES}. "
        "Keep it a front page: move the detail to the docs/ page of its topic and link it."
    )


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [link for page in pages for link in broken_links(page)]
    assert not broken, f"links to files that do not exist: {broken}"


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "here.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](here.md#a) [gone](gone.md) [web](https://example.org) [anchor](#top)\n"
        "`[code](x.md)`\n\n    [indented code](y.md)\n\n```\n[fenced](z.md)\n```\n"
    )
    assert broken_links(page) == ["page.md: gone.md"]


def test_every_docs_page_is_a_page_of_the_static_course():
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    rendered = {path.name for path in course.REFERENCES if path.parent.name == "docs"}
    assert pages == rendered, f"docs/ pages the course does not render: {sorted(pages - rendered)}"


@pytest.mark.slow
def test_the_static_course_renders_the_docs_links_them_and_writes_the_api_reference(tmp_path):
    """`make course` without running: the notebooks as committed, every reference page, links between the README
    and the docs pointing at their pages, and pdoc's API reference linked from the index."""
    notebooks = {path.name: nbformat.read(path, as_version=4) for path in sorted(course.NOTEBOOKS.glob("*.ipynb"))}
    index, *pages = course.build(tmp_path, executed=notebooks)
    assert [p.stem for p in pages[len(notebooks) :]] == [p.stem for p in course.REFERENCES]
    written = {p.name for p in pages}
    for page in pages[len(notebooks) :]:
        text = page.read_text()
        left = re.findall(r'href="(?:\.\./)?(?:docs/)?(\w+)\.md[#"]', text)
        assert not [name for name in left if f"{name}.html" in written], f"{page.name}: links left to .md: {left}"
        linked = set(re.findall(r'href="(\w+)\.html[#"]', text))
        assert {f"{name}.html" for name in linked} <= written, f"{page.name}: links to pages not written: {linked}"
    assert "training.html" in (tmp_path / "README.html").read_text()
    api = tmp_path / course.API / "parallelkit.html"
    assert api.exists() and "href='api/parallelkit.html'" in index.read_text()
    assert (
        'id="fit"' in (tmp_path / course.API / "parallelkit" / "run" / "training.html").read_text()
    )  # from docstrings
