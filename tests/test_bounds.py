"""The bounds the package is held to, measured on its source: each test names what breaks its bound.

- every module at most 500 lines;
- every function's body at most 60 code lines (not blank, not a comment, not the docstring);
- ``SingleDevice``'s import closure (the modules its module imports at load time, and theirs) at most
  18 modules and 4,000 lines;
- every module imported at load time by at most 20 others (its fan-in), but the vocabulary
  (``core/types.py``: the types, the mesh axes' names, what a count is), which imports nothing of
  the package and is there to be read by every module;
- no public name of a module used only in its own module: each is read elsewhere (another module,
  the tests, notebooks, benchmarks, docs or examples), or private;
- one home for the host-link model: the cost model's (``TopologyModel`` on a ``Cluster`` with host
  ``Link``s), which the traffic report, measured bytes only, does not import.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import parallelkit as pk
from parallelkit.measure import costmodel, traffic
from parallelkit.measure.costmodel import Cluster, Link, Workload, communication_seconds

PACKAGE = Path(pk.__file__).parent
READERS = ("tests", "notebooks", "benchmarks", "docs", "examples")  # beside the package, where a name may be read
MODULE_LINES, FUNCTION_CODE_LINES, CLOSURE_MODULES, CLOSURE_LINES, FAN_IN = 500, 60, 18, 4000, 20
VOCABULARY = "parallelkit.core.types"  # read by every module that speaks of a tree, a batch, a mesh axis or a count


def _sources() -> dict[str, Path]:
    """Every module of parallelkit by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _code_lines(source: str) -> set[int]:
    """The numbers of the lines that hold code: a token other than a comment or layout."""
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def _body_code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef, code: set[int]) -> int:
    """How many code lines ``function``'s body holds, its docstring left out (nested functions counted in)."""
    body = function.body[1:] if ast.get_docstring(function, clean=False) is not None else function.body
    return len([n for n in code if body[0].lineno <= n <= function.end_lineno]) if body else 0


def long_functions(path: Path, limit: int) -> list[str]:
    """``module:line name (count)`` for each function in ``path`` whose body has more than ``limit`` code lines."""
    source = path.read_text()
    code = _code_lines(source)
    functions = (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    counted = ((f, _body_code_lines(f, code)) for f in functions)
    where = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path
    return [f"{where}:{f.lineno} {f.name} ({n})" for f, n in counted if n > limit]


def _load_time_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The parallelkit modules ``name`` imports when it loads: module-level imports, those under
    ``if TYPE_CHECKING:`` left out; a name imported from a package counts as its submodule, if it is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If):
                visit(node.orelse if "TYPE_CHECKING" in ast.unparse(node.test) else [*node.body, *node.orelse])
            elif isinstance(node, ast.Try):
                visit([*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)])
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)

    visit(ast.parse(path.read_text()).body)
    return found & modules.keys()


def import_closure(start: str) -> dict[str, int]:
    """Every parallelkit module ``start`` loads through its own imports and theirs, with its line count.

    The package ``__init__`` files Python runs on the way (``parallelkit``'s imports every public
    name) are left out unless imported by name: this is what the module itself needs.
    """
    modules, seen, waiting = _sources(), {}, [start]
    while waiting:
        name = waiting.pop()
        if name not in seen:
            seen[name] = len(modules[name].read_text().splitlines())
            waiting += _load_time_imports(name, modules[name], modules)
    return seen


def test_every_module_is_at_most_500_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in _sources().items()}
    over = {name: n for name, n in lengths.items() if n > MODULE_LINES}
    assert not over, f"Modules over {MODULE_LINES} lines (split each by what it holds): {over}"


def test_every_function_body_is_at_most_60_code_lines():
    over = [found for path in _sources().values() for found in long_functions(path, FUNCTION_CODE_LINES)]
    assert not over, f"Functions whose body is over {FUNCTION_CODE_LINES} code lines (name their steps): {over}"


def test_the_function_measure_counts_code_not_its_docstring_comments_or_blank_lines(tmp_path):
    body = "\n".join(f"    x{i} = {i}  # a comment\n\n    # a comment line" for i in range(61))
    (tmp_path / "m.py").write_text(f'def long():\n    """A docstring\n\n    of lines."""\n{body}\n')
    (tmp_path / "n.py").write_text('def short():\n    """Only a docstring."""\n')
    assert [line.split("/")[-1] for line in long_functions(tmp_path / "m.py", 60)] == ["m.py:1 long (61)"]
    assert long_functions(tmp_path / "m.py", 61) == [] == long_functions(tmp_path / "n.py", 0)


def test_single_devices_import_closure_is_at_most_18_modules_and_4000_lines():
    closure = import_closure("parallelkit.strategies.single")
    assert "parallelkit.measure.costmodel" not in closure  # the traffic report's bytes need no cost model
    assert "parallelkit.measure.traffic" not in closure  # loaded when a strategy is asked for its traffic
    lines = sum(closure.values())
    assert len(closure) <= CLOSURE_MODULES and lines <= CLOSURE_LINES, (
        f"SingleDevice loads {len(closure)} modules ({lines} lines), over {CLOSURE_MODULES} modules or "
        f"{CLOSURE_LINES} lines: {closure}"
    )


def fan_in() -> dict[str, set[str]]:
    """Each parallelkit module's importers: the modules that import it when they load."""
    modules, importers = _sources(), {}
    for name, path in modules.items():
        for imported in _load_time_imports(name, path, modules) - {name}:
            importers.setdefault(imported, set()).add(name)
    return importers


def test_no_module_but_the_vocabulary_is_imported_by_more_than_20():
    wide = {name: len(by) for name, by in fan_in().items() if len(by) > FAN_IN and name != VOCABULARY}
    assert not wide, f"Modules imported by more than {FAN_IN} others (move what they come for where it is used): {wide}"


def test_the_vocabulary_imports_nothing_of_the_package():
    modules = _sources()
    assert not _load_time_imports(VOCABULARY, modules[VOCABULARY], modules)
    assert len(fan_in()[VOCABULARY]) > FAN_IN  # the exemption is needed: every room speaks it


def test_the_closure_follows_imports_from_packages_and_leaves_out_type_checking_ones():
    closure = import_closure("parallelkit.strategies.pipeline.step")
    assert {"parallelkit.strategies.pipeline.stages", "parallelkit.measure.traffic"} <= closure.keys()
    assert "parallelkit.strategies.pipeline.strategy" not in closure  # imported under TYPE_CHECKING only


def public_names(path: Path) -> list[str]:
    """The names a module defines at its top level (functions, classes, assignments) that do not start with ``_``."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)]
    return [name for name in names if not name.startswith("_")]


def read_only_at_home(modules: dict[str, Path], readers: list[Path]) -> list[str]:
    """``module.name`` for each public name no other text names: not another module, nor any of ``readers``."""
    texts = {name: path.read_text() for name, path in modules.items()}
    elsewhere = [path.read_text() for path in readers]
    lonely = []
    for module, path in modules.items():
        for name in public_names(path):
            named = re.compile(rf"\b{re.escape(name)}\b")
            others = (text for other, text in texts.items() if other != module)
            if not any(named.search(text) for text in [*others, *elsewhere]):
                lonely.append(f"{module}.{name}")
    return lonely


def test_every_public_name_is_read_outside_its_module():
    root = PACKAGE.parent
    readers = [p for d in READERS for p in (root / d).rglob("*") if p.suffix in (".py", ".ipynb", ".md")]
    lonely = read_only_at_home(_sources(), readers)
    assert not lonely, f"Public names used only in their own module (make each private, or remove it): {lonely}"


def test_the_public_name_measure_sees_a_lonely_name_and_not_a_read_one(tmp_path):
    (tmp_path / "a.py").write_text("USED = 1\nLONELY, _PRIVATE = 2, 3\n\n\ndef helper():\n    return LONELY\n")
    (tmp_path / "b.py").write_text("from a import USED\n")
    (tmp_path / "notes.md").write_text("`helper` is read here.\n")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert read_only_at_home(modules, [tmp_path / "notes.md"]) == ["a.LONELY"]


# One link model: the host's links are the cost model's, and the traffic report holds measured bytes only.


def test_the_traffic_report_does_not_import_the_cost_model():
    modules = _sources()
    imported = _load_time_imports("parallelkit.measure.traffic", modules["parallelkit.measure.traffic"], modules)
    assert not {m for m in imported if m.startswith("parallelkit.measure.costmodel")}


def test_the_topology_model_is_the_cost_models_and_keeps_its_old_import_path():
    for name in ("TopologyModel", "TOPOLOGY", "register_topology"):
        assert getattr(traffic, name) is getattr(costmodel, name)
    from parallelkit.measure.traffic import TopologyModel

    assert TopologyModel is pk.costmodel.TopologyModel
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        traffic.Nothing  # noqa: B018


def test_the_topology_models_host_links_are_links_of_its_cluster():
    model = costmodel.TopologyModel(device_link_GBps=300, host_link_GBps=25, host_total_GBps=50, latency_us=5)
    cluster = model.cluster(8)
    assert (cluster.machines, cluster.devices_per_machine) == (1, 8)
    assert (cluster.inside.GBps, cluster.host.GBps, cluster.host_side.GBps) == (300, 25, 50)
    assert {link.latency_us for link in (cluster.inside, cluster.host, cluster.host_side)} == {5}
    no_peer = costmodel.TopologyModel(device_link_GBps=None, host_link_GBps=25).cluster(4)
    assert no_peer.inside == no_peer.host and no_peer.host_side is None


@pytest.mark.parametrize("total", [50, None], ids=["host-side", "no-host-limit"])
def test_central_storage_and_parameter_servers_are_timed_by_one_formula_each(total):
    model = costmodel.TopologyModel(device_link_GBps=300, host_link_GBps=25, host_total_GBps=total, latency_us=5)
    work, p = Workload(8e6, 0.0, 1), 8e6
    cluster = model.cluster(8)
    assert model.central_seconds(p, 8) == communication_seconds(work, cluster, "central_storage")
    assert model.parameter_server_seconds(p, 8, 4) == communication_seconds(work, cluster, "parameter_server", shards=4)
    own, shared = 5e-6 + p / 25e9, 5e-6 + (8 * p / 50e9 if total else 0.0)  # by hand: the slower side sets the time
    assert model.central_seconds(p, 8) == pytest.approx(2 * max(own, shared))


def test_a_clusters_host_links_time_the_cost_models_central_storage_and_parameter_servers():
    fast, pcie, side = Link("fast", 100, 2, "by hand"), Link("pcie", 25, 5, "by hand"), Link("host", 50, 5, "by hand")
    work, p = Workload(param_bytes=8e6, seconds_per_sample=1e-3, batch_per_device=16), 8e6
    plain = Cluster(1, 4, fast)  # no host links: each device's own is the inside link, the host side unlimited
    assert communication_seconds(work, plain, "central_storage") == pytest.approx(2 * (2e-6 + p / 100e9))
    assert communication_seconds(work, plain, "parameter_server", shards=2) == pytest.approx(2 * (2e-6 + p / 100e9))
    hosted = Cluster(1, 4, fast, host=pcie, host_side=side)
    assert communication_seconds(work, hosted, "central_storage") == pytest.approx(2 * (5e-6 + 4 * p / 50e9))
    # 2 shards, each carrying 4 workers' P/2 = 2P through its 50 GB/s host side; each worker's 25 GB/s link P
    assert communication_seconds(work, hosted, "parameter_server", shards=2) == pytest.approx(
        2 * (5e-6 + max(p / 25e9, 2 * p / 50e9))
    )
