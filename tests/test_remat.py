"""Recomputation: the models' ``remat`` option and ``pk.models.remat`` give the same numbers and keep less."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tree_allclose

import parallelkit as pk
from parallelkit.models.recompute import POLICIES

BATCH = {"x": jnp.asarray(np.random.default_rng(0).normal(size=(16, 8, 8, 1)), jnp.float32), "y": jnp.arange(16) % 10}


def loss_and_grads(module, **extras):
    """The loss and its gradient with respect to every parameter of ``module``, one jitted call."""
    apply, params = pk.models.functional(module)
    loss_fn = pk.models.classifier_loss(apply)
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(p, BATCH, **extras)[0]))(params)


MODELS = {
    "mlp": lambda remat: pk.models.MLP(64, (32, 32, 16), 10, remat=remat, rngs=nnx.Rngs(0)),
    "transformer": lambda remat: pk.models.Transformer((8, 8, 1), 10, depth=2, remat=remat, rngs=nnx.Rngs(0)),
    "tower": lambda remat: pk.models.Tower(64, 32, 4, 10, remat=remat, rngs=nnx.Rngs(0)),
}


@functools.cache
def plain(name: str):
    return loss_and_grads(MODELS[name](False), **EXTRAS[name])


EXTRAS = {"mlp": {}, "transformer": {"rng": jax.random.key(1)}, "tower": {}}  # dropout on: recomputed with the same key


@pytest.mark.parametrize("policy", [True, *POLICIES])
@pytest.mark.parametrize("name", ["mlp", "tower", pytest.param("transformer", marks=pytest.mark.slow)])
def test_the_remat_option_gives_the_same_loss_and_gradients(name, policy):
    plain_loss, plain_grads = plain(name)
    loss, grads = loss_and_grads(MODELS[name](policy), **EXTRAS[name])
    tree_allclose(loss, plain_loss)
    tree_allclose(grads, plain_grads)


def test_the_helper_wraps_a_function_of_arrays_and_a_module():
    dense = nnx.Linear(64, 10, rngs=nnx.Rngs(0))
    x = BATCH["x"].reshape(16, -1)

    def layer(kernel, x):
        return jnp.tanh(x @ kernel)

    kernel = dense.kernel[...]
    expected = jax.grad(lambda k: layer(k, x).sum())(kernel)
    for policy in POLICIES:
        recomputed = pk.models.remat(layer, policy)
        tree_allclose(jax.grad(lambda k, f=recomputed: f(k, x).sum())(kernel), expected)
    tree_allclose(pk.models.remat(dense, "dots_saveable")(x), dense(x))


def test_a_module_of_ones_own_recomputes_its_layers():
    class Deep(nnx.Module):
        def __init__(self, remat, rngs):
            self.layers = nnx.List([nnx.Linear(64 if i == 0 else 32, 32, rngs=rngs) for i in range(3)])
            self.head = nnx.Linear(32, 10, rngs=rngs)
            self.remat = remat

        def __call__(self, x):
            x = x.reshape(x.shape[0], -1)
            for layer in self.layers:
                x = (pk.models.remat(layer) if self.remat else layer)(x)
            return self.head(jax.nn.gelu(x))

    plain_loss, plain_grads = loss_and_grads(Deep(False, nnx.Rngs(0)))
    loss, grads = loss_and_grads(Deep(True, nnx.Rngs(0)))
    tree_allclose(loss, plain_loss)
    tree_allclose(grads, plain_grads)


def test_recomputation_lowers_the_compilers_temporary_memory():
    """Each of the tower's 16 scanned layers keeps its activations for the backward pass without remat;
    with nothing_saveable it keeps only its input, so the temporaries fall by at least one activation
    (batch x width floats) per layer. (XLA's CPU backend merges the recomputation of an unrolled loop's
    layers with their forward pass again, so it is the scanned tower that shows the drop here.)"""
    batch, width, depth = 64, 64, 16
    data = {"x": jnp.ones((batch, 64)), "y": jnp.zeros(batch, jnp.int32)}
    temp = {}
    for remat in (False, "nothing_saveable"):
        apply, params = pk.models.functional(pk.models.Tower(64, width, depth, 10, remat=remat, rngs=nnx.Rngs(0)))
        loss_fn = pk.models.classifier_loss(apply)
        step = jax.jit(jax.grad(lambda p, b, loss_fn=loss_fn: loss_fn(p, b)[0]))
        temp[remat] = pk.inspect.memory_per_device(step, params, data).temp
    assert temp[False] - temp["nothing_saveable"] >= depth * batch * width * 4


class TestErrors:
    def test_an_unknown_policy_lists_the_known_ones(self):
        with pytest.raises(
            ValueError, match="Unknown recomputation policy 'dots'.*'nothing_saveable', 'dots_saveable'"
        ):
            pk.models.remat(lambda x: x, "dots")

    @pytest.mark.parametrize("name", sorted(MODELS))
    def test_a_models_remat_option_is_checked_when_built(self, name):
        with pytest.raises(ValueError, match="Unknown recomputation policy 'save_everything'"):
            MODELS[name]("save_everything")
        with pytest.raises(ValueError, match="remat must be False, True or a policy name"):
            MODELS[name](1)
