"""The course's arc, read from the notebooks (:func:`lessons`) and drawn (:func:`arc_svg`)."""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import nbformat

_NEEDS = re.compile(r"\*\*You need:\*\*(?P<needs>[^\n]*)")
_GOAL = re.compile(r"\*\*You will be able to:\*\*\s*(?P<goal>[^\n]+)")
_NEXT = re.compile(r"\*\*Next:\*\*\s*\[[^\]]*\]\((?P<next>\d\d_\w+)\.ipynb\)")
_LINKED = re.compile(r"\]\((\d\d_\w+)\.ipynb\)")


@dataclass(frozen=True)
class Lesson:
    """One notebook's place in the course."""

    stem: str  # the file's name without .ipynb, e.g. "02_collectives_and_scaling"
    title: str  # its first heading, number and all
    goal: str  # what the learner will be able to do afterwards
    needs: tuple[str, ...]  # the stems of the notebooks it builds on
    next: str | None  # the stem its closing cell links, None in the last notebook

    @property
    def number(self) -> int:
        return int(self.stem[:2])


def lesson(path: Path) -> Lesson:
    """Read one notebook's opening and closing cells.

    Raises:
      ValueError: the notebook has no "You need" / "You will be able to" opening.
    """
    nb = nbformat.read(path, as_version=4)
    cells = [cell.source for cell in nb.cells if cell.cell_type == "markdown"]
    opening = next((source for source in cells if _NEEDS.search(source) and _GOAL.search(source)), None)
    if opening is None:
        raise ValueError(f"{path.name} has no opening cell with **You need:** and **You will be able to:**")
    following = _NEXT.search(cells[-1])
    return Lesson(
        stem=path.stem,
        title=title(nb, default=path.stem),
        goal=_GOAL.search(opening).group("goal").strip(),
        needs=tuple(_LINKED.findall(_NEEDS.search(opening).group("needs"))),
        next=following.group("next") if following else None,
    )


def title(nb: nbformat.NotebookNode, default: str) -> str:
    """A notebook's first heading (its first Markdown cell that starts with ``# ``), or ``default``."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.startswith("# "):
            return cell.source.splitlines()[0][2:].strip()
    return default


def lessons(paths: Sequence[Path]) -> list[Lesson]:
    """Every notebook's :class:`Lesson`, in the order given."""
    return [lesson(path) for path in paths]


def arc_svg(course: Sequence[Lesson], seconds: Mapping[str, float] | None = None) -> str:
    """The course as an SVG picture: one box per notebook (title, goal, run time), prerequisites as arcs.

    An arc leaves a notebook's box low on its left edge and enters the later notebook that needs it
    high on its left edge. ``seconds`` maps a notebook's file name (``.ipynb``) to its run time; a
    notebook without one shows none.
    """
    seconds = seconds or {}
    row, left, width, box = 64, 230, 640, 46
    y = {lesson.stem: 20 + i * row for i, lesson in enumerate(course)}
    leaving = {stem: [] for stem in y}  # the notebooks each one leads to, in order
    for lesson in course:
        for need in lesson.needs:
            if need in leaving:
                leaving[need].append(lesson.stem)
    parts = []
    for lesson in course:
        needs = [need for need in lesson.needs if need in y]
        for j, need in enumerate(needs):
            out = leaving[need].index(lesson.stem)
            top = y[need] + 26 + 18 * (out + 1) / (len(leaving[need]) + 1)
            bottom = y[lesson.stem] + 22 * (j + 1) / (len(needs) + 1)
            reach = min(left - 10, 20 + (bottom - top) * 0.3)
            parts.append(
                f"<path d='M {left} {top:.1f} C {left - reach:.1f} {top:.1f}, {left - reach:.1f} {bottom:.1f}, "
                f"{left} {bottom:.1f}' fill='none' stroke='#7a8fb3' stroke-width='1' marker-end='url(#pk-arrow)'/>"
            )
    for lesson in course:
        top = y[lesson.stem]
        took = seconds.get(f"{lesson.stem}.ipynb")
        heading = lesson.title.split(":")[0].split("?")[0] + ("?" if "?" in lesson.title else "")
        parts.append(
            f"<a href='{lesson.stem}.html'><rect x='{left}' y='{top}' width='{width}' height='{box}' rx='6' "
            "fill='#f4f6fb' stroke='#7a8fb3'/>"
            f"<text x='{left + 10}' y='{top + 19}' font-size='14' font-weight='bold'>{html.escape(heading)}</text>"
            f"<text x='{left + 10}' y='{top + 37}' font-size='12'>{html.escape(lesson.goal)}</text>"
            f"<text x='{left + width + 8}' y='{top + 28}' font-size='12'>"
            f"{f'{took:.0f} s' if took is not None else ''}</text></a>"
        )
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' class='pk-arc' width='{left + width + 60}' "
        f"height='{20 + len(course) * row}' font-family='sans-serif' role='img' "
        "aria-label='the course: each notebook and the notebooks it needs'>"
        "<defs><marker id='pk-arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='6' markerHeight='6' "
        "orient='auto'><path d='M 0 0 L 10 5 L 0 10 z' fill='#7a8fb3'/></marker></defs>" + "".join(parts) + "</svg>"
    )
