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
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

import parallelkit as pk
import parallelkit.viz as viz
from parallelkit.strategies.pipeline.schedules import gpipe_schedule


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
        "from parallelkit.measure import ceilings, flops, hardware, profile, roofline\n"
        "assert 'matplotlib' not in sys.modules, 'import parallelkit (or its measure/) pulled in matplotlib'\n"
        "import parallelkit.viz\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'viz must not import pyplot'\n"
    )
    assert result.returncode == 0, result.stderr


# -- placement of every strategy, drawn from describe() --------------------------------------

STRATEGIES = {
    "SingleDevice": lambda: pk.SingleDevice(),
    "Mirrored(jit)": lambda: pk.Mirrored(backend="jit"),
    "Mirrored(pmap)": lambda: pk.Mirrored(backend="pmap"),
    "CentralStorage": lambda: pk.CentralStorage(4),
    "ParameterServer": lambda: pk.ParameterServer(3, devices=2),
    "FullySharded(3)": lambda: pk.FullySharded(3, 4, min_size=4),
    "Hybrid(2x2)": lambda: pk.Hybrid(2, 2, rules=[("w", P("model", None)), (".*", P())], devices=jax.devices()[:4]),
}


def _hatched_cells(fig: Figure) -> set[tuple[int, int]]:
    """(leaf, device column) of every hatched (host-memory) cell."""
    return {(round(p.get_y() + 0.5), round(p.get_x() + 0.5)) for p in fig.axes[0].patches if p.get_hatch()}


@pytest.mark.parametrize("name", STRATEGIES)
def test_placement_figure_draws_describe_rows(name, small_params):
    strategy = STRATEGIES[name]()
    rows = strategy.describe(strategy.init(small_params, optax.adam(1e-3)))
    ids = [d.id for d in jax.devices()]
    fig = viz.placement_figure(rows, devices=ids, title=name)
    # Recomputed from the rows alone: bytes held / the leaf's bytes, on the devices that hold it.
    expected = np.zeros((len(rows), len(ids)))
    host, texts = set(), []
    for i, row in enumerate(rows):
        logical = int(np.prod(row.shape)) * np.dtype(row.dtype).itemsize
        for d in row.devices:
            expected[i, ids.index(d)] = row.bytes_per_device / logical
            if row.memory_kind == "pinned_host":
                host.add((i, ids.index(d)))
    for i, j in zip(*np.nonzero(expected), strict=True):
        texts.append(viz.format_bytes(rows[i].bytes_per_device) + ("\nhost" if (i, j) in host else ""))
    np.testing.assert_array_equal(_grid(fig), expected)
    assert _hatched_cells(fig) == host
    assert _cell_texts(fig) == texts
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == [f"{viz.leaf_label(r.path)} {r.shape}" for r in rows]
    kinds = viz.memory_kinds(rows, ids)
    assert {(i, j) for i, j in zip(*np.nonzero(kinds == "pinned_host"), strict=True)} == host
    legend = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert legend == (["host memory (pinned_host)"] if host else [])


def test_placement_per_strategy_says_where_state_lives(small_params):
    """What each figure above shows, stated per strategy from describe()."""
    n_leaves = None
    for name, make in STRATEGIES.items():
        strategy = make()
        rows = strategy.describe(strategy.init(small_params, optax.adam(1e-3)))
        devices = {r.devices for r in rows}
        kinds = {r.memory_kind for r in rows}
        if name == "SingleDevice":
            assert devices == {(strategy.device.id,)} and kinds == {"device"}
            n_leaves = len(rows)
        elif name.startswith("Mirrored"):
            assert devices == {tuple(d.id for d in strategy.devices)} and kinds == {"device"}
            assert all(r.copies == strategy.num_replicas for r in rows) and len(rows) == n_leaves
        elif name == "CentralStorage":  # one copy of everything, in host memory beside one device
            assert devices == {(strategy.devices[0].id,)} and kinds == {"pinned_host"}
            assert all(r.copies == 1 for r in rows) and len(rows) == n_leaves
        elif name in ("FullySharded(3)", "Hybrid(2x2)"):  # w (4 x 3) split in two or four, on all 4 devices
            split = 4 if name.startswith("Fully") else 2
            assert devices == {tuple(d.id for d in strategy.devices)} and kinds == {"device"}
            w = [r for r in rows if r.path.endswith("['w']")]  # the parameter, Adam's mu and nu
            assert len(w) == 3 and all(r.copies == 4 // split and r.bytes_per_device == 48 // split for r in w)
            assert all(r.copies == 4 for r in rows if r not in w)  # the rest replicated
        else:  # parameter server: shard j in the host memory beside worker j % n
            assert kinds == {"pinned_host"}
            shards = [r for r in rows if r.path.startswith(".params.shards")]
            assert [r.devices for r in shards] == [(strategy.devices[j % 2].id,) for j in range(3)]
            assert sum(r.bytes_per_device for r in shards) == pk.models.param_bytes(small_params)


def test_partition_figure_draws_each_shards_pieces(small_params):
    strategy = pk.ParameterServer(3, devices=2)
    partition = strategy.partition(small_params)
    ids = [d.id for d in strategy.devices]
    fig = viz.partition_figure(partition, devices=ids)
    drawn = [(round(p.get_y() + p.get_height() / 2), p.get_x(), p.get_width()) for p in fig.axes[0].patches]
    expected = []
    for j in range(partition.num_shards):
        offset = 0
        for piece in partition.pieces(j):
            expected.append((j, offset, piece.stop - piece.start))
            offset += piece.stop - piece.start
        assert offset == partition.bounds[j][1] - partition.bounds[j][0]  # the pieces fill the shard
    assert drawn == expected
    labels = [t.get_text().splitlines()[0] for t in fig.axes[0].get_yticklabels()]
    assert labels == [f"shard {j} · device {ids[j % 2]} (host)" for j in range(3)]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [viz.leaf_label(p) for p in partition.paths]


def test_pipeline_gantt_bars_equal_the_schedule():
    slots = gpipe_schedule(stages=3, microbatches=4)
    fig = viz.pipeline_gantt_figure(slots)
    ax = fig.axes[0]
    drawn = [(p.get_x(), p.get_width(), p.get_y() + p.get_height() / 2) for p in ax.patches]
    assert drawn == [(s.start, s.end - s.start, s.stage) for s in slots]
    colors = [p.get_facecolor() for p in ax.patches]
    assert colors == [to_rgba(viz.pipeline.COLORS[s.kind]) for s in slots]
    assert [t.get_text() for t in ax.texts] == [str(s.microbatch) for s in slots]
    assert f"{(3 - 1) / (4 + 3 - 1):.0%}" in ax.get_title()


def test_mesh_figure_draws_a_2d_mesh_with_each_devices_slice(mlp):
    _, params = mlp
    strategy = pk.TensorParallel(4, devices=jax.devices()[:4])
    state = strategy.init(params, optax.sgd(0.1))
    column = state.params["hidden"][0]["kernel"]  # (64, 64) split by columns over 4 devices
    fig = viz.mesh_figure({"hidden/0/kernel": column, "head/bias": state.params["head"]["bias"]})
    assert _grid(fig).tolist() == [[0, 1, 2, 3]]  # four distinct slices
    assert [t.get_text() for t in fig.axes[0].texts] == [f"device {d}\n[:, {16 * d}:{16 * (d + 1)}]" for d in range(4)]
    assert np.asarray(fig.axes[1].images[0].get_array()).tolist() == [[0, 0, 0, 0]]  # one slice, replicated
    mesh = pk.mesh.make_mesh(jax.devices()[:8], data=2, model=4)
    x = jax.device_put(jnp.zeros((8, 64)), NamedSharding(mesh, P("data", "model")))
    fig = viz.mesh_figure({"x": x})
    assert _grid(fig).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]  # rows: data, columns: model
    assert fig.axes[0].get_ylabel() == "data=2" and fig.axes[0].get_xlabel() == "model=4"
    with pytest.raises(ValueError, match="not on a device mesh; draw it with placement_figure"):
        viz.mesh_figure({"w": jax.device_put(jnp.zeros(3), jax.devices()[0])})


def test_memory_figure_stacks_each_strategys_parts_with_the_formula_and_budget():
    measured = {"Mirrored": {"parameters": 400, "optimizer state": 800}, "ZeRO-3": {"parameters": 100}}
    fig = viz.memory_figure(measured, formula={"Mirrored": 1600, "ZeRO-3": 400}, budget=1000)
    ax = fig.axes[0]
    bars = [(p.get_x() + p.get_width() / 2, p.get_y(), p.get_height()) for p in ax.patches]
    # part by part: both strategies' parameters, then both strategies' optimizer state (0 where absent)
    assert bars == [(0, 0, 400), (1, 0, 100), (0, 400, 800), (1, 100, 0)]
    (ticks,) = ax.collections
    assert ticks.get_offsets().tolist() == [[0, 1600], [1, 400]]
    assert [line.get_ydata()[0] for line in ax.lines] == [1000]
    assert [t.get_text() for t in ax.texts] == ["1.2 KiB", "100 B"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["Mirrored", "ZeRO-3"]


def test_trace_figure_draws_each_event_where_and_as_long_as_it_ran(tmp_path):
    from parallelkit.measure.profile import Event, TraceSummary, device_times

    events = (
        Event(None, "DevicePut", "transfer", 0.0, 0.001),
        Event(0, "dot", "compute", 0.001, 0.002),
        Event(0, "all-reduce", "collective", 0.003, 0.0005),
        Event(1, "dot", "compute", 0.0015, 0.002),
    )
    summary = TraceSummary(tmp_path / "trace.json.gz", 1, events, device_times(events))
    ax = viz.trace_figure(summary).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["host", "device 0", "device 1"]
    bars = [(tuple(np.round(b.get_paths()[0].get_extents().bounds, 6)), to_rgba(b.get_facecolor()[0]))
            for b in ax.collections]  # fmt: skip
    # (start ms, row - 0.4, duration ms, 0.8) of each bar, in rows' order and kinds' order, coloured by kind
    assert bars == [
        ((0.0, -0.4, 1.0, 0.8), to_rgba("tab:green")),
        ((1.0, 0.6, 2.0, 0.8), to_rgba("tab:blue")),
        ((3.0, 0.6, 0.5, 0.8), to_rgba("tab:red")),
        ((1.5, 1.6, 2.0, 0.8), to_rgba("tab:blue")),
    ]


def test_routing_figure_draws_the_routed_tokens_and_each_experts_kept_and_dropped():
    routed = np.array([[5, 3, 0, 0], [6, 1, 1, 0], [2, 2, 2, 2]])
    kept = np.minimum(routed, 4)
    fig = viz.routing_figure(routed, kept, step=1, capacity=4)
    np.testing.assert_array_equal(_grid(fig), routed)
    heights = [p.get_height() for p in fig.axes[1].patches]
    assert heights == [4, 1, 1, 0, 2, 0, 0, 0]  # kept at step 1, then dropped on top
    assert "25% of the choices dropped" in fig.axes[1].get_title()
    with pytest.raises(ValueError, match="step=3 is not one of the 3 recorded steps"):
        viz.routing_figure(routed, kept, step=3)
    with pytest.raises(ValueError, match=r"\(steps, experts\)"):
        viz.routing_figure(routed, kept[:, :2], step=0)


def test_alltoall_figure_sends_each_other_device_an_equal_part():
    fig = viz.alltoall_figure(2, 2048)
    assert [t.get_text() for t in fig.axes[0].texts] == ["kept", "1.0 kB", "1.0 kB", "kept"]
    assert "1/2 of 2.0 kB" in fig.axes[0].get_title()
