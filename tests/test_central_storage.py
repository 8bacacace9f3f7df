"""CentralStorage with 8 simulated devices: one host copy of the state, placement, compilation, errors."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import assert_steps_compile_once, tree_allclose

import parallelkit as pk
from parallelkit.strategies.offdevice.rows import host_sharding


def _assert_one_host_copy(state, strategy):
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding == strategy.storage
        assert leaf.sharding.memory_kind == "pinned_host"
        assert leaf.sharding.device_set == {jax.devices()[0]}
        assert len(leaf.addressable_shards) == 1


def test_state_lives_once_in_host_memory_after_init_and_after_a_step(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.CentralStorage()
    state = strategy.init(params, optax.adam(1e-3))
    assert len(jax.tree.leaves(state)) == 1 + 3 * len(jax.tree.leaves(params)) + 1  # step, params, mu, nu, count
    _assert_one_host_copy(state, strategy)
    state, metrics = strategy.step(loss_fn)(state, batch)
    _assert_one_host_copy(state, strategy)
    assert set(metrics) == {"loss", "accuracy"} and all(np.shape(v) == () for v in metrics.values())


def test_describe_shows_memory_kind_and_one_copy(mlp):
    _, params = mlp
    strategy = pk.CentralStorage()
    rows = strategy.describe(strategy.init(params, optax.sgd(0.1)).params)
    assert {r.path for r in rows} == {
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    for row in rows:
        assert row.memory_kind == "pinned_host" and row.copies == 1 and row.devices == (0,)
        assert row.bytes_per_device == np.prod(row.shape) * 4


def test_workers_compute_without_collectives(mlp, batch):
    """The workers' program holds no all-reduce: the reduction happens on the storage device."""
    loss_fn, params = mlp
    strategy = pk.CentralStorage()
    assert pk.inspect.collectives(strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1)), batch) == []


def test_matches_single_device_on_one_step_with_sgd(mlp, batch):
    loss_fn, params = mlp
    results = []
    for strategy in (pk.SingleDevice(), pk.CentralStorage()):
        state, metrics = strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.5)), batch)
        results.append((strategy.unreplicate(state.params), float(metrics["loss"])))
    tree_allclose(results[1][0], results[0][0])
    assert abs(results[1][1] - results[0][1]) < 1e-6


def test_second_step_does_not_recompile(mlp, digits):
    loss_fn, params = mlp
    assert_steps_compile_once(pk.CentralStorage(), loss_fn, params, digits)


def test_step_keeps_callers_params(mlp, batch):
    loss_fn, params = mlp
    before = jax.device_get(params)
    strategy = pk.CentralStorage(4)
    state, _ = strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.1)), batch)
    tree_allclose(params, before, rtol=0, atol=0)
    host = strategy.unreplicate(state.params)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))


def test_indivisible_batch_names_both_numbers(mlp, digits):
    loss_fn, params = mlp
    strategy = pk.CentralStorage()
    odd = next(pk.data.batches(digits, 100, steps=1))
    with pytest.raises(ValueError, match=r"batch of 100 examples does not split evenly over 8 replicas.*96 or 104"):
        strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.1)), odd)


def test_host_memory_is_pinned_host_on_cpu_devices():
    assert host_sharding(jax.devices()[3]).memory_kind == "pinned_host"
    assert pk.CentralStorage(2, storage=jax.devices()[5]).storage.device_set == {jax.devices()[5]}


def test_repr_and_devices():
    assert repr(pk.CentralStorage(2)) == "CentralStorage(devices=2, storage=pinned_host)"
    assert pk.CentralStorage().num_replicas == 8
    with pytest.raises(pk.DeviceCountError):
        pk.CentralStorage(16)


@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_mean_rows_is_the_mean_over_replicas(replicas):
    from parallelkit.strategies.offdevice.rows import mean_rows

    rows = np.random.default_rng(replicas).normal(size=(replicas, 5, 7)).astype(np.float32)
    got = jax.jit(mean_rows)(rows)
    np.testing.assert_allclose(got, rows.mean(axis=0), rtol=1e-6, atol=1e-7)
    assert got.shape == (5, 7)


def test_push_copies_each_row_to_the_owner_and_leaves_the_owners_own_row_in_place(mlp, batch):
    """The push moves replica i's row from device i to the owner; the owner's own row is not copied."""
    from parallelkit.strategies.offdevice.rows import push_rows

    loss_fn, params = mlp
    strategy = pk.CentralStorage(4)
    fn = strategy.step(loss_fn).fn
    state = strategy.init(params, optax.sgd(0.1))
    params_on_workers, *pulled = fn.pull(state)  # the key, the model state and the loss scale
    rows = fn.compute(params_on_workers, strategy.place_batch(batch), *pulled)
    owner = fn.push_update.compute
    pushed = push_rows(rows, owner)
    assert len(pushed) == 4
    by_replica = [jax.tree.leaves(p.grads) for p in pushed]
    for sent, row in zip(jax.tree.leaves(rows.grads), zip(*by_replica, strict=True), strict=True):
        assert all(r.sharding == owner and r.shape == (1, *sent.shape[1:]) for r in row)
        shards = sorted(sent.addressable_shards, key=lambda s: s.index[0].start)
        np.testing.assert_array_equal(np.concatenate([np.asarray(r) for r in row]), np.asarray(sent))
        assert row[0].unsafe_buffer_pointer() == shards[0].data.unsafe_buffer_pointer()  # not copied
        assert row[1].unsafe_buffer_pointer() != shards[1].data.unsafe_buffer_pointer()  # copied to the owner
