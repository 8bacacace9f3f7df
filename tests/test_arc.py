"""The course's arc: each notebook says what it needs (earlier notebooks only) and links the next one."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from helpers import NOTEBOOKS

from parallelkit.course import arc
from parallelkit.course.build import recorded_seconds

COURSE = arc.lessons(NOTEBOOKS)


def test_the_notebooks_are_numbered_in_order_from_00():
    assert [lesson.number for lesson in COURSE] == list(range(len(NOTEBOOKS)))


@pytest.mark.parametrize("lesson", COURSE, ids=lambda lesson: lesson.stem)
def test_a_notebook_needs_only_earlier_ones(lesson: arc.Lesson):
    stems = {other.stem for other in COURSE}
    assert set(lesson.needs) <= stems, f"{lesson.stem} needs a notebook that does not exist: {lesson.needs}"
    assert all(int(need[:2]) < lesson.number for need in lesson.needs), f"{lesson.stem} needs {lesson.needs}"
    assert lesson.number == 0 or lesson.needs, f"{lesson.stem} says nothing about what it builds on"
    assert lesson.goal.endswith(".") and len(lesson.goal.split()) <= 20


def test_each_notebook_links_the_next_and_the_course_ends_once():
    for lesson, following in zip(COURSE, COURSE[1:], strict=False):
        assert lesson.next == following.stem, f"{lesson.stem} points at {lesson.next}, not {following.stem}"
    assert COURSE[-1].next is None
    ends = [p.name for p in NOTEBOOKS if "## The end of the course" in _markdown(p)]
    assert ends == [NOTEBOOKS[-1].name]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_links_between_notebooks_and_to_the_glossary_resolve(path: Path):
    text = _markdown(path)
    for stem in re.findall(r"\]\((\d\d_\w+)\.ipynb", text):
        assert (path.parent / f"{stem}.ipynb").exists(), f"{path.name} links {stem}.ipynb"
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (path.parents[1] / "docs" / "glossary.md").read_text()))
    for anchor in re.findall(r"\]\(\.\./docs/glossary\.md#([^)]+)\)", text):
        assert anchor in anchors, f"{path.name} links the glossary's #{anchor}, which it does not define"


def test_the_index_draws_every_notebook_its_prerequisites_and_run_time():
    seconds = recorded_seconds()
    picture = arc.arc_svg(COURSE, seconds)
    assert picture.count("<rect") == len(COURSE)
    assert picture.count("marker-end=") == sum(len(lesson.needs) for lesson in COURSE)
    for lesson in COURSE:
        assert f"href='{lesson.stem}.html'" in picture
        assert f"{seconds[lesson.stem + '.ipynb']:.0f} s" in picture


def test_a_notebook_without_an_opening_is_named(tmp_path: Path):
    path = tmp_path / "03_untitled.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 03 · Untitled")]), path)
    with pytest.raises(ValueError, match="03_untitled.ipynb has no opening cell"):
        arc.lesson(path)


def _markdown(path: Path) -> str:
    return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")


EVERYDAY_WORDS = {"stage"}  # also ZeRO's stages and the parts of a step: the word alone says too little


def _glossary_terms() -> dict[str, tuple[list[str], int | None]]:
    """Each glossary anchor: the term's spellings and the first notebook that teaches it (None: no notebook named)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "glossary.md").read_text()
    terms = {}
    for anchor, name, body in re.findall(r'<a id="([^"]+)"></a>\*\*([^*]+?)\*\*(.*?)(?=\n<a id=|\Z)', text, flags=re.S):
        taught = [
            int(n) for n in re.findall(r"\d\d", " ".join(re.findall(r"Notebooks? \d\d(?:(?:, | and )\d\d)*", body)))
        ]
        spellings = [w.strip() for w in re.split(r",| and ", re.sub(r"\(.*?\)", "", name.rstrip("."))) if w.strip()]
        terms[anchor] = (spellings, min(taught) if taught else None)
    return terms


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_term_taught_later_is_linked_to_the_glossary_where_first_used(path: Path):
    """No term before its definition: a glossary term a later notebook teaches is linked at its first use here."""
    number = int(path.stem[:2])
    text = re.sub(r"\*\*(You need|Next):\*\*[^\n]*", " ", _markdown(path))  # the arc's own links name notebooks
    text = re.sub(r"`[^`]*`", " ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))  # tables: names
    for anchor, (spellings, taught) in _glossary_terms().items():
        if taught is None or taught <= number or anchor in EVERYDAY_WORDS:
            continue
        pattern = "|".join(re.escape(s) for s in spellings)
        sensitive = any(c.isupper() for s in spellings for c in s[1:])  # ZeRO, not "zero"
        used = re.search(rf"(?<![\w-])({pattern})(?![\w-])", text, flags=0 if sensitive else re.I)
        if used:
            link = re.search(rf"\]\(\.\./docs/glossary\.md#{re.escape(anchor)}\)", text)
            assert link and link.start() < used.end() + 120, (
                f"{path.name} uses {used.group(0)!r}, taught in notebook {taught:02d}, before linking the glossary"
            )
