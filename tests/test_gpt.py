"""pk.models.GPT and lm_loss: shapes, causality, dropout, annotations, learning, and Mirrored equal to one device."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit.core.partition import nnx_specs

LENGTH = 64
# Adam for the equivalence runs. Its g / (sqrt(v) + eps) turns the summation-order noise of a near-zero
# gradient (one device sums the batch in one order, four devices in another) into a full-size update when
# eps is tiny; eps = 1e-3 keeps every update well-conditioned, so equal training means equal parameters.
EQUIVALENCE_ADAM = optax.adam(1e-3, eps=1e-3)


def _gpt(seed: int = 0, **overrides) -> pk.models.GPT:
    config = {"max_length": LENGTH, "dim": 32, "heads": 4, "depth": 2, "mlp_dim": 64, **overrides}
    return pk.models.GPT(256, **config, rngs=nnx.Rngs(seed))


def _tokens(batch: int = 2, length: int = LENGTH, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, 256, dtype=jnp.int32)


@pytest.fixture(scope="module")
def corpus() -> pk.data.Dataset:
    return pk.data.text(length=LENGTH)


def test_shapes():
    model = _gpt()
    apply, params = pk.models.functional(model)
    logits = jax.jit(apply)(params, _tokens(3, 40))
    assert logits.shape == (3, 40, 256) and logits.dtype == jnp.float32
    assert model.embed.embedding.shape == (256, 32)
    assert model.position.shape == (LENGTH, 32)
    assert model.head.kernel.shape == (32, 256)  # its own weights: not tied to the embedding
    assert len(model.blocks) == 2


def test_logits_at_a_position_depend_only_on_earlier_tokens():
    apply, params = pk.models.functional(_gpt())
    apply, tokens = jax.jit(apply), _tokens()
    changed = tokens.at[:, 40].set((tokens[:, 40] + 1) % 256)
    before, after = np.asarray(apply(params, tokens)), np.asarray(apply(params, changed))
    np.testing.assert_array_equal(after[:, :40], before[:, :40])
    assert np.abs(after[:, 40:] - before[:, 40:]).min(axis=-1).max() > 0  # the change reaches later positions


def test_parameters_carry_logical_axes_and_split_without_a_mesh():
    model = _gpt()
    specs = nnx_specs(model)
    block = specs["blocks"][0]
    assert specs["embed"]["embedding"] == P("vocab", "embed")
    assert specs["position"] == P(None, "embed")
    assert specs["head"] == {"kernel": P("embed", "vocab"), "bias": P("vocab")}
    assert block["query"] == block["value"] == {"kernel": P("embed", "heads"), "bias": P("heads")}
    assert block["key"] == {"kernel": P("embed", "heads")}
    assert block["out"] == {"kernel": P("heads", "embed"), "bias": P("embed")}
    assert block["mlp_in"] == {"kernel": P("embed", "mlp"), "bias": P("mlp")}
    assert block["mlp_out"] == {"kernel": P("mlp", "embed"), "bias": P("embed")}
    assert block["attn_norm"] == specs["norm"] == {"scale": P("embed"), "bias": P("embed")}
    _, params = pk.models.functional(model)  # the annotations ask for no mesh
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(params))


def test_dropout_only_with_a_key():
    tokens, key = _tokens(), jax.random.key(1)
    apply, params = pk.models.functional(_gpt(dropout=0.3))
    plain_apply, plain_params = pk.models.functional(_gpt(dropout=0.0))
    apply, plain_apply = jax.jit(apply), jax.jit(plain_apply)
    tree_allclose(params, plain_params, rtol=0, atol=0)  # the rate changes no weight
    without = np.asarray(apply(params, tokens))
    np.testing.assert_array_equal(without, plain_apply(plain_params, tokens))
    np.testing.assert_array_equal(plain_apply(plain_params, tokens, rng=key), without)  # rate 0: a key changes nothing
    dropped = np.asarray(apply(params, tokens, rng=key))
    assert not np.allclose(dropped, without)
    np.testing.assert_array_equal(apply(params, tokens, rng=key), dropped)  # one key, one mask
    assert not np.allclose(apply(params, tokens, rng=jax.random.key(2)), dropped)


@pytest.mark.slow
def test_loss_falls_below_what_context_free_prediction_can_reach(corpus):
    train, test = pk.data.split(corpus, 0.9)
    held_out = {"x": test.x[:128], "y": test.y[:128]}
    # The lowest loss on these targets of any model that ignores the context: their own byte frequencies.
    freq = np.bincount(held_out["y"].ravel(), minlength=256) / held_out["y"].size
    context_free = -np.sum(freq[freq > 0] * np.log(freq[freq > 0]))
    apply, params = pk.models.functional(_gpt(mlp_dim=128))
    loss_fn = pk.models.lm_loss(apply)
    strategy = pk.SingleDevice()
    state, step = strategy.init(params, optax.adam(5e-3)), strategy.step(loss_fn)
    for batch in pk.data.batches(train, 16, steps=50):
        state, _ = step(state, batch)
    initial, _ = loss_fn(params, held_out)
    final, aux = loss_fn(state.params, held_out)
    assert abs(float(initial) - math.log(256)) < 0.05  # small initial weights: uniform over the bytes
    assert float(final) < context_free < float(initial)
    np.testing.assert_allclose(aux["perplexity"], np.exp(final), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_mirrored_equals_single_device(corpus, dropout):
    """Under jit the step's key draws the dropout masks for the global batch, as on one device: equal parameters."""
    apply, params = pk.models.functional(_gpt(dropout=dropout))
    loss_fn = pk.models.lm_loss(apply)
    rng = 0 if dropout else None
    results = []
    for strategy in (pk.SingleDevice(), pk.Mirrored(4, backend="jit")):
        state, step = strategy.init(params, EQUIVALENCE_ADAM, rng=rng), strategy.step(loss_fn)
        for batch in pk.data.batches(corpus, 8, steps=10):
            state, _ = step(state, batch)
        results.append(strategy.unreplicate(state.params))
    tree_allclose(results[1], results[0])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["allgather", "ring", "ulysses"])
def test_tokens_split_over_seq_train_as_one_device(corpus, method):
    """pk.SPMD on data=2 x seq=2, the tokens (and every activation's length axis) over seq, attention by ``method``:
    SingleDevice's parameters after 5 Adam steps (float32 tolerance), and the method's collective in the step."""
    apply, params = pk.models.functional(_gpt())
    loss_fn = pk.models.lm_loss(apply)
    mesh = pk.mesh.make_mesh(jax.devices()[:4], data=2, seq=2)
    tokens = ("batch", "length")
    spmd = pk.SPMD(mesh, rules=(("batch", "data"), ("length", "seq")), batch_axes={"x": tokens, "y": tokens})
    results = []
    with pk.attention.method(method):
        for strategy in (pk.SingleDevice(), spmd):
            state, step = strategy.init(params, EQUIVALENCE_ADAM), strategy.step(loss_fn)
            for batch in pk.data.batches(corpus, 4, steps=5):
                state, _ = step(state, batch)
            results.append(strategy.unreplicate(state.params))
    tree_allclose(results[1], results[0])
    hlo = step.lower(state, batch).compile().as_text()
    expected = {"allgather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}[method]
    assert expected in hlo


def test_bad_input_is_a_clear_error():
    model = _gpt()
    with pytest.raises(ValueError, match=f"max_length={LENGTH}.*max_length >= 65"):
        model(_tokens(length=LENGTH + 1))
    with pytest.raises(ValueError, match=r"\(batch, length\)"):
        model(jnp.zeros((LENGTH,), jnp.int32))
    with pytest.raises(ValueError, match="dim=30 must divide into heads=4"):
        _gpt(dim=30)
    apply, params = pk.models.functional(model)
    tokens = _tokens()
    with pytest.raises(ValueError, match="needs targets batch\\['y'\\].*has no 'y'"):
        pk.models.lm_loss(apply)(params, {"x": tokens})
    with pytest.raises(ValueError, match=r"has shape \(2, 63\)"):
        pk.models.lm_loss(apply)(params, {"x": tokens, "y": tokens[:, 1:]})
