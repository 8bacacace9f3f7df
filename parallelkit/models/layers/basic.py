"""The small layers the kit's models build from: dense and layer-norm layers that declare their logical
axes (:func:`parallelkit.models.with_axes`), a layer applied on any mesh (:func:`apply_layer`), and
dropout drawn from one key for the whole array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ...core.axes import explicit_active, held_spec
from ..functional import with_axes


def dense(
    width_in: int,
    width_out: int,
    axis_in: str,
    axis_out: str,
    rngs: nnx.Rngs,
    *,
    use_bias: bool = True,
    kernel_init: nnx.Initializer | None = None,
) -> nnx.Linear:
    """``nnx.Linear`` whose kernel declares the logical axes ``(axis_in, axis_out)`` and its bias ``(axis_out,)``;
    the kernel drawn by ``kernel_init`` (LeCun normal, Flax's default, when None)."""
    return nnx.Linear(
        width_in,
        width_out,
        use_bias=use_bias,
        kernel_init=with_axes(kernel_init or nnx.initializers.lecun_normal(), (axis_in, axis_out)),
        bias_init=with_axes(nnx.initializers.zeros_init(), (axis_out,)),
        rngs=rngs,
    )


def apply_layer(layer: nnx.Linear | nnx.Conv | nnx.Embed, x: jax.Array) -> jax.Array:
    """``layer(x)``; under an Explicit mesh (``jax.set_mesh``), with the result's place said.

    On an Explicit mesh an array's sharding is its type, and some results could live in two
    places: a product whose contracted features are split over devices (a Megatron row-split
    kernel, dense or convolutional), or the rows of an embedding table picked by tokens split over
    the batch. JAX asks which (``ShardingTypeError``). Here the result lives where its inputs put
    it: ``x``'s dimensions as ``x`` has them (the contracted features of a dense or convolution
    layer excepted), its features as the kernel's (or table's) last axis. For a row-split kernel
    that is the sum over the devices (the all-reduce); for a column-split one, each device's own
    columns. On an Auto mesh, one device or in plain code: ``layer(x)``.

    >>> layer = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
    >>> bool(jnp.array_equal(apply_layer(layer, jnp.ones((2, 4))), layer(jnp.ones((2, 4)))))
    True
    """
    if not explicit_active():
        return layer(x)
    table = layer.embedding if isinstance(layer, nnx.Embed) else layer.kernel
    kept = x.ndim if isinstance(layer, nnx.Embed) else x.ndim - 1  # dense and conv layers contract x's last axis
    return layer(x, out_sharding=P(*held_spec(x)[:kept], held_spec(table[...])[-1]))


def layer_norm(dim: int, axis: str, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """``nnx.LayerNorm`` whose scale and bias declare the logical axis ``axis``."""
    return nnx.LayerNorm(
        dim,
        scale_init=with_axes(nnx.initializers.ones_init(), (axis,)),
        bias_init=with_axes(nnx.initializers.zeros_init(), (axis,)),
        rngs=rngs,
    )


def apply_dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout drawn from ``key`` for the whole array; the identity without a key."""
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0)
