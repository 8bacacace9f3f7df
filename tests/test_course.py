"""The static course: notebooks run quietly, and widgets keep their labels and values in the pages."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import ipywidgets as widgets
import nbformat
import pytest
from ipywidgets.embed import embed_data

from parallelkit.course import build as course

CONTROL = re.compile(
    r"<div class='pk-widget pk-control'>"
    r"(?:<span class='pk-control-label'[^>]*>(?P<label>.*?)</span>)?(?P<rest>.*?)</div>"
)


def _notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in sources])
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_executing_a_notebook_starts_its_kernel_without_the_tcp_warning(tmp_path: Path, capfd):
    """The kernel writes to this process's stderr; over plain TCP it warns at every start."""
    path = tmp_path / "transport.ipynb"
    nbformat.write(
        _notebook("from ipykernel.kernelapp import IPKernelApp\nprint(IPKernelApp.instance().transport)"), path
    )
    nb = course.execute(path, tmp_path)
    printed = capfd.readouterr()
    assert "without encryption" not in printed.err + printed.out, printed.err[-2000:]
    expected = "ipc" if os.name == "posix" else "tcp"
    assert nb.cells[0].outputs[0]["text"].strip() == expected


def _snapshot(*shown: widgets.Widget) -> str:
    """The static HTML that ``course.snapshot_widgets`` gives for ``shown``, stored as an executed notebook stores
    them (JSON)."""
    data = json.loads(json.dumps(embed_data(views=list(shown), drop_defaults=False)))
    nb = _notebook("")
    nb.metadata.widgets = {course.WIDGET_STATE: data["manager_state"]}
    nb.cells[0].outputs = [
        nbformat.v4.new_output("display_data", {course.WIDGET_VIEW: view, "text/plain": "widget"})
        for view in data["view_specs"]
    ]
    course.snapshot_widgets(nb)
    return "".join(output.data["text/html"] for output in nb.cells[0].outputs)


def _controls(page: str) -> list[tuple[str, str]]:
    """(label, the rest as text) for each control in ``page``."""
    return [(m["label"] or "", re.sub(r"<[^>]+>", "", m["rest"]).strip()) for m in CONTROL.finditer(page)]


def test_controls_show_their_label_and_final_value():
    shown = [
        widgets.IntSlider(3, min=0, max=9, description="stages"),
        widgets.FloatSlider(0.25, description="overlap"),
        widgets.FloatRangeSlider(value=[0.2, 0.6], min=0, max=1, description="range"),
        widgets.SelectionSlider(options=["1", "2", "4"], value="4", description="microbatches"),
        widgets.Dropdown(options=["pcie4", "nvlink3"], value="nvlink3", description="inside"),
        widgets.SelectMultiple(options=["a", "b", "c"], value=["a", "c"], description="pick"),
        widgets.Checkbox(True, description="overlap <b>on</b>"),
        widgets.Text("hello", description="name"),
    ]
    assert _controls(_snapshot(*shown)) == [
        ("stages", "3"),
        ("overlap", "0.25"),
        ("range", "0.20 – 0.60"),
        ("microbatches", "4"),
        ("inside", "nvlink3"),
        ("pick", "a, c"),
        ("overlap &lt;b&gt;on&lt;/b&gt;", "on"),  # a description is text unless the widget allows HTML
        ("name", "hello"),
    ]


def test_toggle_buttons_show_every_option_with_the_chosen_one_marked():
    page = _snapshot(widgets.ToggleButtons(options=["gpipe", "1f1b"], value="1f1b", description="schedule"))
    assert _controls(page) == [("schedule", "gpipe 1f1b")]
    assert "gpipe <b class='pk-control-value'>1f1b</b>" in page


def test_controls_inside_boxes_and_output_areas_keep_their_labels():
    inner = widgets.IntSlider(5, description="k")
    out = widgets.Output()
    out.outputs = (
        {"output_type": "stream", "name": "stdout", "text": "a  b\n"},
        {"output_type": "display_data", "data": {course.WIDGET_VIEW: {"model_id": inner.model_id}}, "metadata": {}},
    )
    page = _snapshot(widgets.VBox([widgets.HBox([widgets.IntSlider(2, description="machines")]), out]))
    assert _controls(page) == [("machines", "2"), ("k", "5")]
    assert "<pre>a  b\n</pre>" in page


def test_a_solution_shows_its_code_in_a_closed_details_and_keeps_its_output():
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_markdown_cell("See [SPMD](../docs/glossary.md#spmd) and [the next](01_mirrored.ipynb)."),
            nbformat.v4.new_code_cell("answer = None  # write it", metadata={"tags": ["exercise"]}),
            nbformat.v4.new_code_cell(
                "answer = 6 * 7\nprint(answer)",
                metadata={"tags": ["solution"], "jupyter": {"source_hidden": True}},
                outputs=[nbformat.v4.new_output("stream", text="42\n")],
            ),
        ]
    )
    page = course.render(nb)
    details = re.findall(r'<details class="pk-solution">(.*?)</details>', page, flags=re.S)
    assert len(details) == 1 and "6</span>" in details[0]  # the code, highlighted, inside
    assert re.search(r"<details[^>]* open", page) is None
    assert page.count("answer</span>") == 3  # the stub's once, the solution's twice inside the details
    assert "42" in page.split("</details>")[1]  # its output, after the closed details
    assert 'href="glossary.html#spmd"' in page and 'href="01_mirrored.html"' in page
