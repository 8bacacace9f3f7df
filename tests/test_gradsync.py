"""Gradients before and after sync: the data is right, and the figures plot exactly it."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import parallelkit as pk
import parallelkit.viz as viz
from parallelkit.measure.gradsync import GradientProbe, path_label, ring_allreduce_trace, trace_gradients
from parallelkit.viz import GradSyncExplorer
from parallelkit.viz.gradsync import spread_table


@pytest.fixture(scope="module")
def strategy():
    s = pk.Mirrored(backend="jit")
    if s.num_replicas < 2:
        pytest.skip(f"needs 2 or more devices, JAX has {s.num_replicas}")
    return s


@pytest.fixture(scope="module")
def traced(strategy, mlp, digits):
    loss_fn, params = mlp
    return trace_gradients(strategy, loss_fn, params, optax.adam(1e-2), pk.data.batches(digits, 64, steps=3))


def test_spread_is_zero_after_sync_and_not_before(traced):
    for sync in traced:
        assert np.all(sync.spread() > 0)
        np.testing.assert_array_equal(sync.spread(after=True), 0.0)
        for after in sync.after:  # every replica holds bitwise the same average
            assert np.array_equal(after, np.broadcast_to(after[0], after.shape))


def test_before_slices_the_batch_like_the_strategy(strategy, mlp, batch):
    loss_fn, params = mlp
    sync = GradientProbe(strategy, loss_fn)(params, batch)
    n, per = strategy.num_replicas, len(batch["x"]) // strategy.num_replicas
    grad = jax.grad(lambda p, b: loss_fn(p, b)[0])
    for i in (0, n - 1):
        expected = grad(params, jax.tree.map(lambda x, i=i: x[i * per : (i + 1) * per], batch))
        leaves = [np.asarray(x) for _, x in jax.tree_util.tree_flatten_with_path(expected)[0]]
        tree_allclose([b[i] for b in sync.before], leaves)
    np.testing.assert_allclose(sync.losses.mean(), float(loss_fn(params, batch)[0]), rtol=1e-5)


def test_synced_gradient_is_the_single_device_gradient(strategy, mlp, batch):
    loss_fn, params = mlp
    sync = GradientProbe(strategy, loss_fn)(params, batch)
    whole = jax.grad(lambda p: loss_fn(p, batch)[0])(params)
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(whole)[0], strict=True)
    assert sync.layers == tuple(path_label(p) for p in paths)
    tree_allclose(list(sync.synced), [np.asarray(x) for x in leaves])
    tree_allclose(list(sync.synced), [b.mean(axis=0) for b in sync.before])


def test_probe_reads_a_placed_state_and_trace_follows_training(strategy, mlp, digits, traced):
    loss_fn, params = mlp
    assert [s.step for s in traced] == [1, 2, 3]
    assert not np.allclose(traced[0].synced[1], traced[2].synced[1])  # the parameters moved
    state = strategy.init(params, optax.adam(1e-2))
    batch = next(pk.data.batches(digits, 64, steps=1))
    first = GradientProbe(strategy, loss_fn)(state, batch)
    tree_allclose(list(first.before), list(traced[0].before))


def test_norms_are_per_replica_per_layer(traced):
    sync = traced[0]
    norms = sync.replica_norms()
    assert norms.shape == (sync.replicas, len(sync.layers))
    np.testing.assert_allclose(norms[2, 1], np.linalg.norm(sync.before[1][2]), rtol=1e-6)


def test_gradient_sync_figure_plots_the_data(traced):
    sync = traced[1]
    k = sync.layers.index("head/kernel")
    fig = viz.gradient_sync_figure(sync, "head/kernel", max_elements=100)
    n = sync.replicas
    np.testing.assert_array_equal(fig.axes[0].images[0].get_array(), sync.before[k].reshape(n, -1)[:, :100])
    np.testing.assert_array_equal(fig.axes[1].images[0].get_array(), sync.after[k].reshape(n, -1)[:, :100])
    np.testing.assert_allclose([p.get_width() for p in fig.axes[2].patches], sync.replica_norms()[:, k])
    with pytest.raises(ValueError, match="No layer"):
        viz.gradient_sync_figure(sync, "nope")


def test_spread_figure_plots_the_data(traced):
    fig = viz.spread_figure(traced)
    for ax, after in zip(fig.axes[:2], (False, True), strict=True):
        for j, line in enumerate(ax.get_lines()):
            np.testing.assert_array_equal(line.get_ydata(), [s.spread(after)[j] for s in traced])
            np.testing.assert_array_equal(line.get_xdata(), [1, 2, 3])


def test_ring_allreduce_moves_chunks_to_the_mean(traced):
    sync = traced[0]
    grads = np.concatenate([g.reshape(sync.replicas, -1) for g in sync.before], axis=1)
    ring = ring_allreduce_trace(grads)
    n, size = grads.shape
    np.testing.assert_allclose(ring.result, np.tile(grads.astype(np.float64).mean(0), (n, 1)), rtol=1e-12)
    np.testing.assert_allclose(ring.result[0], np.concatenate([s.ravel() for s in sync.synced]), rtol=1e-5, atol=1e-7)
    assert len(ring.steps) == 2 * (n - 1)
    for step in ring.steps:  # each replica sends exactly one chunk, to its neighbour
        assert sorted(t.src for t in step.transfers) == list(range(n))
        assert all(t.dst == (t.src + 1) % n for t in step.transfers)
    assert np.all(ring.steps[n - 2].contributions.max(axis=1) == n)  # reduce-scatter: one full chunk each
    assert np.all(ring.steps[-1].contributions == n)
    np.testing.assert_allclose(ring.bytes_sent(), 2 * (n - 1) / n * size * 4, rtol=n / size)


def test_ring_figure_draws_each_steps_contributions():
    ring = ring_allreduce_trace(np.random.default_rng(0).normal(size=(4, 10)))
    fig = viz.ring_figure(ring)
    for ax, step in zip(fig.axes, ring.steps, strict=False):
        np.testing.assert_array_equal(ax.images[0].get_array(), step.contributions)
    one = viz.ring_figure(ring, step=2)
    np.testing.assert_array_equal(one.axes[0].images[0].get_array(), ring.steps[2].contributions)


def test_explorer_sliders_redraw(traced):
    explorer = GradSyncExplorer(traced, max_elements=64)
    box = explorer.widget
    steps, layers = box.children[0].children
    image = box.children[2]
    first = image.value
    assert first[:4] == b"\x89PNG"
    layers.value = 1
    steps.value = 2
    assert explorer.current == (2, 1) and image.value != first
    assert traced[2].layers[1] in box.children[1].value
    assert spread_table(traced).count("\n") == len(traced)
    with pytest.raises(ValueError, match="at least one"):
        GradSyncExplorer([])
