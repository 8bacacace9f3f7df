"""ParameterServer on simulated devices: shard placement, the partition, async staleness, errors, compilation."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import assert_steps_compile_once, tree_allclose

import parallelkit as pk
from parallelkit.strategies.parameter_server import Partition, Sharded

STEPS = 6


def _assert_each_shard_once_in_host_memory(state, strategy):
    """Shard j's parameters and optimizer state: one copy, in the pinned_host memory of device j % n."""
    assert len(state.params.shards) == len(state.opt_state) == strategy.num_shards
    for j, (shard, opt) in enumerate(zip(state.params.shards, state.opt_state, strict=True)):
        owner = strategy.devices[j % strategy.num_replicas]
        for leaf in jax.tree.leaves((shard, opt)):
            assert leaf.sharding.memory_kind == "pinned_host", f"shard {j}"
            assert leaf.sharding.device_set == {owner}, f"shard {j}"
            assert len(leaf.addressable_shards) == 1
    assert state.step.sharding.device_set == {strategy.devices[0]}
    assert state.step.sharding.memory_kind == "pinned_host"


def _train(strategy, mlp, digits, steps=STEPS, tx=None):
    loss_fn, params = mlp
    step = strategy.step(loss_fn)
    state = strategy.init(params, tx or optax.sgd(0.5))
    for batch in pk.data.batches(digits, 64, steps=steps):
        state, _ = step(state, batch)
    return strategy.unreplicate(state.params), step


@pytest.mark.parametrize("shards, workers", [(3, 8), (3, 2)])
def test_every_leaf_placed_after_init_and_after_a_step(mlp, batch, shards, workers):
    """3 shards on 8 workers sit beside devices 0, 1, 2; on 2 workers shard 2 wraps to device 0."""
    loss_fn, params = mlp
    strategy = pk.ParameterServer(shards, devices=workers)
    state = strategy.init(params, optax.adam(1e-3))
    _assert_each_shard_once_in_host_memory(state, strategy)
    state, metrics = strategy.step(loss_fn)(state, batch)
    _assert_each_shard_once_in_host_memory(state, strategy)
    assert set(metrics) == {"loss", "accuracy"}
    rows = strategy.describe(state)
    assert len(rows) == len(jax.tree.leaves(state))
    assert all(r.memory_kind == "pinned_host" and r.copies == 1 and len(r.devices) == 1 for r in rows)
    assert {r.devices[0] for r in rows if r.path.startswith(".params")} == {j % workers for j in range(shards)}


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 4810])
def test_partition_is_balanced_and_covers_every_element_once(mlp, num_shards):
    _, params = mlp
    total = sum(x.size for x in jax.tree.leaves(params))
    assert total == 4810
    part = Partition.of(params, num_shards)
    sizes = [b - a for a, b in part.bounds]
    assert len(sizes) == num_shards and max(sizes) - min(sizes) <= 1 and sum(sizes) == total
    assert part.bounds[0][0] == 0 and part.bounds[-1][1] == total
    assert all(
        a[1] == b[0] for a, b in zip(part.bounds[:-1], part.bounds[1:], strict=True)
    )  # contiguous, no gap, no overlap
    # every element of every variable is held by exactly one shard
    counts = {p: np.zeros(int(np.prod(s)), int) for p, s in zip(part.paths, part.shapes, strict=True)}
    for j in range(num_shards):
        held = 0
        for piece in part.pieces(j):
            counts[piece.path][piece.start : piece.stop] += 1
            held += piece.stop - piece.start
        assert held == sizes[j]
    assert all((c == 1).all() for c in counts.values())
    # and the shards put back together are the parameters, bit for bit
    if num_shards < 100:  # (4810 one-element slices are slow to cut, and prove nothing more)
        tree_allclose(part.join([np.asarray(s) for s in part.split(params)]), params, rtol=0, atol=0)


def test_partition_table_text(mlp):
    _, params = mlp
    strategy = pk.ParameterServer(3)
    lines = strategy.partition(params).table(strategy.devices).splitlines()
    assert lines[0].split() == ["shard", "device", "elements", "bytes", "pieces"]
    assert lines[2].split()[:4] == ["0", "0", "1603", "6412"]
    assert lines[3].split() == ["1", "1", "1604", "6416", "['hidden'][0]['kernel'][889:2493]"]
    assert lines[4].split() == ["2", "2", "1603", "6412", "['hidden'][0]['kernel'][2493:4096]"]
    assert lines[2].endswith(
        "['head']['bias'], ['head']['kernel'], ['hidden'][0]['bias'], ['hidden'][0]['kernel'][0:889]"
    )
    assert pk.ParameterServer(3).partition(params).table().splitlines()[2].split()[1] == "-"  # no devices given


@pytest.fixture(scope="module")
def sync_params(mlp, digits):
    return _train(pk.ParameterServer(3), mlp, digits)[0]


def test_async_with_staleness_zero_equals_sync_exactly(mlp, digits, sync_params):
    zero, step = _train(pk.ParameterServer(3, mode="async", staleness=0), mlp, digits)
    tree_allclose(zero, sync_params, rtol=0, atol=0)
    assert step.fn.delays == [0] * STEPS


def test_stale_gradients_differ_from_sync_and_reproduce_with_their_seed(mlp, digits, sync_params):
    strategy = pk.ParameterServer(3, mode="async", staleness=4, seed=0)
    first, first_step = _train(strategy, mlp, digits)
    again, again_step = _train(strategy, mlp, digits)  # a fresh step: the same seeded schedule
    delays = first_step.fn.delays
    assert len(delays) == STEPS and any(delays) and all(0 <= d <= min(4, t) for t, d in enumerate(delays))
    assert again_step.fn.delays == delays
    tree_allclose(again, first, rtol=0, atol=0)  # bit-reproducible
    assert not np.array_equal(first["head"]["kernel"], sync_params["head"]["kernel"])
    # another seed draws another schedule (the delays are chosen before any compute: no training needed)
    other = pk.ParameterServer(3, mode="async", staleness=4, seed=1).step(mlp[0])
    for t in range(STEPS):
        other.fn.choose(t)
    assert other.fn.delays != delays and all(0 <= d <= min(4, t) for t, d in enumerate(other.fn.delays))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_shards": 0}, r"num_shards=0: use an integer >= 1"),
        ({"num_shards": 2.0}, r"num_shards=2.0: use an integer >= 1"),
        ({"num_shards": True}, r"num_shards=True: use an integer >= 1"),
        ({"mode": "async", "staleness": -1}, r"staleness=-1: it counts updates, so use an integer >= 0"),
        ({"mode": "async", "staleness": 1.5}, r"staleness=1.5: it counts updates"),
        ({"mode": "async", "staleness": "2"}, r"staleness='2': it counts updates"),
        ({"mode": "hogwild"}, r"mode='hogwild'\): choose one of \('sync', 'async'\)"),
        ({"staleness": 2}, r"staleness=2 needs mode='async'"),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pk.ParameterServer(**kwargs)


def test_more_shards_than_elements_is_a_clear_error(mlp):
    _, params = mlp
    strategy = pk.ParameterServer(4811)  # the check needs the parameters, so it comes at init
    with pytest.raises(ValueError, match=r"num_shards=4811: the parameters hold 4810 elements.*1 to 4810 shards"):
        strategy.init(params, optax.sgd(0.1))


def test_mixed_dtypes_are_a_clear_error():
    with pytest.raises(ValueError, match=r"every parameter needs one dtype.*Cast the parameters"):
        Partition.of({"a": np.zeros(3, np.float32), "b": np.zeros(3, np.float16)}, 2)


def test_unreplicate_gives_back_the_original_tree(mlp):
    _, params = mlp
    strategy = pk.ParameterServer(3, devices=4)
    state = strategy.init(params, optax.sgd(0.1))
    assert isinstance(state.params, Sharded)
    host = strategy.unreplicate(state.params)
    assert jax.tree.structure(host) == jax.tree.structure(params)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
    tree_allclose(host, params, rtol=0, atol=0)
    # inside a larger tree too: the Sharded node is replaced, the rest kept
    both = strategy.unreplicate({"params": state.params, "step": state.step})
    assert jax.tree.structure(both["params"]) == jax.tree.structure(params) and int(both["step"]) == 0


def test_second_step_does_not_recompile(mlp, digits):
    loss_fn, params = mlp
    assert_steps_compile_once(pk.ParameterServer(3, mode="async", staleness=2), loss_fn, params, digits)


def test_repr():
    assert repr(pk.ParameterServer(2, devices=4)) == "ParameterServer(num_shards=2, mode='sync', workers=4)"
    assert (
        repr(pk.ParameterServer(3, "async", 4)) == "ParameterServer(num_shards=3, mode='async', staleness=4, workers=8)"
    )
