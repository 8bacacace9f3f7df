"""Megatron's sequence parallelism at a block's edges: :func:`gather_columns` and :func:`scatter_rows`.

References:
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022.

>>> from flax import nnx
>>> layer = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
>>> x = jnp.ones((2, 3, 4))
>>> bool(jnp.array_equal(gather_columns(x, [layer], "heads")[0], layer(x)))
True
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from ...core import axes
from .basic import apply_layer

RESIDUAL = ("batch", "norm_length", "embed")  # the residual stream's logical axes (MaxText's activation_norm_length)


def _split_axis(output: str) -> tuple[jax.sharding.Mesh, P, str] | None:
    """(mesh, the residual stream's spec, the mesh axis) when the active rules split ``norm_length`` and
    ``output`` over one mesh axis of more than one device; None otherwise (the layer runs as it is)."""
    found = axes.active()
    if found is None:
        return None
    mesh, rules = found
    residual, split = rules.spec(RESIDUAL), rules.mesh_axes(output)
    if not isinstance(residual[1], str) or residual[1] != split or mesh.shape[split] == 1:
        return None
    return mesh, residual, split


def gather_columns(x: jax.Array, layers: Sequence[nnx.Linear], output: str) -> list[jax.Array]:
    """Each of ``layers`` (column-split: their outputs are the logical axis ``output``) applied to ``x``.

    Under sequence parallelism, ``x`` (``(batch, length, embed)``, split along the length)
    is all-gathered once over the split's mesh axis and each device multiplies the whole
    sequence by its columns of every kernel; the backward pass reduce-scatters the
    gradient of ``x`` (the transpose of the all-gather). Anywhere else: ``[layer(x) ...]``.
    """
    found = _split_axis(output)
    if found is None:
        return [apply_layer(layer, x) for layer in layers]
    mesh, residual, axis = found
    kernels = [layer.kernel[...] for layer in layers]
    biases = [layer.bias[...] if layer.bias is not None else None for layer in layers]
    out = P(residual[0], None, axis)
    in_specs = (residual, [P(None, axis)] * len(kernels), [None if b is None else P(axis) for b in biases])

    def local(x, kernels, biases):
        whole = lax.all_gather(x, axis, axis=1, tiled=True)  # every token, for this device's columns
        return [_linear(whole, k, b) for k, b in zip(kernels, biases, strict=True)]

    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=[out] * len(kernels))(x, kernels, biases)


def scatter_rows(x: jax.Array, layer: nnx.Linear, output: str) -> jax.Array:
    """Row-split ``layer`` (its input is the logical axis ``output`` of the previous layer) applied to ``x``.

    Under sequence parallelism each device multiplies its slice of ``x``'s features by
    its rows of the kernel (a partial sum over the whole sequence), and one
    reduce-scatter sums the partial sums and leaves each device its own tokens (split
    along the length as the residual stream is); the bias is added after. The backward
    pass all-gathers the output's gradient. Anywhere else: ``layer(x)``.
    """
    found = _split_axis(output)
    if found is None:
        return apply_layer(layer, x)
    mesh, residual, axis = found

    def local(x, kernel):
        partial_sum = _linear(x, kernel, None)
        return lax.psum_scatter(partial_sum, axis, scatter_dimension=1, tiled=True)

    in_specs = (P(residual[0], None, axis), P(axis, None))
    y = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=residual)(x, layer.kernel[...])
    return y if layer.bias is None else y + layer.bias[...]


def _linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None) -> jax.Array:
    y = jnp.einsum("...d,df->...f", x, kernel)
    return y if bias is None else y + bias
