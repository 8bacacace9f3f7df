"""Hand-written all-reduces: equal to lax.psum, their compiled bytes equal to their formulas,
and Mirrored training with each equal to SingleDevice."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from helpers import ATOL, RTOL, assert_steps_compile_once, tree_allclose
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit import collectives as C

FLAT = {
    "ring": (C.ring_allreduce, C.ring_cost),
    "tree": (C.tree_allreduce, C.tree_cost),
    "reduce_to_one": (C.reduce_to_one_allreduce, C.reduce_to_one_cost),
}


def _on_mesh(fn, mesh: jax.sharding.Mesh, axes):
    """``fn`` run per device inside shard_map, each device holding one row block of the input."""
    spec = P(axes)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def _sharded(values: np.ndarray, mesh: jax.sharding.Mesh, axes) -> jax.Array:
    return jax.device_put(values, NamedSharding(mesh, P(axes)))


@pytest.mark.parametrize("name", FLAT)
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("shape", [(1,), (5,), (64,), (3, 16)])
def test_flat_allreduce_equals_psum(name, n, shape):
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    fn, _ = FLAT[name]
    values = np.random.default_rng(n).normal(size=(n * shape[0], *shape[1:])).astype(np.float32)
    x = _sharded(values, mesh, "x")
    ours = _on_mesh(lambda v: fn(v, "x"), mesh, "x")(x)
    reference = _on_mesh(lambda v: lax.psum(v, "x"), mesh, "x")(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(reference), rtol=RTOL, atol=ATOL)
    # whole numbers add up exactly in any order: the sums are the same, not just close
    whole = _sharded(np.round(values * 100), mesh, "x")
    np.testing.assert_array_equal(
        np.asarray(_on_mesh(lambda v: fn(v, "x"), mesh, "x")(whole)),
        np.asarray(_on_mesh(lambda v: lax.psum(v, "x"), mesh, "x")(whole)),
    )


@pytest.mark.parametrize("name", FLAT)
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("elements", [8, 64, 1024])
def test_compiled_bytes_sent_equal_the_formula(name, n, elements):
    mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
    fn, cost = FLAT[name]
    x = _sharded(np.ones((n * elements,), np.float32), mesh, "x")
    found = pk.inspect.collectives(_on_mesh(lambda v: fn(v, "x"), mesh, "x"), x)
    assert {c.op for c in found} == {"collective-permute"}  # nothing of the compiler's own
    expected = cost(n, 4 * elements)
    assert C.sent_bytes(found, n)["all"] == list(expected.sent)
    assert sum(c.bytes for c in found) == expected.wire_bytes  # in sequence through the busiest link
    assert len(found) == expected.rounds


@pytest.mark.parametrize("outer, inner", [(2, 2), (2, 4), (4, 2)])
def test_hierarchical_equals_psum_and_sends_its_formula_on_each_link(outer, inner):
    mesh = jax.make_mesh((outer, inner), ("outer", "inner"))
    axes = ("outer", "inner")
    n, elements = outer * inner, 16 * outer * inner
    values = np.random.default_rng(0).normal(size=(n * elements,)).astype(np.float32)
    x = _sharded(values, mesh, axes)
    ours = _on_mesh(lambda v: C.hierarchical_allreduce(v, "inner", "outer"), mesh, axes)
    reference = _on_mesh(lambda v: lax.psum(v, axes), mesh, axes)
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(reference(x)), rtol=RTOL, atol=ATOL)
    sent = C.sent_bytes(pk.inspect.collectives(ours, x), n, group=inner)
    for link, cost in C.hierarchical_cost(inner, outer, 4 * elements).items():
        assert sent[link] == list(cost.sent), link


def test_hierarchical_sends_fewer_bytes_between_groups_than_a_flat_ring():
    flat = C.ring_cost(8, 1e6)
    two_level = C.hierarchical_cost(4, 2, 1e6)
    assert two_level["outer"].wire_bytes == pytest.approx(flat.wire_bytes / 4 * (2 * 1 / 2) / (2 * 7 / 8))
    assert two_level["inner"].wire_bytes + two_level["outer"].wire_bytes == pytest.approx(flat.wire_bytes)


def test_cost_formulas_by_hand():
    # ring over 4 devices, 1 MB, alpha 5 us, 10 GB/s: 2(n-1)/n x P / B + 2(n-1) alpha
    assert C.ring_cost(4, 1e6).seconds(5e-6, 10e9) == pytest.approx(1.5e6 / 10e9 + 6 * 5e-6)
    # tree: the ring's bytes, 2 log2 n latencies
    assert C.tree_cost(8, 1e6).seconds(5e-6, 10e9) == pytest.approx(1.75e6 / 10e9 + 6 * 5e-6)
    # reduce to one: 2(n-1) whole arrays through device 0
    assert C.reduce_to_one_cost(4, 1e6).seconds(5e-6, 10e9) == pytest.approx(6e6 / 10e9 + 6 * 5e-6)
    assert C.reduce_to_one_cost(4, 1e6).sent == (3e6, 1e6, 1e6, 1e6)
    # hierarchical, 2 groups of 4: inside 2(3)/4 P; across 2(1)/2 of P/4
    cost = C.hierarchical_cost(4, 2, 1e6)
    assert (cost["inner"].rounds, cost["inner"].wire_bytes) == (6, 1.5e6)
    assert (cost["outer"].rounds, cost["outer"].wire_bytes) == (2, 0.25e6)


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="power-of-two"):
        C.tree_cost(6, 100)
    mesh = jax.make_mesh((6,), ("x",), devices=jax.devices()[:6])
    with pytest.raises(ValueError, match="ring_allreduce for 6 devices"):
        _on_mesh(lambda v: C.tree_allreduce(v, "x"), mesh, "x")(_sharded(np.ones(6, np.float32), mesh, "x"))
    with pytest.raises(ValueError, match="choose one of"):
        C.AllReduce("nccl")
    with pytest.raises(ValueError, match="group"):
        C.AllReduce("hierarchical")
    with pytest.raises(ValueError, match="group"):
        C.AllReduce("ring", group=2)
    with pytest.raises(ValueError, match="does not divide"):
        pk.Mirrored(6, allreduce=C.AllReduce("hierarchical", group=4))
    with pytest.raises(TypeError, match="AllReduce"):
        pk.Mirrored(2, allreduce=3)


ALLREDUCES = ["psum", "ring", "tree", "reduce_to_one", C.AllReduce("hierarchical", group=2)]


@pytest.mark.parametrize("backend", ["jit", "pmap"])
@pytest.mark.parametrize("allreduce", ALLREDUCES, ids=lambda a: getattr(a, "algorithm", a))
def test_mirrored_with_each_allreduce_equals_single_device(mlp, digits, backend, allreduce):
    loss, params = mlp
    batches = list(pk.data.batches(digits, 64, steps=6))

    def train(strategy):
        state, step = strategy.init(params, optax.sgd(0.1, momentum=0.9)), strategy.step(loss)
        for batch in batches:
            state, metrics = step(state, batch)
        return strategy.unreplicate(state.params), float(metrics["loss"])

    (expected, expected_loss), (actual, actual_loss) = (
        train(pk.SingleDevice()),
        train(pk.Mirrored(4, backend=backend, allreduce=allreduce)),
    )
    tree_allclose(actual, expected)
    assert actual_loss == pytest.approx(expected_loss, rel=RTOL, abs=ATOL)


@pytest.mark.parametrize("allreduce", ALLREDUCES[1:], ids=lambda a: getattr(a, "algorithm", a))
def test_mirrored_traffic_reads_the_permutes_and_matches_the_formula(mlp, batch, allreduce):
    loss, params = mlp
    strategy = pk.Mirrored(4, allreduce=allreduce)
    traffic = strategy.traffic(loss, strategy.init(params, optax.sgd(0.1)), batch)
    flow = traffic.flow("gradients and metrics")
    assert flow.measured == flow.expected > 0
    assert traffic.flow("other collectives").measured == 0  # no all-reduce of the compiler's own


def test_mirrored_with_an_allreduce_compiles_once(mlp, digits):
    loss, params = mlp
    assert_steps_compile_once(pk.Mirrored(4, allreduce="ring"), loss, params, digits)


def test_mean_tree_keeps_structure_and_dtypes():
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([2, 4], np.int32)}
    tree = _sharded(tree, mesh, "x")
    fn = functools.partial(C.mean_tree, axis="x", allreduce=C.AllReduce("ring"))
    out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))(tree)
    np.testing.assert_array_equal(np.asarray(out["w"]), [[1.5, 2.5, 3.5]] * 2)
    assert out["n"].dtype == np.int32 and list(np.asarray(out["n"])) == [3, 3]
