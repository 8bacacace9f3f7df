"""Attention over a sequence split across devices: dense, all-gather, ring (plain and zig-zag) and Ulysses;
:func:`attend` is what a model calls.

>>> import jax.numpy as jnp
>>> q = k = v = jnp.ones((1, 4, 2, 8))
>>> attend(q, k, v).shape
(1, 4, 2, 8)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ...core import axes
from ...core.types import SEQ, MeshAxes
from ..recompute import recompute_scores

METHODS = ("allgather", "ring", "ring_zigzag", "ulysses")
_DEFAULT_METHOD = "allgather"  # what attend uses when no method block is open
NAMES = ("batch", "length", "heads", None)  # the logical axes of q, k, v and the output

Block = tuple[jax.Array, jax.Array, jax.Array]  # online softmax state: row max, row sum, unnormalised output


def dense(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """``softmax(q k^T / sqrt(head_dim)) v`` per batch row and head, each query seeing only earlier keys if ``causal``.

    The reference every other method equals. Scores are float32 and the softmax
    subtracts each row's maximum before ``exp``, so nothing overflows: every term is at
    most ``exp(0) = 1``, and each row's sum is at least 1. A term far below its row's
    maximum underflows to 0 (``exp(-200)`` does in float32). That is harmless: its true
    weight is far below float32's rounding of a sum of at least 1.

    >>> q = jnp.zeros((1, 3, 1, 1)); v = jnp.arange(3.0).reshape(1, 3, 1, 1)
    >>> dense(q, q, v)[0, :, 0, 0].tolist()  # equal scores: the mean of the visible values
    [0.0, 0.5, 1.0]
    >>> k = jnp.array([0.0, 200.0]).reshape(1, 2, 1, 1); v = jnp.array([5.0, 7.0]).reshape(1, 2, 1, 1)
    >>> # the second query's scores, 0 and 200: exp(200) would overflow; shifted, the terms are exp(-200) = 0 and 1
    >>> dense(jnp.ones((1, 2, 1, 1)), k, v)[0, :, 0, 0].tolist()
    [5.0, 7.0]
    """
    _check_arrays(q, k, v)
    return _normalise(*_block(q, k, v, _diagonal(q.shape[1]) if causal else None)).astype(q.dtype)


def _block(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array | None = None) -> Block:
    """One block of the online softmax: row max ``m``, row sum ``l`` of ``exp(s - m)``, and ``exp(s - m) v``.

    ``visible[query, key]`` masks the scores (``None``: every key visible); every row
    must see at least one key, as every query sees itself under a causal mask. Under
    :func:`parallelkit.models.recompute.recomputation` ``"selective"`` the backward pass
    computes the block's scores and probabilities again from ``q``, ``k`` and ``v``
    instead of keeping them.
    """
    return recompute_scores(_softmax_block)(q, k, v, visible)


def _softmax_block(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array | None) -> Block:
    """:func:`_block`'s arithmetic, as one function that recomputation can wrap."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m = s.max(axis=-1)
    p = jnp.exp(s - m[..., None])
    return m, p.sum(axis=-1), jnp.einsum("bhqk,bkhd->bhqd", p, v.astype(jnp.float32))


def _causal(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """The causal mask between queries and keys at these global positions: a key at or before its query."""
    return q_positions[:, None] >= k_positions[None, :]


def _diagonal(length: int) -> jax.Array:
    """The causal mask of a block of queries against the keys at the same positions."""
    return _causal(jnp.arange(length), jnp.arange(length))


def _merge(a: Block, b: Block) -> Block:
    """Two blocks' softmax states as one: each rescaled to the larger running max (log-sum-exp)."""
    m = jnp.maximum(a[0], b[0])
    scale_a, scale_b = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return m, scale_a * a[1] + scale_b * b[1], scale_a[..., None] * a[2] + scale_b[..., None] * b[2]


def _normalise(m: jax.Array, l: jax.Array, o: jax.Array) -> jax.Array:  # noqa: E741 (the usual name of the sum)
    """The attention output ``(batch, length, heads, head_dim)`` from a softmax state."""
    return jnp.swapaxes(o / l[..., None], 1, 2)


def _allgather(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, causal: bool) -> jax.Array:
    # Each device keeps its queries and gathers every key and value: (n-1)/n of the K,V bytes arrive.
    k, v = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
    starts = lax.axis_index(axis) * q.shape[1]
    visible = _causal(starts + jnp.arange(q.shape[1]), jnp.arange(k.shape[1])) if causal else None
    return _normalise(*_block(q, k, v, visible))


def _ring(
    q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, size: int, causal: bool, zigzag: bool = False
) -> jax.Array:
    # At step s device i holds the keys and values of block (i - s) mod n: n - 1 permutes of one block. In the
    # contiguous order block i - s is wholly in the past for s <= i, wholly in the future otherwise: skipped.
    # Zig-zag: device i holds chunks i and 2n-1-i of 2n (a chunk c = length / 2n). Against any other device's
    # block, either all its queries see the first half of the keys (an earlier device's) or the second half of
    # its queries sees all the keys (a later device's): 2c^2 scores on every device at every step.
    i, c = lax.axis_index(axis), q.shape[1] // 2
    positions, past, future = jnp.arange(q.shape[1]), _add_block, _skip_block
    if zigzag:
        q, k, v = (_to_zigzag(x, axis, size) for x in (q, k, v))
        positions = jnp.concatenate([i * c + jnp.arange(c), (2 * size - 1 - i) * c + jnp.arange(c)])
        past, future = _add_first_keys, _add_to_last_queries
    state = _block(q, k, v, _causal(positions, positions) if causal else None)  # its own: the only one partly masked
    for s in range(1, size):
        k, v = lax.ppermute((k, v), axis, [(j, (j + 1) % size) for j in range(size)])  # each to the next device
        if causal:
            state = lax.cond(s <= i, past, future, q, state, k, v)
        else:
            state = _add_block(q, state, k, v)
    return _from_zigzag(_normalise(*state), axis, size) if zigzag else _normalise(*state)


def _add_block(q: jax.Array, state: Block, k: jax.Array, v: jax.Array) -> Block:
    """``state`` with a wholly visible block of keys and values added."""
    return _merge(state, _block(q, k, v))


def _skip_block(q: jax.Array, state: Block, k: jax.Array, v: jax.Array) -> Block:
    """``state`` unchanged: a block wholly in the future adds nothing."""
    return state


def _add_first_keys(q: jax.Array, state: Block, k: jax.Array, v: jax.Array) -> Block:
    """An earlier device's block: every query sees its first chunk and none of its second."""
    c = k.shape[1] // 2
    return _add_block(q, state, k[:, :c], v[:, :c])


def _add_to_last_queries(q: jax.Array, state: Block, k: jax.Array, v: jax.Array) -> Block:
    """A later device's block: the second chunk of queries sees all of it, the first chunk none."""
    c = q.shape[1] // 2
    first, last = (tuple(x[:, :, :c] for x in state), tuple(x[:, :, c:] for x in state))
    last = _add_block(q[:, c:], last, k, v)
    return tuple(jnp.concatenate(pair, axis=2) for pair in zip(first, last, strict=True))


def _zigzag_pairs(size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where each device's first and second contiguous chunk goes in the zig-zag layout: two permutations.

    Contiguously device d holds chunks 2d and 2d + 1; chunk m < n goes to device m, chunk m >= n to 2n-1-m.
    """
    home = [m if m < size else 2 * size - 1 - m for m in range(2 * size)]
    return [(d, home[2 * d]) for d in range(size)], [(d, home[2 * d + 1]) for d in range(size)]


def _to_zigzag(x: jax.Array, axis: str, size: int) -> jax.Array:
    """This device's chunks i and 2n-1-i of the sequence, from the contiguous chunks 2i and 2i+1 (two permutes)."""
    c = x.shape[1] // 2
    evens, odds = _zigzag_pairs(size)
    even, odd = lax.ppermute(x[:, :c], axis, evens), lax.ppermute(x[:, c:], axis, odds)
    i_even = lax.axis_index(axis) % 2 == 0  # chunk i has i's parity, chunk 2n-1-i the other
    return jnp.where(i_even, jnp.concatenate([even, odd], 1), jnp.concatenate([odd, even], 1))


def _from_zigzag(x: jax.Array, axis: str, size: int) -> jax.Array:
    """The inverse of :func:`_to_zigzag`: chunks 2i and 2i+1 back on device i."""
    c = x.shape[1] // 2
    evens, odds = _zigzag_pairs(size)
    i_even = lax.axis_index(axis) % 2 == 0
    even, odd = jnp.where(i_even, x[:, :c], x[:, c:]), jnp.where(i_even, x[:, c:], x[:, :c])
    back = [(b, a) for a, b in evens], [(b, a) for a, b in odds]
    return jnp.concatenate([lax.ppermute(even, axis, back[0]), lax.ppermute(odd, axis, back[1])], 1)


def _ulysses(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str, causal: bool) -> jax.Array:
    # all-to-all: (length/n, heads) -> (length, heads/n); attention on whole sequences; and back.
    to_heads = partial(lax.all_to_all, axis_name=axis, split_axis=2, concat_axis=1, tiled=True)
    q, k, v = (to_heads(x) for x in (q, k, v))
    out = _normalise(*_block(q, k, v, _diagonal(q.shape[1]) if causal else None))
    return lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def context_parallel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    axis: str = SEQ,
    method: str,
    causal: bool = True,
    batch_axes: MeshAxes = None,
) -> jax.Array:
    """Attention with the length split over mesh axis ``axis``, by one method, in ``jax.shard_map``.

    Equal to :func:`dense` (up to float rounding). Each device holds ``length / n``
    queries, keys and values (``n`` the size of ``axis``) and the same slice of the output:

    - ``"allgather"``: each device all-gathers every key and value and attends its
      queries to them, masking by global positions.
    - ``"ring"``: keys and values travel round the ring with ``lax.ppermute`` (``n - 1``
      steps, unrolled); an online softmax keeps each query's running max, sum and output
      and rescales them as each block arrives, so each step scores the queries against
      one block of keys, never all of them. With ``causal``, a block wholly in the future
      is skipped by ``lax.cond`` (not computed: it adds exactly nothing), and only the
      device's own diagonal block is masked. Balance: in this contiguous order device
      ``i`` computes ``i + 1`` blocks, the last device ``n`` and the first one, and every
      step waits for the busiest.
    - ``"ring_zigzag"``: the same ring with device ``i`` holding chunks ``i`` and
      ``2n - 1 - i`` of ``2n`` (an early and a late one), so that with ``causal`` every
      device computes half a block of scores against each other device's block: the
      same work everywhere. Two permutes of half a block move each of q, k, v into that
      layout and two move the output back; a training run would load its tokens in
      zig-zag order once instead. The length must divide by ``2n``.
    - ``"ulysses"``: an all-to-all trades the length split for a split of the heads,
      each device attends ``heads / n`` heads over the whole sequence, and a second
      all-to-all trades back.

    Args:
      q, k, v: ``(batch, length, heads, head_dim)`` arrays of one shape.
      mesh: the device mesh.
      axis: the mesh axis that splits the length.
      method: one of :data:`METHODS`.
      causal: whether each query sees only keys at or before its position.
      batch_axes: mesh axes that split the batch (``"data"``, say), or ``None``.

    Raises:
      ValueError: an unknown method, an axis the mesh lacks, a length (or batch) that
        does not divide by its split, or heads that do not divide by ``n`` for Ulysses.
    """
    _check_arrays(q, k, v)
    if axis not in mesh.shape:
        raise ValueError(
            f"The mesh has axes {tuple(mesh.shape)}, not {axis!r}: build it with that axis "
            f"(pk.mesh.make_mesh({axis}=...)) or pass one of its axes as axis=."
        )
    return _shard_mapped(q, k, v, mesh=mesh, spec=P(batch_axes, axis, None, None), method=method, causal=causal)


def _shard_mapped(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh, spec: P, method: str, causal: bool
) -> jax.Array:
    """``method`` in ``shard_map`` over ``mesh``, q, k, v and the output laid out by ``spec`` (length: ``spec[1]``)."""
    axis = spec[1]
    size = mesh.shape[axis]
    check_method(method)
    _check_split(q.shape, spec, mesh)
    if method == "ring_zigzag" and q.shape[1] % (2 * size):
        raise ValueError(
            f"The zig-zag ring cuts the length into 2 x {size} chunks: {q.shape[1]} does not divide by {2 * size}. "
            f"Use a length divisible by {2 * size}, or method='ring'."
        )
    if method == "ulysses":
        heads = q.shape[2] // axes.split_size(mesh, spec[2])
        if heads % size:
            raise ValueError(
                f"Ulysses splits the heads over mesh axis {axis!r}: {heads} head(s) do not divide by its {size} "
                f"devices. Use a head count divisible by {size}, or another method."
            )
    body: Callable = {
        "allgather": partial(_allgather, axis=axis, causal=causal),
        "ring": partial(_ring, axis=axis, size=size, causal=causal),
        "ring_zigzag": partial(_ring, axis=axis, size=size, causal=causal, zigzag=True),
        "ulysses": partial(_ulysses, axis=axis, causal=causal),
    }[method]
    # check_vma=False: JAX 0.10.2's varying-axes check rejects a lax.cond inside shard_map under
    # jax.vmap(spmd_axis_name=...), which gradient accumulation uses. The gradients stay those of dense
    # (tested with the batch split over a mesh axis and replicated across it).
    out = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
    return out.astype(q.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """Attention as a model should call it: :func:`dense`, or context parallel under a strategy that splits ``length``.

    While a strategy traces its step with logical axis rules
    (:func:`parallelkit.core.axes.active_rules`) that put ``length`` on a mesh axis of
    more than one device, this is :func:`context_parallel` on that mesh and axis, with
    the batch and heads split as the rules say and the method of the innermost
    :func:`method` block (``"allgather"`` outside any). Anywhere else it is :func:`dense`.
    The method is read when the step is traced (its first call), not at every call.
    """
    found = axes.active()
    if found is not None:
        mesh, rules = found
        spec = rules.spec(NAMES)
        if spec[1] is not None and axes.split_size(mesh, spec[1]) > 1:
            if not isinstance(spec[1], str):
                raise ValueError(
                    f"The axis rules put 'length' on several mesh axes {spec[1]}; context parallel attention "
                    "splits it over one: map 'length' to a single mesh axis."
                )
            _check_arrays(q, k, v)
            name = axes.active_context_method() or _DEFAULT_METHOD
            return _shard_mapped(q, k, v, mesh=mesh, spec=spec, method=name, causal=causal)
    return dense(q, k, v, causal=causal)


def method(name: str) -> contextlib.AbstractContextManager:
    """A block inside which :func:`attend` splits the sequence by method ``name`` (one of :data:`METHODS`).

    >>> with method("ring"):
    ...     axes.active_context_method()
    'ring'

    Raises:
      ValueError: an unknown method.
    """
    check_method(name)
    return axes.context_method(name)


def check_method(name: str) -> None:
    """Raise a ValueError naming :data:`METHODS` unless ``name`` is one of them."""
    if name not in METHODS:
        raise ValueError(f"Unknown attention method {name!r}: use one of {', '.join(map(repr, METHODS))}.")


def _check_arrays(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or not q.shape == k.shape == v.shape:
        raise ValueError(
            f"Attention takes q, k, v of one shape (batch, length, heads, head_dim); got {q.shape}, {k.shape}, "
            f"{v.shape}. Reshape the projections to (batch, length, heads, head_dim)."
        )


def _check_split(shape: tuple[int, ...], spec: P, mesh: Mesh) -> None:
    for size, entry, name in zip(shape, spec, ("batch", "length", "heads"), strict=False):
        pieces = axes.split_size(mesh, entry)
        if size % pieces:
            raise ValueError(
                f"The {name} {size} does not split over the {pieces} devices of mesh axis {entry!r}: "
                f"use a {name} divisible by {pieces}."
            )
