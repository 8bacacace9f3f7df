"""The package's layering, read from its source: no import cycle, and no tool that dispatches on a strategy's class.

Both tests parse every module of ``parallelkit`` with :mod:`ast`; imports under
``if TYPE_CHECKING:`` are left out (they never run), every other import counts,
those inside functions included.
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
from pathlib import Path

import parallelkit as pk
from parallelkit.strategies import catalog
from parallelkit.strategies.base import Strategy

PACKAGE = Path(pk.__file__).parent
SELF_DESCRIBING = ("strategies",)  # the package that may know its own classes
# The layers, lowest first: a module imports only from its own layer and those below it.
LAYERS = {
    "core": 0,  # state, step, contracts, protocol, devices, mesh, axes, partition
    "models": 1, "data": 1,  # what is trained, and the layers that communicate (models/layers): only the core
    "measure": 1,  # reading compiled programs, traces and clocks: the core and the protocol
    "strategies": 2,  # the core and the measuring tools (each reports its own traffic)
    "run": 3,  # the training loop, callbacks, checkpoints, prefetching, processes
    "planner": 3,  # which strategy: models' shapes, memory per device, layouts ranked (it builds strategies)
    "viz": 4, "widgets": 4,  # views: figures and widgets
    "course": 5, "__main__": 5, "": 5,  # the course, the command line and the package's own namespace
}  # fmt: skip


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of parallelkit by dotted name: (its file, whether it is a package's ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    skipped = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)}
    return (n for n in ast.walk(tree) if id(n) not in skipped)


def _imports(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """The parallelkit modules ``name`` imports (a name imported from a package counts as its submodule, if one)."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            subs = {f"{base}.{alias.name}" for alias in node.names} & set(modules)
            targets |= subs | ({base} if len(subs) < len(node.names) else set())
    return {t for t in targets if t in modules and t != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_inside_parallelkit():
    modules = _modules()
    graph = {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}
    assert graph["parallelkit.measure.traffic"], "the import graph found no imports: the parser reads nothing"
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def _layer(module: str) -> int:
    """The layer of a dotted module name: its first part below ``parallelkit``."""
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one, as ``importer -> imported``."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))


def test_each_layer_imports_only_itself_and_the_layers_below():
    modules = _modules()
    assert {name.split(".")[1] for name in modules if "." in name} <= set(LAYERS), "a folder with no layer"
    graph = {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}
    assert not _upward(graph), "imports that go up the layers:\n" + "\n".join(_upward(graph))


def _private_imports(path: Path) -> list[str]:
    """The ``_``-prefixed names ``path`` imports from other modules (``from m import _name``), dunders aside."""
    return [
        f"{node.module or '.'}.{alias.name}"
        for node in _runtime_nodes(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore belongs to its module: a second user makes it public."""
    found = {name: names for name, (path, _) in _modules().items() if (names := _private_imports(path))}
    assert not found, f"modules importing another module's private names: {found}"


def test_the_private_import_check_sees_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from .contract import _hidden, public\nfrom os import __name__\n")
    assert _private_imports(module) == ["contract._hidden"]


def test_the_layer_check_sees_an_upward_import():
    graph = {"parallelkit.core.step": {"parallelkit.strategies.base"}, "parallelkit.run.training": {"parallelkit.core"}}
    assert _upward(graph) == ["parallelkit.core.step -> parallelkit.strategies.base"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _strategy_classes() -> dict[str, type]:
    """Every concrete strategy class parallelkit defines, by name."""
    found = {}
    for package in (pk.strategies, pk.strategies.pipeline):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            module = __import__(info.name, fromlist=["_"])
            found |= {
                name: cls
                for name, cls in vars(module).items()
                if inspect.isclass(cls) and issubclass(cls, Strategy) and cls is not Strategy
            }
    return found


def _dispatches(path: Path, classes: set[str], labels: set[str]) -> list[str]:
    """Lines of ``path`` that ask ``isinstance``/``issubclass``/``type(...) is`` of a strategy class, or compare
    with a strategy's class name or catalog name."""

    def named(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Tuple):
            return set().union(*(named(e) for e in node.elts))
        if isinstance(node, ast.Name):
            return {node.id}
        if isinstance(node, ast.Attribute):
            return {node.attr}
        return set()

    found = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
            if len(node.args) == 2 and named(node.args[1]) & classes:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            strings = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
            is_type = any(isinstance(o, ast.Call) and getattr(o.func, "id", None) == "type" for o in operands)
            if strings & (classes | labels) or (is_type and set().union(*map(named, operands)) & classes):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_tool_dispatches_on_a_strategy_class_or_name():
    classes, labels = set(_strategy_classes()), {e.name for e in catalog.entries()}
    assert {"SingleDevice", "CentralStorage", "Pipeline", "ParameterServer"} <= classes
    tools = [path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in SELF_DESCRIBING]
    found = [line for path in tools for line in _dispatches(path, classes, labels)]
    assert not found, (
        "tools that decide by a strategy's class or name (ask the strategy or the catalog):\n" + "\n".join(found)
    )


def test_the_dispatch_check_sees_dispatch(tmp_path):
    source = tmp_path / "tool.py"
    source.write_text(
        "def f(s, name):\n"
        "    if isinstance(s, (int, pk.Pipeline)):\n        pass\n"
        "    if type(s) is SingleDevice:\n        pass\n"
        "    return name == 'Mirrored(jit)'\n"
    )
    assert len(_dispatches(source, {"Pipeline", "SingleDevice"}, {"Mirrored(jit)"})) == 3


def test_no_strategy_inherits_more_than_one_level_below_its_family():
    """Every strategy subclasses Strategy (the protocol's defaults) directly, or one family base that does:
    SPMD (a mesh and rules of one's own) or OffDeviceStrategy (central storage, parameter servers); or Parallel,
    SPMD by axis sizes, whose one-axis spellings are the presets. No deeper ladder."""
    from parallelkit.strategies.offdevice import OffDeviceStrategy
    from parallelkit.strategies.parallel import Parallel
    from parallelkit.strategies.spmd import SPMD

    allowed = ([Strategy], [SPMD, Strategy], [OffDeviceStrategy, Strategy], [Parallel, SPMD, Strategy])
    for name, cls in _strategy_classes().items():
        ancestors = [c for c in cls.__mro__[1:] if c.__module__.startswith("parallelkit")]
        assert ancestors in allowed, f"{name} inherits {[c.__name__ for c in ancestors]}"


def _missing_names(path: Path) -> list[str]:
    """The names ``path`` imports from parallelkit, at any depth of its code, that parallelkit does not have."""
    import importlib

    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "parallelkit":
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:  # a submodule, imported by name
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ModuleNotFoundError:
                        missing.append(f"{path.name}:{node.lineno}: {node.module}.{alias.name}")
    return missing


def test_scripts_import_only_names_the_package_has():
    """The benchmarks and examples import parts of the kit inside functions, which run only in a child process or
    a long run: a name the package lost would fail there, far from the change that lost it."""
    scripts = sorted((PACKAGE.parent / "benchmarks").glob("*.py")) + sorted((PACKAGE.parent / "examples").glob("*.py"))
    assert len(scripts) > 10
    missing = [name for path in scripts for name in _missing_names(path)]
    assert not missing, "imported from parallelkit but not defined there:\n" + "\n".join(missing)


def test_the_script_import_check_sees_a_lost_name(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text("def main():\n    from parallelkit.course.bench import _model, trained_params\n")
    assert _missing_names(script) == ["bench.py:2: parallelkit.course.bench.trained_params"]
