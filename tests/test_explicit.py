"""Explicit sharding mode: the SPMD presets on a mesh of Explicit axes, where an array's sharding is its type.

Each preset that runs explicitly trains equal to its Auto run and to SingleDevice (float32: rtol 1e-5,
atol 1e-6); ``jax.typeof`` shows the shardings of a placed parameter and of an activation inside the
step. What does not run explicitly yet is refused with the reason.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_experts import moe_regression

import parallelkit as pk

DEVICES = 4
STEPS = 3


@pytest.fixture(scope="module")
def setup():
    apply, params = pk.models.build("mlp", (64,), 10)
    batches = list(pk.data.batches(pk.data.digits(), 32, steps=STEPS))
    return apply, params, batches


def _train(strategy, apply, params, batches, seen: list):
    def loss(params, batch):
        logits = apply(params, batch["x"])
        seen.append(jax.typeof(logits))  # runs while the step traces: the activation's type
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    tx = optax.adam(1e-2)
    state, step = strategy.init(params, tx), strategy.step(loss)
    placed = jax.typeof(jax.tree.leaves(state.params)[1])  # a (64, 10) kernel
    for batch in batches:
        state, _ = step(state, batch)
    return strategy.unreplicate(state.params), placed


@pytest.mark.parametrize(
    "make, param_spec",
    [
        (lambda explicit: pk.SingleDevice(explicit=explicit), P(None, None)),
        (lambda explicit: pk.Mirrored(DEVICES, explicit=explicit), P(None, None)),
        (lambda explicit: pk.FullySharded(1, DEVICES, min_size=1, explicit=explicit), P(None, None)),
        (lambda explicit: pk.FullySharded(2, DEVICES, min_size=1, explicit=explicit), P(None, None)),
        (lambda explicit: pk.FullySharded(3, DEVICES, min_size=1, explicit=explicit), P("data", None)),
    ],
    ids=["SingleDevice", "Mirrored(jit)", "FullySharded(1)", "FullySharded(2)", "FullySharded(3)"],
)
def test_a_preset_trains_on_an_explicit_mesh_as_on_an_auto_one_and_as_one_device(setup, make, param_spec):
    apply, params, batches = setup
    single, _ = _train(pk.SingleDevice(), apply, params, batches, [])
    auto, _ = _train(make(False), apply, params, batches, [])
    seen = []
    explicit_strategy = make(True)
    explicit, placed = _train(explicit_strategy, apply, params, batches, seen)
    assert "explicit=True" in repr(explicit_strategy)
    pk.tour.assert_close(explicit, single)  # rtol 1e-5, atol 1e-6
    pk.tour.assert_close(explicit, auto)
    assert placed.sharding.spec == param_spec  # the placed parameter's type carries its sharding
    assert seen and seen[0].sharding.spec == P("data", None)  # the logits: batch over `data` (of size 1 on one)


def test_zero_1_and_2_update_in_the_optimizer_states_layout(setup):
    apply, params, _ = setup
    strategy = pk.FullySharded(1, DEVICES, min_size=1, explicit=True)
    state = strategy.init(params, optax.adam(1e-2))
    kernel = jax.tree.leaves(state.params)[1]
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.shape == kernel.shape]
    assert jax.typeof(kernel).sharding.spec == P(None, None)  # whole parameters on every device
    assert moments and all(jax.typeof(m).sharding.spec == P("data", None) for m in moments)  # Adam's mu, nu: sliced


def test_zero_3_gathers_each_parameter_where_the_loss_uses_it(setup):
    _, params, _ = setup
    strategy = pk.FullySharded(3, DEVICES, min_size=1, explicit=True)
    stored, used = strategy.partition_specs(params), strategy.compute_specs(params)
    assert P("data", None) in jax.tree.leaves(stored, is_leaf=lambda x: isinstance(x, P))
    used_specs = jax.tree.leaves(used, is_leaf=lambda x: isinstance(x, P))
    assert used_specs and all(entry is None for spec in used_specs for entry in spec)  # whole on every replica


def test_what_does_not_run_explicitly_is_refused_with_the_reason(setup):
    apply, params, _ = setup
    loss = pk.models.classifier_loss(apply)
    for bad in ("yes", 1, None):  # a mode is a bool: a truthy string must not pick Explicit axes
        with pytest.raises(ValueError, match=r"explicit=.*pass True \(Explicit axes\) or False"):
            pk.SingleDevice(explicit=bad)
    with pytest.raises(ValueError, match="pmap has no mesh types"):
        pk.Mirrored(2, backend="pmap", explicit=True)
    with pytest.raises(ValueError, match="shard_map, which is Manual mode"):
        pk.Mirrored(DEVICES, allreduce="ring", explicit=True).step(loss)
    with pytest.raises(ValueError, match="accumulate=2"):
        pk.Mirrored(DEVICES, explicit=True).step(loss, accumulate=2)
    axis = jax.sharding.AxisType
    mixed = jax.sharding.Mesh(
        np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"), axis_types=(axis.Explicit, axis.Auto)
    )
    with pytest.raises(ValueError, match="every axis Auto or every axis Explicit"):
        pk.SPMD(mixed, rules=(("batch", "data"),))


def test_a_contraction_with_no_one_place_for_its_result_gets_the_kits_advice():
    mesh = pk.mesh.make_mesh(jax.devices()[:4], data=2, model=2, explicit=True)
    strategy = pk.SPMD(
        mesh, rules=(("batch", "data"),), param_rules=(("w1", P(None, "model")), ("w2", P("model", None)))
    )
    params = {"w1": jnp.ones((8, 16)), "w2": jnp.ones((16, 8))}
    batch = {"x": np.ones((4, 8), np.float32), "y": np.ones((4, 8), np.float32)}

    def loss(params, batch):  # a Megatron pair with nothing said of where the second product lives
        return jnp.mean((batch["x"] @ params["w1"] @ params["w2"] - batch["y"]) ** 2)

    state = strategy.init(params, optax.sgd(0.1))
    with pytest.raises(Exception, match="ambiguous") as caught:
        strategy.step(loss)(state, batch)
    assert type(caught.value).__name__ == "ShardingTypeError"
    assert any("out_sharding=" in note and "explicit=False" in note for note in caught.value.__notes__)


SEQ_LENGTH = 16
GPT_OPTIMIZER = optax.sgd(0.1, momentum=0.9)  # not Adam: see tests/test_context_parallel.py


@pytest.fixture(scope="module")
def gpt():
    model = pk.models.GPT(256, max_length=SEQ_LENGTH, dim=32, heads=4, depth=2, mlp_dim=64, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    batches = list(pk.data.batches(pk.data.text(length=SEQ_LENGTH, max_bytes=20_000), 4, steps=STEPS))
    return apply, params, batches, _train_gpt(pk.SingleDevice(), apply, params, batches, [])[0]


def _train_gpt(strategy, apply, params, batches, seen: list):
    def watched(params, x, *args, **kwargs):
        logits = apply(params, x, *args, **kwargs)
        seen.append(jax.typeof(logits))  # runs while the step traces: the activation's type
        return logits

    state, step = strategy.init(params, GPT_OPTIMIZER), strategy.step(pk.models.lm_loss(watched))
    placed = jax.typeof(state.params["blocks"][0]["mlp_in"]["kernel"])
    for batch in batches:
        state, _ = step(state, batch)
    return strategy.unreplicate(state.params), placed


FOUR = slice(0, 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, mlp_in, logits",
    [
        (
            lambda e: pk.TensorParallel(2, devices=jax.devices()[:2], explicit=e),
            P(None, "model"),
            P("data", None, None),
        ),
        (
            lambda e: pk.TensorParallel(2, sequence_parallel=True, devices=jax.devices()[:2], explicit=e),
            P(None, "model"),
            P("data", "model", None),  # a token at a time: the norm's length split over `model`
        ),
        (lambda e: pk.Hybrid(2, 2, devices=jax.devices()[FOUR], explicit=e), P(None, "model"), P("data", None, None)),
        (
            lambda e: pk.ContextParallel(seq=2, method="ring", data=2, devices=jax.devices()[FOUR], explicit=e),
            P(None, None),
            P("data", "seq", None),  # every sequence split over `seq`
        ),
        (
            lambda e: pk.ContextParallel(seq=2, method="ulysses", data=2, devices=jax.devices()[FOUR], explicit=e),
            P(None, None),
            P("data", "seq", None),
        ),
    ],
    ids=["TensorParallel", "TensorParallel(SP)", "Hybrid", "ContextParallel(ring)", "ContextParallel(ulysses)"],
)
def test_the_models_presets_train_on_an_explicit_mesh_as_on_an_auto_one_and_as_one_device(gpt, make, mlp_in, logits):
    apply, params, batches, single = gpt
    auto, _ = _train_gpt(make(False), apply, params, batches, [])
    seen = []
    explicit, placed = _train_gpt(make(True), apply, params, batches, seen)
    pk.tour.assert_close(explicit, single)  # rtol 1e-5, atol 1e-6
    pk.tour.assert_close(explicit, auto)
    assert placed.sharding.spec == mlp_in  # Megatron's column split is the kernel's type
    assert seen and seen[0].sharding.spec == logits  # the logits inside the step carry their layout


@pytest.mark.slow
def test_expert_parallel_trains_on_an_explicit_mesh_with_its_experts_where_they_live():
    loss_fn, params, batches = moe_regression(groups=4, steps=4)
    tx = optax.sgd(0.1)
    single = pk.fit(pk.SingleDevice(), loss_fn, params, tx, batches).params
    strategy = pk.ExpertParallel(expert=2, data=2, devices=jax.devices()[:4], explicit=True)
    auto = pk.fit(pk.ExpertParallel(expert=2, data=2, devices=jax.devices()[:4]), loss_fn, params, tx, batches).params
    run = pk.fit(strategy, loss_fn, params, tx, batches)
    pk.tour.assert_close(run.params, single)
    pk.tour.assert_close(run.params, auto)
    assert jax.typeof(run.state.params["moe"]["w_in"]).sharding.spec[0] == "expert"  # each device its experts


# Reduced and unreduced types (JAX 0.10): what the kit would accumulate with on an Explicit mesh, and the one
# limit that keeps it on the Auto mesh's replica rows for now.
K = 4


def _two_device_mesh():
    return pk.mesh.make_mesh(jax.devices()[:2], data=2, explicit=True)


def _while_bodies_with(hlo: str, op: str) -> list[str]:
    """The names of the while loops' body computations in ``hlo`` that hold ``op``."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)  # one block per computation
    return [b.split()[0].lstrip("%") for b in blocks if b.split() and b.split()[0].lstrip("%") in bodies and op in b]


def test_reduced_parameters_give_unreduced_gradients_that_meet_once_after_the_loop():
    mesh = _two_device_mesh()
    x = np.random.default_rng(0).normal(size=(K, 8, 3)).astype(np.float32)  # K microbatches of 8, split over data

    def loss(w, xb):
        return jnp.mean((xb @ w) ** 2)

    def accumulated(w, x):
        held = jax.sharding.reshard(w, P(reduced={"data"}))  # replicated, its gradient a partial sum
        zero = jax.sharding.reshard(jnp.zeros_like(w), P(unreduced={"data"}))

        def body(total, xb):
            g = jax.grad(loss)(held, xb)
            assert "U:data" in str(jax.typeof(g))  # each device's own partial sum: no collective
            return total + g, None

        total, _ = jax.lax.scan(body, zero, x)
        return jax.sharding.reshard(total, P()) / K  # the one all-reduce (JAX 0.10 cannot divide unreduced)

    with jax.set_mesh(mesh):
        w = jax.device_put(jnp.ones((3, 5)), P())
        xs = jax.device_put(x, P(None, "data"))
        step = jax.jit(accumulated)
        got = step(w, xs)
        hlo = step.lower(w, xs).compile().as_text()
    whole = jax.grad(lambda w: jnp.mean(jnp.stack([loss(w, xb) for xb in x])))(jnp.ones((3, 5)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(whole), rtol=1e-5, atol=1e-6)
    assert hlo.count(" all-reduce(") == 1 and not _while_bodies_with(hlo, " all-reduce(")  # once, after the loop


def test_jax_still_refuses_a_reduced_bias_beside_a_batch_split_activation():
    """Why explicit accumulation waits: a layer's bias, reduced, added to a batch-split activation. When this test
    fails, JAX accepts it: build the kit's accumulation on an Explicit mesh with reduced types (the test above)."""
    mesh = _two_device_mesh()

    def loss(params, x):
        w, b = params
        return jnp.mean(x @ w + b)

    def grads(w, b, x):
        held = jax.tree.map(lambda p: jax.sharding.reshard(p, P(reduced={"data"})), (w, b))
        return jax.grad(loss)(held, x)

    with jax.set_mesh(mesh):
        w, b = jax.device_put(jnp.ones((3, 5)), P()), jax.device_put(jnp.ones((5,)), P())
        x = jax.device_put(jnp.ones((4, 3)), P("data"))
        with pytest.raises(
            Exception, match="cannot be sharded/varying on the same axes that another input is reduced"
        ) as caught:
            jax.jit(grads)(w, b, x)
    assert type(caught.value).__name__ == "ShardingTypeError"
