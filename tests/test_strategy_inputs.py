"""Strategy constructors and Explicit mode given inputs they do not run as asked: each works, or says why.

A mesh from ``jax.make_mesh`` (Explicit axes by default) handed to ``pk.SPMD``, the kit's CNN split by
``TensorParallel``/``Hybrid(explicit=True)``, a bad batch for ``ContextParallel(explicit=True)``, an Auto
strategy called inside ``jax.set_mesh``, ``explicit=`` given to every strategy, and ``ExpertParallel`` on a
model without experts. Equivalence is float32: rtol 1e-5, atol 1e-6 against SingleDevice.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import parallelkit as pk

STEPS = 3


@pytest.fixture(scope="module")
def cnn():
    digits = pk.data.digits()
    apply, params = pk.models.build("cnn", digits.input_shape, digits.num_classes)
    loss_fn = pk.models.classifier_loss(apply)
    batches = list(pk.data.batches(digits, 32, steps=STEPS))
    single = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches).params
    return loss_fn, params, batches, single


def test_spmd_on_a_jax_make_mesh_explains_a_contraction_with_no_one_place():
    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])  # Explicit axes: JAX's default
    rules = (("w1", P(None, "model")), ("w2", P("model", None)))
    strategy = pk.SPMD(mesh, rules=(("batch", "data"),), param_rules=rules)
    params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 8))}
    batch = {"x": np.ones((8, 8), np.float32), "y": np.ones((8, 8), np.float32)}

    def loss(params, batch):  # an unannotated model: nothing says where the row-split product lives
        return jnp.mean((batch["x"] @ params["w1"] @ params["w2"] - batch["y"]) ** 2)

    state = strategy.init(params, optax.sgd(0.1))
    with pytest.raises(Exception, match="out_sharding") as caught:
        strategy.step(loss)(state, batch)
    assert type(caught.value).__name__ == "ShardingTypeError"
    assert any("pass out_sharding=" in note and "explicit=False" in note for note in caught.value.__notes__)


@pytest.mark.parametrize(
    "make",
    [
        lambda explicit: pk.TensorParallel(2, devices=jax.devices()[:2], explicit=explicit),
        lambda explicit: pk.Hybrid(2, 2, devices=jax.devices()[:4], explicit=explicit),
    ],
    ids=["TensorParallel", "Hybrid"],
)
def test_the_kits_cnn_splits_its_channels_on_an_explicit_mesh_as_on_an_auto_one(cnn, make):
    loss_fn, params, batches, single = cnn
    auto = pk.fit(make(False), loss_fn, params, optax.sgd(0.1), batches).params
    run = pk.fit(make(True), loss_fn, params, optax.sgd(0.1), batches)
    pk.tour.assert_close(run.params, single)  # rtol 1e-5, atol 1e-6
    pk.tour.assert_close(run.params, auto)
    convs = run.state.params["convs"]
    assert jax.typeof(convs[0]["kernel"]).sharding.spec == P(None, None, None, "model")  # column split
    assert jax.typeof(convs[1]["kernel"]).sharding.spec == P(None, None, "model", None)  # row split: summed


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_context_parallel_checks_the_batch_alike_in_both_modes(explicit):
    strategy = pk.ContextParallel(seq=2, data=2, devices=jax.devices()[:4], explicit=explicit)
    with pytest.raises(ValueError, match=r"batch array 'x' has shape \(4,\)\. If it is one sequence"):
        strategy.place_batch({"x": np.zeros((4,), np.int32)})  # no token axis
    with pytest.raises(ValueError, match="sequence length 7 of batch array 'x' does not split over seq=2"):
        strategy.place_batch({"x": np.zeros((4, 7), np.int32)})
    with pytest.raises(ValueError, match="global batch of 3 examples does not split evenly over 2 replicas"):
        strategy.place_batch({"x": np.zeros((3, 8), np.int32)})


@pytest.fixture(scope="module")
def mlp_run():
    digits = pk.data.digits()
    apply, params = pk.models.build("mlp", digits.input_shape, digits.num_classes)
    loss_fn = pk.models.classifier_loss(apply)
    batches = list(pk.data.batches(digits, 32, steps=STEPS))
    return loss_fn, params, batches, pk.fit(pk.SingleDevice(), loss_fn, params, optax.adam(1e-2), batches).params


@pytest.mark.parametrize(
    "make",
    [
        lambda: pk.SingleDevice(),
        lambda: pk.Mirrored(4),
        lambda: pk.TensorParallel(2, devices=jax.devices()[:2]),
        lambda: pk.FullySharded(3, 4),
        lambda: pk.Hybrid(2, 2, devices=jax.devices()[:4], explicit=True),
        lambda: pk.CentralStorage(2),
        lambda: pk.ParameterServer(2, devices=2),
        lambda: pk.Mirrored(4, backend="pmap"),
        lambda: pk.Mirrored(4, allreduce="ring"),
        lambda: pk.Mirrored(4, bucket_bytes=4096),
    ],
    ids=["SingleDevice", "Mirrored(jit)", "TensorParallel", "FullySharded(3)", "Hybrid(explicit)", "CentralStorage",
         "ParameterServer", "Mirrored(pmap)", "Mirrored(allreduce)", "Mirrored(buckets)"],
)  # fmt: skip
def test_a_strategy_inside_a_callers_explicit_mesh_trains_and_compiles_as_outside_it(mlp_run, make):
    loss_fn, params, batches, single = mlp_run
    strategy = make()
    with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])):  # Explicit axes
        run = pk.fit(strategy, loss_fn, params, optax.adam(1e-2), batches)
        hlo = pk.inspect.compiled_text(strategy.step(loss_fn), run.state, batches[0])
        assert jax.sharding.get_abstract_mesh().axis_names == ("data", "model")  # the caller's mesh is back
    pk.tour.assert_close(run.params, single)  # rtol 1e-5, atol 1e-6
    assert hlo.startswith("HloModule")


def test_an_async_parameter_server_inside_a_callers_mesh_runs_as_outside_it(mlp_run):
    loss_fn, params, batches, _ = mlp_run
    outside = pk.fit(pk.ParameterServer(2, mode="async", devices=2), loss_fn, params, optax.sgd(0.1), batches)
    with jax.set_mesh(jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])):
        inside = pk.fit(pk.ParameterServer(2, mode="async", devices=2), loss_fn, params, optax.sgd(0.1), batches)
    pk.tour.assert_close(inside.params, outside.params)


@pytest.fixture(scope="module")
def layers():
    return pk.models.as_layers(pk.models.MLP(64, (32,), 10, rngs=nnx.Rngs(0)))[0]


def test_a_pipeline_inside_a_callers_explicit_mesh_trains_as_outside_it():
    layers, params = pk.models.as_layers(pk.models.MLP(64, (32,), 10, rngs=nnx.Rngs(0)))
    batch = next(pk.data.batches(pk.data.digits(), 32, steps=1))
    runs = []
    for mesh in (None, jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])):  # Explicit axes
        pipe = pk.Pipeline(layers, 2, microbatches=2, devices=jax.devices()[:2])
        with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
            state = pipe.init(params, optax.adam(1e-2))
            state, _ = pipe.step(pk.models.cross_entropy)(state, batch)
        runs.append(pipe.unreplicate(state.params))
    pk.tour.assert_close(runs[1], runs[0])  # rtol 1e-5, atol 1e-6


AUTO_ONLY = {
    "CentralStorage": lambda layers, **explicit: pk.CentralStorage(2, **explicit),
    "ParameterServer": lambda layers, **explicit: pk.ParameterServer(2, devices=2, **explicit),
    "Pipeline": lambda layers, **explicit: pk.Pipeline(layers, 2, devices=jax.devices()[:2], **explicit),
}


@pytest.mark.parametrize("name", AUTO_ONLY)
def test_a_strategy_without_explicit_mode_takes_explicit_false_and_refuses_true_saying_why(name, layers):
    make = AUTO_ONLY[name]
    assert repr(make(layers, explicit=False)) == repr(make(layers))  # Auto mode, as without the argument
    with pytest.raises(ValueError, match=rf"^{name}\(explicit=True\): Explicit mode is not supported here\. Its .* "
                       r"not one program over a mesh.* Explicit mode runs in pk\.SPMD and its presets \(SingleDevice, "
                       r".*\): use one of those, or leave explicit=False\.$"):  # fmt: skip
        make(layers, explicit=True)
    with pytest.raises(ValueError, match=rf"{name}\(explicit='yes'\): explicit is a bool"):
        make(layers, explicit="yes")


def test_every_strategy_constructor_takes_explicit():
    """pk.SPMD aside: it takes a mesh, whose axis types are its mode."""
    for strategy in (pk.SingleDevice, pk.Mirrored, pk.MultiWorkerMirrored, pk.FullySharded, pk.TensorParallel,
                     pk.Hybrid, pk.ContextParallel, pk.ExpertParallel, pk.CentralStorage, pk.ParameterServer,
                     pk.Pipeline):  # fmt: skip
        parameter = inspect.signature(strategy).parameters.get("explicit")
        assert parameter is not None and parameter.default is False, strategy.__name__


def test_expert_parallel_on_a_model_without_experts_warns_that_it_is_data_parallelism(mlp_run):
    loss_fn, params, batches, single = mlp_run
    strategy = pk.ExpertParallel(expert=2, devices=jax.devices()[:4])
    with pytest.warns(UserWarning, match=r"no parameter matched the expert rules .* data parallelism over all 4 "
                      r"devices\. Name each expert weight w_in, w_out, b_in or b_out"):  # fmt: skip
        run = pk.fit(strategy, loss_fn, params, optax.adam(1e-2), batches)
    pk.tour.assert_close(run.params, single)  # it trained, as data parallelism does
    given = pk.ExpertParallel(expert=2, rules=((".*", P()),), devices=jax.devices()[:4])
    with pytest.warns(UserWarning, match=r"no rule in rules= splits a parameter over 'expert'"):
        given.init(params, optax.sgd(0.1))


def test_expert_parallel_on_expert_weights_says_nothing():
    params = {"moe": {"w_in": jnp.zeros((4, 8, 16)), "router": jnp.zeros((8, 4))}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = pk.ExpertParallel(expert=2, devices=jax.devices()[:4]).init(params, optax.sgd(0.1))
    assert state.params["moe"]["w_in"].sharding.spec[0] == "expert"  # the experts split: no warning


@pytest.mark.parametrize("explicit", [False, True])
def test_a_batch_with_no_leading_axis_gets_the_same_sentence_in_both_modes(explicit):
    # On an Explicit mesh jax.device_put refuses it with a bare AssertionError, not a ValueError.
    with pytest.raises(ValueError, match="has no leading \\(batch\\) axis"):
        pk.Mirrored(2, explicit=explicit).place_batch({"x": np.float32(3)})
