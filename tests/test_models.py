"""The small models: shapes, parameter trees, the functional view."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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


def test_every_parameter_of_the_kits_models_declares_one_name_per_dimension():
    """The kit's models declare each parameter's logical axes (BatchNorm's scale and bias excepted)."""
    for module in (
        pk.models.MLP(64, (32, 16), 10, rngs=nnx.Rngs(0)),
        pk.models.CNN((8, 8, 1), 10, rngs=nnx.Rngs(0)),
        pk.models.Transformer((8, 8, 1), 10, rngs=nnx.Rngs(0)),
    ):
        axes, params = pk.models.param_axes(module), pk.models.functional(module)[1]
        fits = jax.tree.map(lambda p, names: isinstance(names, tuple) and len(names) == p.ndim, params, axes)
        assert jax.tree.leaves(fits) and all(jax.tree.leaves(fits)), fits
    transformer = pk.models.param_axes(pk.models.Transformer((8, 8, 1), 10, rngs=nnx.Rngs(0)))
    assert transformer["blocks"][0]["query"]["kernel"] == ("embed", "heads")
    assert transformer["blocks"][1]["out"]["kernel"] == ("heads", "embed")
    assert transformer["blocks"][0]["mlp_in"]["kernel"] == ("embed", "mlp")
    assert transformer["blocks"][0]["mlp_out"]["kernel"] == ("mlp", "embed")
    assert transformer["position"] == ("length", "embed")


def test_the_mlp_alternates_mlp_and_embed():
    axes = pk.models.param_axes(pk.models.MLP(64, (32, 16, 8), 10, rngs=nnx.Rngs(0)))
    kernels = [axes["hidden"][i]["kernel"] for i in range(3)] + [axes["head"]["kernel"]]
    assert kernels == [("features", "mlp"), ("mlp", "embed"), ("embed", "mlp"), ("mlp", "classes")]


def test_declared_axes_are_found_from_the_plain_parameters():
    model = pk.models.from_nnx(pk.models.CNN((8, 8, 1), 10, batch_norm=True, rngs=nnx.Rngs(0)))
    copy = jax.tree.map(lambda x: np.asarray(x) + 1, model.params)  # other values, same structure and shapes
    axes = pk.models.declared_axes(copy)
    assert (
        axes["convs"][0]["kernel"] == (None, None, "channels", "hidden_channels") and axes["norms"][0]["scale"] is None
    )
    assert pk.models.declared_axes({"w": np.zeros((3, 4))}) is None


def test_a_module_declaring_nothing_replaces_an_older_declaration_of_the_same_shapes():
    class Same(nnx.Module):  # the parameter tree of MLP(4, (8,), 2), without declarations
        def __init__(self, rngs):
            self.hidden = nnx.List([nnx.Linear(4, 8, rngs=rngs)])
            self.head = nnx.Linear(8, 2, rngs=rngs)

    _, params = pk.models.functional(pk.models.MLP(4, (8,), 2, rngs=nnx.Rngs(0)))
    assert pk.models.declared_axes(params) is not None
    pk.models.functional(Same(nnx.Rngs(0)))
    assert pk.models.declared_axes(params) is None
    pk.models.functional(pk.models.MLP(4, (8,), 2, rngs=nnx.Rngs(0)))  # the last module wins again
    assert pk.models.declared_axes(params)["hidden"][0]["kernel"] == ("features", "mlp")
