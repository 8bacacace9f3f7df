"""Logical axes: any named mesh axes, rules from model names to mesh axes, pk.constrain, and the SPMD strategy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax.sharding import PartitionSpec as P

import parallelkit as pk

SEQ_RULES = (("batch", pk.DATA), ("length", pk.SEQ))


def test_make_mesh_takes_any_named_axes_in_the_kits_order():
    mesh = pk.mesh.make_mesh(jax.devices()[:8], expert=2, seq=2, data=2)
    assert mesh.axis_names == ("data", "seq", "expert")
    assert dict(mesh.shape) == {"data": 2, "seq": 2, "expert": 2}
    names = pk.mesh.make_mesh(jax.devices()[:8], model=2, fsdp=2, stage=2).axis_names
    assert names == ("data", "fsdp", "stage", "model")  # data=None takes what is left: 1
    assert dict(pk.mesh.make_mesh(jax.devices()[:8], seq=4).shape) == {"data": 2, "seq": 4}  # data takes the rest
    assert pk.mesh.make_mesh(jax.devices()[:4], model=2, rows=2).axis_names == ("data", "model", "rows")
    with pytest.raises(ValueError, match="'seq' needs a whole number"):
        pk.mesh.make_mesh(jax.devices()[:4], seq=0)
    with pytest.raises(pk.DeviceCountError, match="data=3 x seq=2 needs 6 devices"):
        pk.mesh.make_mesh(jax.devices()[:4], data=3, seq=2)


def test_axis_rules_give_specs_and_use_a_mesh_axis_once():
    rules = pk.AxisRules((("batch", ("data", "fsdp")), ("length", "seq"), ("embed", None), ("heads", "data")))
    assert rules.spec(("batch", "length", "embed")) == P(("data", "fsdp"), "seq", None)
    assert rules.spec(("batch", "length", "heads", None)) == P(("data", "fsdp"), "seq", None, None)  # data is taken
    assert rules.spec(("vocab",)) == P(None)  # a name no rule mentions is replicated
    with pytest.raises(ValueError, match="An axis rule is a pair"):
        pk.AxisRules((("batch", 2),))


def test_a_rule_naming_an_axis_the_mesh_lacks_is_a_clear_error():
    mesh = pk.mesh.make_mesh(jax.devices()[:2], data=2)
    with pytest.raises(ValueError, match=r"names mesh axis 'seq', but the mesh has only \('data',\)"):
        pk.SPMD(mesh, rules=SEQ_RULES)


def test_constrain_does_nothing_outside_an_spmd_step():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    assert pk.constrain(x, ("batch", "length", "embed")) is x
    traced = jax.jit(lambda y: pk.constrain(y, ("batch", "length", "embed")) * 2)
    assert "sharding" not in traced.lower(x).as_text()
    with pytest.raises(ValueError, match="2 axis names"):
        pk.constrain(x, ("batch", "length"))


def test_parameter_rules_take_logical_names():
    mesh = pk.mesh.make_mesh(jax.devices()[:2], model=2)
    strategy = pk.SPMD(mesh, rules=(("mlp", pk.MODEL),), param_rules=[("kernel", ("embed", "mlp")), (".*", P())])
    specs = strategy.partition_specs({"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}})
    assert specs == {"dense": {"kernel": P(None, "model"), "bias": P()}}


def _train(strategy, apply, params, batches):
    state, step = strategy.init(params, optax.sgd(0.1)), strategy.step(pk.models.classifier_loss(apply))
    for batch in batches:
        state, _ = step(state, batch)
    return state, step


def _compiled_text(step, state, batch) -> str:
    return step.lower(state, batch).compile().as_text()


def test_transformer_trains_with_its_tokens_split_over_seq(digits):
    """data=2 x seq=2: the same parameters as one device, and activations of 4 of the 8 tokens on each device."""
    apply, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    batches = list(pk.data.batches(digits, 32, steps=3))
    mesh = pk.mesh.make_mesh(jax.devices()[:4], data=2, seq=2)

    strategy = pk.SPMD(mesh, rules=SEQ_RULES)
    assert strategy.num_replicas == 2  # the batch is cut over data only
    state, step = _train(strategy, apply, params, batches)
    expected, _ = _train(pk.SingleDevice(), apply, params, batches)
    tree_allclose(state.params, expected.params)

    # Each device computes on 16 of the 32 examples; with the tokens on seq, on 4 of the 8 tokens.
    split = _compiled_text(step, state, batches[0])
    assert "f32[16,4,32]" in split  # (batch / data, length / seq, embed): an activation's shard
    batch_only, step_batch_only = _train(pk.SPMD(mesh, rules=(("batch", pk.DATA),)), apply, params, batches[:1])
    assert "f32[16,4,32]" not in _compiled_text(step_batch_only, batch_only, batches[0])


def test_batch_axes_lay_the_input_tokens_over_seq(digits):
    """batch_axes: the input's rows (its tokens) split over seq as it is placed; still equal to one device."""
    apply, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    batches = list(pk.data.batches(digits, 32, steps=3))
    mesh = pk.mesh.make_mesh(jax.devices()[:4], data=2, seq=2)
    strategy = pk.SPMD(mesh, rules=SEQ_RULES, batch_axes={"x": ("batch", "length", None, None)})
    placed = strategy.place_batch(batches[0])
    assert placed["x"].sharding.spec == P("data", "seq", None, None) and placed["y"].sharding.spec == P("data")
    assert {shard.data.shape for shard in placed["x"].addressable_shards} == {(16, 4, 8, 1)}
    assert strategy.batch_shardings(batches[1]) is strategy.batch_shardings(batches[0])  # made once
    state, _ = _train(strategy, apply, params, batches)
    expected, _ = _train(pk.SingleDevice(), apply, params, batches)
    tree_allclose(state.params, expected.params)


def test_batch_axes_start_with_the_batch_axis_and_need_named_arrays():
    mesh = pk.mesh.make_mesh(jax.devices()[:4], data=2, seq=2)
    with pytest.raises(ValueError, match="first axis is the logical axis 'batch'"):
        pk.SPMD(mesh, rules=SEQ_RULES, batch_axes={"x": ("length", "batch")})
    strategy = pk.SPMD(mesh, rules=SEQ_RULES, batch_axes={"x": ("batch", "length")})
    with pytest.raises(ValueError, match="pass a dict of arrays"):
        strategy.place_batch([np.zeros((4, 8))])
