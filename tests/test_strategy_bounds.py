"""Exercises of notebooks 07 to 12 that apply a bound the notebook derives, entered as a learner would.

Each predict cell runs with the answer its hidden solution derives, and with a wrong one: the first
must be judged right, the second not (a mutation test of the check), and the hidden solution's own
assertions must hold. The cells run on their own, with only the notebook settings they read.
"""

from __future__ import annotations

import ast

import nbformat
import pytest
from helpers import NOTEBOOKS

import parallelkit as pk
from parallelkit.measure import hardware, roofline
from parallelkit.models.layers.experts import capacity, dispatch_bytes

LINKS = pk.costmodel.PRESETS
# (notebook, exercise cell id, the settings the cell reads, the answer its solution derives, a wrong answer); a
# setting named BEFORE lists cells of the notebook to run first (the derivation whose function the cell calls)
BEFORE = "before"
DERIVED = [
    ("07_hybrid", "c07-ex1", {BEFORE: ("c06-bound",)}, 7, 6),
    ("07_hybrid", "c10-29", {"hardware": hardware}, (80 / 4.75, 80 / 2.875), (5.0, 40.0)),
    ("08_when", "nb11-26", {"N_DEVICES": 4, "BATCH": 4, "LENGTH": 64, "DEPTH": 2, "DIM": 32}, 7 / 6, 1.0),
    ("09_pipeline", "c06-ex2", {}, 6, 8),
    ("09_pipeline", "c09-choose", {}, "pipeline", "data"),
    ("10_many", "c21", {"capacity": capacity, "dispatch_bytes": dispatch_bytes}, (160, 160 * 7168 * 2), (160, 7168)),
    ("10_many", "c23", {}, 1 / 2, 7 / 16),
    ("11_multi", "c04-ex2", {"nvlink": LINKS["nvlink4"], "ethernet": LINKS["100gbe"], "P_BYTES": 16e9}, 31 / 30, 2.0),
    ("12_where", "cell-23", {"hardware": hardware, "roofline": roofline}, 989.5 / 3.35, 98.95 / 3.35),
]
IDS = [f"{stem[:2]}-{cell_id}" for stem, cell_id, *_ in DERIVED]


def _code_cells(stem: str) -> list:
    path = next(p for p in NOTEBOOKS if p.stem.startswith(stem))
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def _exercise(stem: str, cell_id: str) -> tuple[str, str]:
    """The exercise cell's source and its hidden solution's (the next code cell)."""
    cells = _code_cells(stem)
    at = [c.id for c in cells].index(cell_id)
    assert "solution" in cells[at + 1].metadata.get("tags", []), f"{stem} {cell_id} has no hidden solution after it"
    return cells[at].source, cells[at + 1].source


def _judged(source: str, settings: dict, prediction: object, reasons: str = "") -> tuple[object, dict]:
    """Run an exercise cell with ``prediction`` (and ``reasons``) entered; the check's verdict and the cell's names."""
    entered = source.replace("prediction = None", f"prediction = {prediction!r}", 1)
    entered = entered.replace('reasons = ""', f"reasons = {reasons!r}", 1)
    tree, names = ast.parse(entered), {"pk": pk, **settings}
    exec(compile(ast.Module(tree.body[:-1], type_ignores=[]), "<exercise>", "exec"), names)
    return eval(compile(ast.Expression(tree.body[-1].value), "<exercise>", "eval"), names), names


@pytest.mark.parametrize("stem, cell_id, settings, answer, wrong", DERIVED, ids=IDS)
def test_the_derived_answer_is_right_and_a_wrong_one_is_not(stem, cell_id, settings, answer, wrong, capsys):
    exercise, solution = _exercise(stem, cell_id)
    settings = {"pk": pk, **settings}
    for before in settings.pop(BEFORE, ()):  # its names join the settings
        exec(next(c.source for c in _code_cells(stem) if c.id == before), settings)
    assert _judged(exercise, settings, answer, "a sentence")[0] is True
    verdict, names = _judged(exercise, settings, wrong, "a sentence")
    assert verdict is False
    exec(solution, names)  # the hidden solution's assertions hold for the measured value
    assert capsys.readouterr().out.count("not quite") == 1


def test_a_choice_without_reasons_is_sent_back_for_them(capsys):
    exercise, _ = _exercise("09_pipeline", "c09-choose")
    _judged(exercise, {}, "pipeline")
    assert "one sentence of reasons" in capsys.readouterr().out
