"""One device's memory (06) comes before ZeRO (07): the 16 bytes a parameter taught once, in 06, and 07 built on it."""

from __future__ import annotations

import re

import nbformat
from helpers import NOTEBOOKS

MEMORY, ZERO = (next(p for p in NOTEBOOKS if p.stem.startswith(stem)) for stem in ("06_when", "07_hybrid"))


def _cells(path, kind: str) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == kind]


def test_the_memory_notebook_stays_on_one_device_and_teaches_the_16_bytes():
    code = "\n".join(_cells(MEMORY, "code"))
    assert "FullySharded" not in code and "ZeRO-" not in code, "notebook 06 compiles a ZeRO stage"
    assert '"mixed-precision Adam (ZeRO paper)": (2, 2, 12)' in code and "(4, 4, 8)" in code
    assert "sum(parts) == 16" in code


def test_the_zero_notebook_divides_the_16_bytes_it_cites_and_does_not_teach_them_again():
    text = "\n".join(_cells(ZERO, "markdown"))
    cited = "](06_when_the_model_does_not_fit.ipynb)"
    for said in re.finditer(r"16 bytes a parameter", text):
        before = text[max(0, said.start() - 300) : said.start()]
        assert cited in before or "notebook 06" in before.lower(), f"07 says {said.group(0)!r} without citing 06"
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        assert "lax.scan" not in block and "checkpoint" not in block, "07 shows the scan or recomputation 06 teaches"
    assert "](../docs/glossary.md#rematerialisation)" in text and "06's" in text  # it names them as 06's


def test_the_exercise_on_16_h100s_is_in_the_zero_notebook():
    ids = [c.id for c in nbformat.read(ZERO, as_version=4).cells]
    assert {"c10-28", "c10-29", "ccb93956"} <= set(ids)
    assert not {"c10-28", "c10-29", "ccb93956"} & {c.id for c in nbformat.read(MEMORY, as_version=4).cells}
