"""Notebook 14 in one sitting, and what it moved to the planner's page kept there, runnable and true.

The notebook keeps its idea (choosing a layout, derived on paper and checked against the planner);
the planner's memory beside a compiler's (a small GPT on simulated devices, a GPT compiled for 256
TPU chips) lives in a section of ``docs/planner.md`` that the notebook links. That section's code
must run as printed and print the figures its prose quotes.
"""

from __future__ import annotations

import re

import nbformat
import pytest
from helpers import NOTEBOOKS, ROOT, docs_section, heading_anchor, run_python

from parallelkit.measure import aot

NOTEBOOK = next(p for p in NOTEBOOKS if p.stem.startswith("14_"))
SECTION = "## The planner's memory beside a compiler's"


def _section() -> str:
    """The planner page's section that holds what notebook 14 moved out, to the next section."""
    return docs_section(ROOT / "docs" / "planner.md", heading_anchor(SECTION))


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _section(), flags=re.S)


def _numbers(said: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+\.\d+", said)]


def test_notebook_14_links_the_section_that_holds_what_it_moved():
    markdown = " ".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "markdown")
    assert f"../docs/planner.md#{heading_anchor(SECTION)})" in markdown
    code = " ".join(_snippets())
    assert "pk.inspect.memory_per_device" in code and 'pk.aot.devices("v5e:16x16")' in code


@pytest.mark.slow
def test_the_small_gpts_memory_on_the_planners_page_is_what_its_code_prints():
    run = run_python(_snippets()[0])
    assert run.returncode == 0, run.stderr[-2000:]
    rows = re.findall(r"([\d.]+) MB planned\s+([\d.]+) MB compiled", run.stdout)
    planned, compiled = ([float(r[i]) for r in rows] for i in (0, 1))
    said = re.search(r"\(([\d., and]+) MB planned; ([\d., and]+) MB compiled\)", " ".join(_section().split()))
    assert said, "the section no longer quotes the planned and compiled figures"
    assert (planned, compiled) == (_numbers(said.group(1)), _numbers(said.group(2)))
    low, high = (float(x) for x in re.search(r"([\d.]+) to ([\d.]+) times the planner's", _section()).groups())
    assert all(low - 0.05 <= c / p < high + 0.05 for p, c in zip(planned, compiled, strict=True))
    assert compiled[1] == compiled[0]  # "its ZeRO-3 program ... compiles to data 8's"


@pytest.mark.slow
@pytest.mark.skipif(not aot.available(), reason='libtpu is not installed: pip install "parallelkit[tpu]"')
def test_the_256_chip_program_on_the_planners_page_is_what_its_code_prints():
    run = run_python("import parallelkit as pk\nimport optax\nfrom flax import nnx\n" + _snippets()[1])
    assert run.returncode == 0, run.stderr[-2000:]
    for line in re.findall(r"print\(.*\)  # (.+)", _snippets()[1]):  # each print's comment: what it prints
        assert line in run.stdout, f"the page says {line!r}; the code printed {run.stdout!r}"
