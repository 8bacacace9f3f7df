"""Figures plot exactly the data they are given, and the core never imports matplotlib."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import run_python
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

import parallelkit as pk
import parallelkit.viz as viz


@pytest.fixture
def small_params():
    return {"w": jnp.ones((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}


def _grid(fig: Figure) -> np.ndarray:
    return np.asarray(fig.axes[0].images[0].get_array())


def _cell_texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


def test_single_device_state_fills_one_column(small_params):
    strategy = pk.SingleDevice()
    rows = strategy.describe(strategy.init(small_params, optax.sgd(0.1)))
    ids = [d.id for d in jax.devices()]
    fig = viz.placement_figure(rows, devices=ids, title="one device")
    assert isinstance(fig, Figure)
    expected = np.zeros((len(rows), len(ids)))
    expected[:, ids.index(strategy.device.id)] = 1.0
    np.testing.assert_array_equal(_grid(fig), expected)
    assert _cell_texts(fig) == [viz.format_bytes(r.bytes_per_device) for r in rows]
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == [f"{viz.leaf_label(r.path)} {r.shape}" for r in rows]
    assert fig.axes[0].get_title() == "one device"


def test_mirrored_jit_state_is_a_full_copy_everywhere(small_params):
    strategy = pk.Mirrored(backend="jit")
    rows = strategy.describe(strategy.init(small_params, optax.adam(1e-3)))
    fig = viz.placement_figure(rows)  # columns: every device holding something
    np.testing.assert_array_equal(_grid(fig), np.ones((len(rows), strategy.num_replicas)))
    assert len(_cell_texts(fig)) == len(rows) * strategy.num_replicas
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    per_device = sum(r.bytes_per_device for r in rows)
    assert ticks == [f"{d.id}\n{viz.format_bytes(per_device)}" for d in strategy.devices]


def test_mirrored_pmap_state_is_a_full_copy_everywhere(small_params):
    strategy = pk.Mirrored(backend="pmap")
    rows = strategy.describe(strategy.init(small_params, optax.sgd(0.1)))
    fig = viz.placement_figure(rows)
    np.testing.assert_array_equal(_grid(fig), np.ones((len(rows), strategy.num_replicas)))


def test_sharded_batch_cells_hold_one_slice_each():
    strategy = pk.Mirrored(backend="jit")
    n = strategy.num_replicas
    batch = strategy.place_batch({"x": np.zeros((2 * n, 5), np.float32)})
    rows = strategy.describe(batch)
    assert rows[0].spec == str(P(pk.DATA))
    fig = viz.placement_figure(rows)
    np.testing.assert_allclose(_grid(fig), np.full((1, n), 1 / n))
    assert _cell_texts(fig) == [viz.format_bytes(2 * 5 * 4)] * n


def test_partly_replicated_leaf_on_a_subset_of_devices():
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip(f"needs 4 devices, JAX has {len(devices)}")
    mesh = jax.sharding.Mesh(np.array(devices[:4]).reshape(2, 2), (pk.DATA, pk.MODEL))
    leaf = jax.device_put(np.zeros((4, 6), np.float32), NamedSharding(mesh, P(pk.MODEL)))
    rows = pk.SingleDevice().describe({"w": leaf})
    ids = [d.id for d in devices]
    grid = _grid(viz.placement_figure(rows, devices=ids))
    expected = np.zeros((1, len(ids)))
    expected[0, [ids.index(d.id) for d in devices[:4]]] = 0.5  # halves, each held twice
    np.testing.assert_allclose(grid, expected)


def test_a_device_outside_the_columns_is_an_error(small_params):
    strategy = pk.Mirrored(backend="jit")
    rows = strategy.describe(strategy.init(small_params, optax.sgd(0.1)))
    with pytest.raises(ValueError, match="not among the columns"):
        viz.placement_figure(rows, devices=[strategy.devices[0].id])


def test_collectives_bars_equal_the_summary(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state = strategy.init(params, optax.adam(1e-3))
    found = pk.inspect.collectives(strategy.step(loss_fn), state, batch)
    gradient_bytes = pk.models.param_bytes(params)
    fig = viz.collectives_figure(found, gradient_bytes=gradient_bytes)
    ax = fig.axes[0]
    summary = pk.inspect.summarize(found)
    assert [t.get_text() for t in ax.get_xticklabels()] == list(summary)
    assert [p.get_height() for p in ax.patches] == [row["bytes"] for row in summary.values()]
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == [gradient_bytes, gradient_bytes]


def test_collectives_bars_in_canonical_order_with_counts():
    found = [
        pk.inspect.Collective("all-gather", ("f32[8]",), 8, 32, 2),
        pk.inspect.Collective("all-reduce", ("f32[4]",), 4, 16, 2),
        pk.inspect.Collective("all-gather", ("f32[2]",), 2, 8, 2),
    ]
    ax = viz.collectives_figure(found).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["all-reduce", "all-gather"]
    assert [p.get_height() for p in ax.patches] == [16, 40]
    assert [t.get_text().splitlines()[-1] for t in ax.texts] == ["1 op", "2 ops"]
    assert not ax.get_lines()


def test_no_collectives_draws_no_bars(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.SingleDevice()
    found = pk.inspect.collectives(strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1)), batch)
    assert found == []
    ax = viz.collectives_figure(found, gradient_bytes=100).axes[0]
    assert not ax.patches
    assert any("no collectives" in t.get_text() for t in ax.texts)


def test_figures_render_to_png(tmp_path, small_params):
    strategy = pk.Mirrored(backend="jit")
    rows = strategy.describe(strategy.init(small_params, optax.sgd(0.1)))
    for i, fig in enumerate([viz.placement_figure(rows), viz.collectives_figure([], 10)]):
        fig.savefig(tmp_path / f"{i}.png")
        assert (tmp_path / f"{i}.png").stat().st_size > 1000


def test_import_parallelkit_does_not_import_matplotlib():
    result = run_python(
        "import sys, parallelkit\n"
        "assert 'matplotlib' not in sys.modules, 'import parallelkit pulled in matplotlib'\n"
        "import parallelkit.viz\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'viz must not import pyplot'\n"
    )
    assert result.returncode == 0, result.stderr
