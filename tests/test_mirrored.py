"""Mirrored in one process with 8 simulated devices: placement, compilation, traffic, errors."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import assert_steps_compile_once, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallelkit as pk

BACKENDS = ("jit", "pmap")


def test_all_devices_by_default():
    assert pk.Mirrored().num_replicas == jax.device_count() == 8
    assert pk.Mirrored(4).devices == jax.devices()[:4]


def test_jit_state_fully_replicated_on_every_device(mlp):
    _, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state = strategy.init(params, optax.adam(1e-3))
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 1 + 3 * len(jax.tree.leaves(params)) + 1  # step, params, mu, nu, count
    for leaf in leaves:
        assert isinstance(leaf.sharding, NamedSharding)
        assert leaf.sharding.spec == P()
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.device_set == set(jax.devices())
        assert all(shard.data.shape == leaf.shape for shard in leaf.addressable_shards)


def test_jit_batch_sharded_on_data(batch):
    placed = pk.Mirrored(backend="jit").place_batch(batch)
    for leaf in jax.tree.leaves(placed):
        assert leaf.sharding.spec == P(pk.DATA)
        assert {s.data.shape[0] for s in leaf.addressable_shards} == {64 // 8}


def test_state_stays_replicated_after_a_step(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state, _ = strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.1)), batch)
    assert all(leaf.sharding.spec == P() and leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state))


def test_pmap_state_one_copy_per_device(mlp):
    _, params = mlp
    strategy = pk.Mirrored(backend="pmap")
    state = strategy.init(params, optax.sgd(0.1))
    for leaf, original in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        assert leaf.shape == (8, *original.shape)
        assert {d for s in leaf.addressable_shards for d in s.data.devices()} == set(jax.devices())
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(shard.data[0], original)


@pytest.mark.parametrize("backend", BACKENDS)
def test_describe_reports_full_copies(backend, mlp):
    _, params = mlp
    strategy = pk.Mirrored(backend=backend)
    rows = strategy.describe(strategy.init(params, optax.sgd(0.1)).params)
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert {r.path: r.shape for r in rows} == shapes
    for row in rows:
        assert row.copies == 8 and row.devices == tuple(range(8))
        assert row.bytes_per_device == np.prod(row.shape) * 4


@pytest.mark.parametrize("make", [pk.SingleDevice, *(lambda b=b: pk.Mirrored(backend=b) for b in BACKENDS)])
def test_second_step_does_not_recompile(make, mlp, digits):
    loss_fn, params = mlp
    assert_steps_compile_once(make(), loss_fn, params, digits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_reduce_carries_exactly_the_gradients(backend, mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend=backend)
    found = pk.inspect.collectives(strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1)), batch)
    summary = pk.inspect.summarize(found)
    assert set(summary) == {"all-reduce"}, summary
    metric_bytes = 2 * 4  # loss and accuracy, float32 scalars
    assert summary["all-reduce"]["bytes"] == pk.models.param_bytes(params) + metric_bytes
    assert all(c.group_size == 8 for c in found)


def test_single_device_has_no_collectives(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.SingleDevice()
    assert pk.inspect.collectives(strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1)), batch) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_keeps_callers_params_and_returns_host_copies(backend, mlp, batch):
    loss_fn, params = mlp
    before = jax.device_get(params)
    strategy = pk.Mirrored(backend=backend)
    state, metrics = strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.1)), batch)
    tree_allclose(params, before, rtol=0, atol=0)  # donation never deletes the caller's arrays
    host = strategy.unreplicate(state.params)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    assert jax.tree.map(np.shape, host) == jax.tree.map(np.shape, before)
    assert set(metrics) == {"loss", "accuracy"} and all(np.shape(v) == () for v in metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_indivisible_batch_names_both_numbers(backend, mlp, digits):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend=backend)
    odd = next(pk.data.batches(digits, 100, steps=1))
    with pytest.raises(ValueError, match=r"batch of 100 examples does not split evenly over 8 replicas.*96 or 104"):
        strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.1)), odd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_arrays_must_agree_on_size(backend, mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend=backend)
    with pytest.raises(ValueError, match="same leading"):
        strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.1)), {"x": batch["x"], "y": batch["y"][:32]})


def test_more_devices_than_exist():
    with pytest.raises(pk.DeviceCountError, match=r"Asked for 16 devices but JAX has 8.*simulate_devices\(16\)"):
        pk.Mirrored(16)


def test_unknown_backend():
    with pytest.raises(ValueError, match="choose one of"):
        pk.Mirrored(backend="nccl")


def test_backends_are_mirrored_instances():
    classes = {"jit": pk.strategies.MirroredJit, "pmap": pk.strategies.MirroredPmap}  # what pk.Mirrored returns
    for backend in BACKENDS:
        strategy = pk.Mirrored(2, backend=backend)
        assert type(strategy) is classes[backend] and strategy.backend == backend
        assert repr(strategy) == f"Mirrored(backend='{backend}', devices=2)"


@pytest.mark.parametrize("strategy", [pk.SingleDevice, pk.Mirrored])
def test_optimizer_state_that_does_not_fit_the_params(strategy, mlp):
    _, params = mlp
    tx = optax.adam(1e-3)
    other = {"w": np.zeros((3, 3), np.float32)}
    with pytest.raises(ValueError, match="opt_state does not have the structure of tx.init"):
        strategy().init(params, tx, opt_state=tx.init(other))
    wrong_shape = jax.tree.map(lambda x: np.zeros((*np.shape(x), 2), np.float32) if np.ndim(x) else x, tx.init(params))
    with pytest.raises(ValueError, match=r"has shape .* but tx.init\(params\) gives"):
        strategy().init(params, tx, opt_state=wrong_shape)


def test_matching_optimizer_state_is_placed(mlp):
    _, params = mlp
    tx = optax.adam(1e-3)
    state = pk.Mirrored().init(params, tx, opt_state=tx.init(params))
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.opt_state))
