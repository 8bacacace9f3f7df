"""The small models: shapes, parameter trees, the functional view."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallelkit as pk


@pytest.mark.parametrize(
    ("name", "shape"), [("mlp", (8, 8, 1)), ("cnn", (8, 8, 1)), ("cnn", (32, 32, 3)), ("mlp", (28, 28, 1))]
)
def test_logits_shape(name, shape):
    apply, params = pk.models.build(name, shape, 10)
    assert apply(params, jnp.zeros((5, *shape))).shape == (5, 10)
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_params_are_a_plain_dict_and_the_seed_decides_them():
    _, a = pk.models.build("mlp", (8, 8, 1), 10, seed=0)
    _, b = pk.models.build("mlp", (8, 8, 1), 10, seed=0)
    _, c = pk.models.build("mlp", (8, 8, 1), 10, seed=1)
    assert isinstance(a, dict) and set(a) == {"hidden", "head"}
    assert a["head"]["kernel"].shape == (64, 10)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert not np.allclose(a["head"]["kernel"], c["head"]["kernel"])


def test_param_bytes_counts_every_float():
    _, params = pk.models.build("mlp", (8, 8, 1), 10)
    assert pk.models.param_bytes(params) == 4 * (64 * 64 + 64 + 64 * 10 + 10)


def test_loss_uses_params_not_captured_state():
    apply, params = pk.models.build("mlp", (8, 8, 1), 10)
    x = jnp.ones((2, 8, 8, 1))
    zeroed = jax.tree.map(jnp.zeros_like, params)
    assert not np.allclose(apply(params, x), 0)
    np.testing.assert_array_equal(apply(zeroed, x), 0)


def test_unknown_model():
    with pytest.raises(ValueError, match="Unknown model"):
        pk.models.build("resnet", (8, 8, 1), 10)
