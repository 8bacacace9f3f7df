"""The static course: executed notebooks and the reference pages as HTML, and the API reference."""

from __future__ import annotations

import base64
import copy
import html
import json
import os
import re
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import nbformat

from .arc import arc_svg, lessons
from .arc import title as notebook_title

if TYPE_CHECKING:
    from traitlets.config import Config

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
ROOT = Path(__file__).resolve().parents[2]  # the checkout (pip install -e .)
NOTEBOOKS = ROOT / "notebooks"
_DOCS = (  # the reference pages of docs/: the course's list, then the README's table of them, in its order
    "course.md",
    "training.md",
    "strategies.md",
    "cost_model.md",
    "memory.md",
    "pipelines.md",
    "sequences_and_experts.md",
    "planner.md",
    "multi_host.md",
    "views.md",
    "honest_numbers.md",
    "rosetta.md",
    "glossary.md",
    "simulated_devices.md",
    "architecture.md",
    "development.md",
)
REFERENCES = (ROOT / "README.md", *(ROOT / "docs" / name for name in _DOCS))  # Markdown pages, after the notebooks'
API = "api"  # the folder of the API reference pdoc writes beside the pages
_SOLUTION = "solution"  # the tag of an exercise's solution cell, hidden until the learner opens it


def execute(path: Path, workdir: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run a notebook top to bottom in a fresh kernel whose working directory is ``workdir``.

    The kernel starts without this process's ``XLA_FLAGS`` and ``PJRT_NPROC``, as a
    learner's would, so the notebook chooses its own devices. The file is not modified;
    the executed notebook (outputs, and the widgets' final state) is returned.

    Raises:
      nbclient.exceptions.CellExecutionError: a cell raised; the message shows the cell and its error.
    """
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    saved = {key: os.environ.pop(key) for key in ("XLA_FLAGS", "PJRT_NPROC") if key in os.environ}
    try:
        with tempfile.TemporaryDirectory() as sockets:
            client = NotebookClient(
                nb,
                timeout=timeout,
                kernel_name="python3",
                store_widget_state=True,
                resources={"metadata": {"path": str(workdir)}},
                config=_kernel_transport(Path(sockets)),
            )
            client.execute()
    finally:
        os.environ.update(saved)
    return nb


def _kernel_transport(sockets: Path) -> Config:
    """The kernel manager's settings: on Linux and macOS the kernel listens on socket files in
    ``sockets`` (a private temporary folder) instead of TCP ports on localhost, which any local
    process can reach and about which ipykernel warns at every start; elsewhere, TCP as by default."""
    from traitlets.config import Config

    if os.name != "posix":
        return Config()
    return Config({"KernelManager": {"transport": "ipc", "ip": str(sockets / "kernel")}})


def snapshot_widgets(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Replace every widget view in ``nb``'s outputs by HTML of the widget's final state.

    The state is what the executing kernel stored in the notebook's metadata. Returns
    ``nb``, changed in place; a view whose state was not stored becomes a note saying so.
    """
    states = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            view = output.get("data", {}).get(WIDGET_VIEW)
            if view is not None:
                output["data"] = {"text/html": _widget_html(view["model_id"], states)}
    nb.metadata.pop("widgets", None)  # nothing left for a widget manager to render
    return nb


def _widget_html(model_id: str, states: Mapping[str, dict]) -> str:
    model = states.get(model_id)
    if model is None:
        return "<p class='pk-widget-missing'><i>(a live widget: run the notebook to see it)</i></p>"
    name, state = model.get("model_name", ""), model.get("state", {})
    classes = html.escape(" ".join(["pk-widget", *state.get("_dom_classes", [])]), quote=True)  # the widget's CSS
    if name in ("HTMLModel", "HTMLMathModel", "LabelModel"):
        return f"<div class='{classes}'>{_label(state)}{state.get('value', '')}</div>"
    if name in ("FloatProgressModel", "IntProgressModel"):
        value, top = state.get("value", 0), state.get("max", 100)
        return f"<div class='{classes}'>{_label(state)}<progress value='{value}' max='{top}'></progress></div>"
    if name == "ImageModel":  # the bytes travel as a base64 buffer beside the state
        buffers = {tuple(b["path"]): b["data"] for b in model.get("buffers", []) if b.get("encoding") == "base64"}
        data = buffers.get(("value",)) or base64.b64encode(state.get("value") or b"").decode()
        return f"<img class='{classes}' src='data:image/{state.get('format', 'png')};base64,{data}'>"
    if name == "OutputModel":
        outputs = "".join(_output_html(output, states) for output in state.get("outputs", []))
        return f"<div class='{classes}'>{outputs}</div>"
    if "children" in state:  # VBox, HBox, Box, Accordion, Tab: their children, in order
        direction = "row" if name == "HBoxModel" else "column"
        children = "".join(_widget_html(child.removeprefix("IPY_MODEL_"), states) for child in state["children"])
        return f"<div class='{classes}' style='display:flex;flex-direction:{direction};gap:4px'>{children}</div>"
    return f"<div class='{classes} pk-control'>{_label(state)}{_control_value(name, state)}</div>"


def _label(state: Mapping) -> str:
    """A widget's description, shown before it as the live widget does ('' when it has none)."""
    text = state.get("description") or ""
    if not text:
        return ""
    shown = text if state.get("description_allow_html") else html.escape(text)
    return f"<span class='pk-control-label' style='margin-right:6px'>{shown}</span>"


def _control_value(name: str, state: Mapping) -> str:
    """A control's final value as text: a slider's readout, the chosen option, a box's text, on or off.

    Toggle buttons and radio buttons show every option, the chosen one in bold, as they do live.
    """
    if "_options_labels" in state:  # Dropdown, Select, SelectionSlider, ToggleButtons, ...: options by index
        labels, index = state["_options_labels"], state.get("index")
        chosen = {i for i in (index if isinstance(index, list | tuple) else [index]) if i is not None}
        if name in ("ToggleButtonsModel", "RadioButtonsModel"):
            return " ".join(
                f"<b class='pk-control-value'>{html.escape(label)}</b>" if i in chosen else html.escape(label)
                for i, label in enumerate(labels)
            )
        shown = [labels[i] for i in sorted(chosen)]
    else:
        value = state.get("value")
        if isinstance(value, bool):  # Checkbox, ToggleButton
            shown = ["on" if value else "off"]
        else:
            shown = [
                _readout(v, state.get("readout_format"))
                for v in (value if isinstance(value, list | tuple) else [value])
            ]
    separator = " – " if name.endswith("RangeSliderModel") else ", "
    return f"<b class='pk-control-value'>{html.escape(separator.join(shown))}</b>"


def _readout(value: object, spec: str | None) -> str:
    """A number as the slider's readout shows it (``readout_format``, e.g. ``.2f``); anything else as text."""
    if value is None:
        return ""
    try:
        return format(value, spec) if spec and isinstance(value, int | float) else str(value)
    except ValueError:  # a format Python does not know: the plain number
        return str(value)


def _output_html(output: Mapping, states: Mapping[str, dict]) -> str:
    """One output of an Output widget, as HTML (the same preference order as a notebook page)."""
    if output.get("output_type") == "stream":
        return _text_html(output.get("text", ""))
    data = output.get("data", {})
    if WIDGET_VIEW in data:  # a widget displayed inside the output area
        return _widget_html(data[WIDGET_VIEW]["model_id"], states)
    if "image/png" in data:
        return f"<img src='data:image/png;base64,{data['image/png']}'>"
    if "text/html" in data:
        return "".join(data["text/html"])
    if "text/plain" in data:
        return _text_html("".join(data["text/plain"]))
    return ""


def _text_html(text: str) -> str:
    """Printed text in the page's monospace text style, so that columns stay aligned."""
    return f"<div class='jp-RenderedText'><pre>{html.escape(text)}</pre></div>"


def render(nb: nbformat.NotebookNode, title: str = "parallelkit") -> str:
    """An executed notebook as one self-contained HTML page (figures embedded, widgets as snapshots).

    Links to a reference page (``../docs/glossary.md#spmd`` from a notebook, ``docs/training.md`` from
    the README, ``planner.md`` between pages of ``docs/``) or to another notebook (``01_mirrored.ipynb``)
    point to its page in the course. A solution cell (tagged ``solution``) shows its code in a closed
    ``<details>``, its output as usual.
    """
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", mathjax_url="", require_js_url="", jquery_url="")
    page = _hide_solutions(snapshot_widgets(copy.deepcopy(nb)))  # the caller's notebook stays as it is
    body, _ = exporter.from_notebook_node(page, resources={"metadata": {"name": title}})
    for reference in REFERENCES:
        linked = rf'href="(?:\.\./)?(?:docs/)?{re.escape(reference.name)}(#[^"]*)?"'
        body = re.sub(linked, rf'href="{reference.stem}.html\1"', body)
    body = re.sub(r'href="(\d\d_\w+)\.ipynb(#[^"]*)?"', r'href="\1.html\2"', body)
    return re.sub(r"<script src=\"\">\s*</script>", "", body)  # the loaders of scripts no page here needs


def _hide_solutions(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Put each solution cell's code in a closed ``<details>`` before the cell, which keeps only its outputs.

    Returns ``nb``, changed in place.
    """
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    cells = []
    for cell in nb.cells:
        if cell.cell_type == "code" and _SOLUTION in cell.metadata.get("tags", []):
            code = highlight(cell.source, PythonLexer(), HtmlFormatter(cssclass="highlight hl-ipython3"))
            code = code.strip().replace("\n", "&#10;")  # one line: a blank line would end Markdown's HTML block
            shown = f"<details class='pk-solution'><summary>Solution (open it after trying)</summary>{code}</details>"
            cells.append(nbformat.v4.new_markdown_cell(shown))
            cell.metadata["transient"] = {"remove_source": True}
        cells.append(cell)
    nb.cells = cells
    return nb


def build(
    out_dir: Path, executed: Mapping[str, nbformat.NotebookNode] | None = None, notebooks: Sequence[Path] | None = None
) -> list[Path]:
    """Write the course to ``out_dir``: ``index.html``, one page per notebook, then the reference pages.

    Args:
      out_dir: where the pages go (created).
      executed: notebooks already executed, by file name; the others are run here.
      notebooks: the notebooks of the course, in order (``notebooks/*.ipynb`` of the checkout by default).

    Returns:
      The pages written: the index, the notebooks' in order, the references' (the README, then
      ``docs/``). The API reference goes to ``out_dir/api`` (:func:`_api_reference`), linked from the index.
    """
    paths = sorted(NOTEBOOKS.glob("*.ipynb")) if notebooks is None else list(notebooks)
    if not paths:
        raise FileNotFoundError(f"No notebooks to render: {NOTEBOOKS} has no .ipynb files (build from a checkout).")
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = executed or {}
    seconds = recorded_seconds()  # a notebook run here shows the time it took here instead
    pages = []
    for path in paths:
        nb = executed.get(path.name)
        if nb is None:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory() as workdir:
                nb = execute(path, Path(workdir))
            seconds[path.name] = time.perf_counter() - started
        pages.append(_write_page(out_dir / f"{path.stem}.html", nb))
    for reference in REFERENCES:  # a Markdown page, rendered as a notebook of one cell
        text = reference.read_text(encoding="utf-8")
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(text)])
        pages.append(_write_page(out_dir / f"{reference.stem}.html", nb))
    _api_reference(out_dir / API)
    index = out_dir / "index.html"
    index.write_text(_index_html(pages, arc_svg(lessons(paths), seconds)), encoding="utf-8")
    return [index, *(page for page, _ in pages)]


def _api_reference(out_dir: Path) -> Path:
    """Write the API reference of :mod:`parallelkit`, generated from its docstrings by pdoc, to ``out_dir``.

    Returns:
      The reference's first page (``out_dir/parallelkit.html``).
    """
    import warnings

    import pdoc
    import pdoc.render

    from .. import viz

    pdoc.render.configure(docformat="google", footer_text="parallelkit")
    with warnings.catch_warnings():  # annotations named only under TYPE_CHECKING are shown as written
        warnings.filterwarnings("ignore", "Error parsing type annotation", UserWarning)
        # the old names of moved modules warn as they load, and are not the reference: left out
        warnings.filterwarnings("ignore", ".*the old name goes in parallelkit 0.2", DeprecationWarning)
        for name in viz.__all__:  # the views load when first asked for: pdoc reads the module's namespace
            getattr(viz, name)
        pdoc.pdoc("parallelkit", "!parallelkit.widgets", "!parallelkit.widgets.*", output_directory=out_dir)
    return out_dir / "parallelkit.html"


def recorded_seconds() -> dict[str, float]:
    """Each notebook's run time as ``benchmarks/results/notebooks.json`` records it (empty without the file)."""
    record = ROOT / "benchmarks" / "results" / "notebooks.json"
    return dict(json.loads(record.read_text())["seconds"]) if record.exists() else {}


def _write_page(page: Path, nb: nbformat.NotebookNode) -> tuple[Path, str]:
    """Render ``nb`` to ``page``, titled by its first heading; return the page and the title."""
    title = notebook_title(nb, page.stem)
    page.write_text(render(nb, title), encoding="utf-8")
    return page, title


def _index_html(entries: Iterable[tuple[Path, str]], picture: str) -> str:
    items = "\n".join(f"<li><a href='{page.name}'>{html.escape(title)}</a></li>" for page, title in entries)
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>parallelkit course</title></head>\n"
        "<body><h1>parallelkit: the course</h1>\n"
        "<p>Each page is a notebook as it ran top to bottom; widgets show their final state.</p>\n"
        "<p>The arc: each notebook, what you will be able to do after it, and how long it ran. An arrow\n"
        "leads from each notebook to the later ones that build on it.</p>\n"
        f"{picture}\n<ol>\n{items}\n</ol>\n"
        f"<p>The <a href='{API}/parallelkit.html'>API reference</a>, generated from the docstrings.</p>\n"
        "</body></html>\n"
    )
