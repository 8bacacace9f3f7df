"""Names that moved keep working for one release, each with a DeprecationWarning that names its new home;
the views' one room, ``pk.viz``, loads each view only when asked for."""

from __future__ import annotations

import importlib
import sys

import jax
import pytest
from helpers import run_python

import parallelkit as pk
from parallelkit.core.renamed import REMOVED_IN, renamed
from parallelkit.measure import gradsync
from parallelkit.planner import ModelShape


@pytest.mark.parametrize(
    ("read", "new", "expected"),
    [
        (lambda: pk.allreduce, "parallelkit.collectives", lambda: pk.collectives),
        (lambda: pk.LAZY, "parallelkit._LAZY", lambda: pk._LAZY),
        (lambda: pk.planner.Transformer, "parallelkit.planner.ModelShape", lambda: ModelShape),
        (
            lambda: gradsync.ring_allreduce,
            "parallelkit.measure.gradsync.ring_allreduce_trace",
            lambda: gradsync.ring_allreduce_trace,
        ),
    ],
    ids=["pk.allreduce", "pk.LAZY", "planner.Transformer", "gradsync.ring_allreduce"],
)
def test_an_old_name_warns_and_is_the_new_one(read, new, expected):
    with pytest.warns(DeprecationWarning, match=rf"is now {new}, and the old name goes in parallelkit {REMOVED_IN}"):
        old = read()
    assert old is expected()


@pytest.mark.parametrize("name", ["megatron_mlp_rules", "megatron_cnn_rules", "megatron_transformer_rules"])
def test_the_megatron_rules_live_beside_their_models_and_their_old_names_warn(name):
    moved = rf"parallelkit.core.partition.{name} is now parallelkit.models.megatron.{name}"
    with pytest.warns(DeprecationWarning, match=moved):
        old = getattr(pk.partition, name)
    assert old is getattr(pk.models, name) is getattr(importlib.import_module("parallelkit.models.megatron"), name)


def test_the_old_planner_name_imports_from_the_package():
    with pytest.warns(DeprecationWarning, match="planner.Transformer is now parallelkit.planner.ModelShape"):
        from parallelkit.planner import Transformer
    assert Transformer is ModelShape
    assert Transformer(layers=1, d_model=8, heads=2, ffn=32, vocab=16, seq=4).params > 0


def test_a_name_that_never_was_is_still_an_attribute_error():
    for module, name in ((pk, "allreduces"), (pk.planner, "Transformers"), (gradsync, "ring"), (pk.partition, "mlp")):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(module, name)
    with pytest.raises(AttributeError, match="module 'a.b' has no attribute 'c'"):
        renamed("a.b", {"d": "parallelkit:fit"})("c")


def test_the_course_names_the_all_reduces_by_hand_collectives():
    assert pk.collectives is importlib.import_module("parallelkit.strategies.allreduce")
    assert "allreduce" not in vars(pk)  # only the old name's warning path finds it


def _fresh_widgets() -> None:
    for name in [m for m in sys.modules if m == "parallelkit.widgets" or m.startswith("parallelkit.widgets.")]:
        del sys.modules[name]
    vars(pk).pop("widgets", None)


def test_the_old_views_package_warns_once_and_is_vizs():
    _fresh_widgets()
    with pytest.warns(DeprecationWarning, match="parallelkit.widgets is now parallelkit.viz") as caught:
        widgets = importlib.import_module("parallelkit.widgets")
        importlib.import_module("parallelkit.widgets.live")  # a second import: no second warning
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 1
    from parallelkit.widgets.dashboard import TimingDashboard
    from parallelkit.widgets.live import LiveTimes

    assert TimingDashboard is pk.viz.TimingDashboard and LiveTimes is pk.viz.LiveTimes
    for name in ("StrategyRace", "PipelineExplorer", "GradSyncExplorer", "RaceStandings", "in_notebook"):
        assert getattr(widgets, name) is getattr(pk.viz, name)
    assert pk.widgets is widgets


def test_pk_widgets_warns_as_it_loads():
    _fresh_widgets()
    with pytest.warns(DeprecationWarning, match="parallelkit.widgets is now parallelkit.viz"):
        assert pk.widgets.TimingDashboard is pk.viz.TimingDashboard


def test_the_timing_dashboard_imports_no_matplotlib_until_something_draws():
    result = run_python(
        "import sys\n"
        "import parallelkit as pk\n"
        "from parallelkit.viz import TimingDashboard, LiveTimes\n"
        "TimingDashboard(mode='text')\n"
        "assert 'matplotlib' not in sys.modules, 'the timing views imported matplotlib'\n"
        "assert 'ipywidgets' not in sys.modules, 'text mode imported ipywidgets'\n"
        "pk.viz.race_figure\n"
        "assert 'matplotlib' in sys.modules, 'a figure loaded without matplotlib?'\n"
    )
    assert result.returncode == 0, result.stderr


def test_every_view_is_found_in_its_module_and_listed():
    for name, module in pk.viz.HOMES.items():
        assert getattr(pk.viz, name) is getattr(importlib.import_module(f"parallelkit.viz.{module}"), name)
    assert sorted(pk.viz.__all__) == sorted(pk.viz.HOMES) and set(pk.viz.HOMES) <= set(dir(pk.viz))
    assert pk.viz.gradsync is importlib.import_module("parallelkit.viz.gradsync")  # a module by its own name
    with pytest.raises(AttributeError, match="module 'parallelkit.viz' has no attribute 'figure'"):
        pk.viz.figure  # noqa: B018


def test_each_model_gives_its_own_layers_and_the_free_function_asks_it():
    from flax import nnx

    for model in (
        pk.models.MLP(4, (8,), 2, rngs=nnx.Rngs(0)),
        pk.models.Transformer((4, 3), 2, dim=8, heads=2, depth=1, mlp_dim=8, rngs=nnx.Rngs(0)),
        pk.models.GPT(16, max_length=4, dim=8, heads=2, depth=1, mlp_dim=8, rngs=nnx.Rngs(0)),
    ):
        own, free = model.as_layers(), pk.models.as_layers(model)
        assert len(own.apply) == len(free.apply) and jax.tree.all(
            jax.tree.map(lambda a, b: bool((a == b).all()), own.params, free.params)
        )
    with pytest.raises(TypeError, match="as_layers knows the kit's MLP, Transformer and GPT, not CNN"):
        pk.models.as_layers(pk.models.CNN((8, 8, 1), 10, rngs=nnx.Rngs(0)))
