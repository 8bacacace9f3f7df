"""The small layers the kit's models build from: dense and layer-norm layers that declare their logical
axes (:func:`parallelkit.models.with_axes`), and dropout drawn from one key for the whole array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

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
