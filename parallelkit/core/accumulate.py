"""Gradient accumulation: ``K`` microbatches inside one compiled step, the gradients synchronised once.

Holds the checks of ``accumulate=``, the microbatch split, :class:`Accumulation` (a scan per replica) and
:class:`ReplicaCopies` (each replica's own copy of the parameters)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .contract import batch_size
from .precision import cast_floating, is_floating
from .types import Batch, PyTree, is_count

_SUPPORTED = (
    "SingleDevice, Mirrored (both backends), MultiWorkerMirrored, TensorParallel, FullySharded, Hybrid, SPMD, "
    "CentralStorage and ParameterServer (mode='sync')"
)


def check_accumulate(accumulate: Any) -> int:
    """``accumulate`` as the number of microbatches a step runs; raises unless it is a whole number >= 1.

    >>> check_accumulate(4)
    4
    """
    if not is_count(accumulate):
        raise ValueError(
            f"accumulate={accumulate!r}: the number of microbatches a step cuts each replica's slice of the "
            "batch into must be a whole number >= 1 (1: no accumulation)."
        )
    return int(accumulate)  # a NumPy integer is a whole number too


def refuse_accumulation(who: str, accumulate: Any, hint: str = "") -> None:
    """Raise a ``NotImplementedError`` for ``accumulate > 1`` on a strategy that cannot accumulate yet.

    Args:
      who: the strategy, as its ``repr``.
      accumulate: what its ``step`` was given (checked first: a bad value is a ``ValueError``).
      hint: what to do instead, a sentence.
    """
    if check_accumulate(accumulate) > 1:
        raise NotImplementedError(
            f"{who}.step(loss_fn, accumulate={accumulate}): this strategy cannot accumulate gradients yet; "
            f"{_SUPPORTED} can. {hint}".strip()
        )


def _check_batch(batch: Batch, accumulate: int, replicas: int) -> int:
    """The microbatch size of one replica; a global batch that does not divide by ``accumulate x replicas`` raises.

    >>> _check_batch({"x": jnp.zeros((64, 3))}, 4, 8)
    2
    """
    size = batch_size(batch)
    if size % (accumulate * replicas):
        raise ValueError(
            f"A global batch of {size} examples does not split into {accumulate} microbatches on each of "
            f"{replicas} replicas: use a batch size divisible by {accumulate} x {replicas} = {accumulate * replicas}."
        )
    return size // (accumulate * replicas)


def accumulated_placement(place_batch: Callable[[Batch], Batch], accumulate: int, replicas: int) -> Callable:
    """``place_batch``, first checking that the global batch divides by ``accumulate x replicas`` (where ``K > 1``)."""
    if accumulate == 1:
        return place_batch

    def place(batch: Batch) -> Batch:
        _check_batch(batch, accumulate, replicas)
        return place_batch(batch)

    return place


def microbatches(batch: Batch, accumulate: int, replicas: int) -> Batch:
    """Each array as ``(accumulate, replicas, micro, ...)``: microbatch ``k`` is the ``k``-th ``1/K`` of every slice.

    Replica ``r``'s slice is rows ``r * B/n`` to ``(r + 1) * B/n`` of the global batch, as the
    strategy places it, so no example moves between devices.

    >>> microbatches({"x": jnp.arange(8)}, 2, 2)["x"].tolist()
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    """
    _check_batch(batch, accumulate, replicas)
    return jax.tree.map(lambda x: x.reshape(replicas, accumulate, -1, *x.shape[1:]).swapaxes(0, 1), batch)


_COPIES = "parallelkit_replica_copies"  # the name the replicas' copies of the parameters carry (checkpoint_name)


def _identity(tree: PyTree) -> PyTree:
    return tree


@dataclass(frozen=True)
class Accumulation:
    """How one step accumulates: ``steps`` microbatches, on ``replicas`` rows of the program's batch.

    Args:
      steps: ``K``, the microbatches a step runs.
      replicas: the replica axis the program maps over with ``jax.vmap`` where it sees the global batch
        (``jax.jit`` with shardings); 1 where its batch is one replica's (a per-device program, or one
        device): a plain scan.
      spmd_axes: the mesh axes that replica axis lies on (``vmap``'s ``spmd_axis_name``).
      place_microbatches: lays out the ``(K, replicas, micro, ...)`` batch.
      place_rows: lays out the per-replica gradient rows in the carry.
      within_replica: the context one replica's loss is traced in (the strategy's axis rules,
        its ``batch`` no longer split: the replica axis already is).
    """

    steps: int
    replicas: int = 1
    spmd_axes: str | tuple[str, ...] | None = None
    place_microbatches: Callable[[Batch], Batch] = _identity
    place_rows: Callable[[PyTree], PyTree] = _identity
    within_replica: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)

    def __call__(self, loss: Callable, params: PyTree, batch: Batch, extras: dict) -> tuple[tuple, PyTree]:
        """``((loss, (aux, model_state)), grads)`` as ``jax.value_and_grad`` of ``loss`` gives them, averaged
        over every microbatch.

        ``loss(params, batch, **extras)`` returns ``(value, (aux, model_state))``. Microbatch ``k``
        draws with ``fold_in(extras["rng"], k)`` (mapped, each replica with its own split of that key);
        each starts from the step's model state, and the new model states are averaged, as the metrics are.
        """
        grad_fn = jax.value_and_grad(loss, has_aux=True)
        micro = self.place_microbatches(microbatches(batch, self.steps, self.replicas))
        rng = extras.get("rng")

        def one(params, mb, key):
            if self.replicas == 1:
                return grad_fn(params, jax.tree.map(lambda x: x[0], mb), **_with_key(extras, key))
            with self.within_replica():
                return _per_replica(self, lambda b, kw: grad_fn(params, b, **kw), mb, extras, key)

        def body(total, xs):
            mb, index = xs
            key = None if rng is None else jax.random.fold_in(rng, index)
            out, grads = one(params, mb, key)
            return self.place_rows(jax.tree.map(jnp.add, total, grads)), out

        shapes = jax.eval_shape(one, params, jax.tree.map(lambda x: x[0], micro), rng)[1]
        zeros = self.place_rows(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        total, outs = jax.lax.scan(body, zeros, (micro, jnp.arange(self.steps)))
        mapped_axes = (0,) if self.replicas == 1 else (0, 1)
        grads = jax.tree.map(lambda g: (g.mean(0) if self.replicas > 1 else g) / self.steps, total)
        return jax.tree.map(lambda x: _mean(x, mapped_axes), outs), grads


def _with_key(extras: dict, key: jax.Array | None) -> dict:
    return extras if key is None else {**extras, "rng": key}


def _per_replica(mapping: Accumulation | ReplicaCopies, fn: Callable, rows: Batch, extras: dict, key, *args) -> Any:
    """``fn(row, extras, *args)`` mapped over the leading (replica) axis of ``rows`` and of each of ``args``,
    on the mesh axes ``mapping.spmd_axes``; replica ``r`` draws with split ``r`` of ``key``."""
    keys = None if key is None else jax.random.split(key, mapping.replicas)
    return jax.vmap(
        lambda b, k, *a: fn(b, _with_key(extras, k), *a),
        in_axes=(0, None if keys is None else 0, *(0 for _ in args)),
        spmd_axis_name=mapping.spmd_axes,
    )(rows, keys, *args)


@dataclass(frozen=True)
class ReplicaCopies:
    """One pass over the global batch, each replica computing on a copy of the parameters of its own.

    The mean over the replicas of each one's loss (on its slice of the batch, with its own copy of
    the parameters, cast to ``dtype``) is differentiated as a whole. The copies are made by
    :func:`_replica_copies`, whose transpose casts each replica's gradient back to its parameter's dtype
    *before* the sum over the replicas: under ``jax.jit`` with shardings that sum is the gradient's
    reduction across devices, so it runs in the parameters' dtype, leaf by leaf, and each sum is laid
    out as the strategy lays out its gradients (``place_grads``). Each replica draws with its own split
    of the step's key, as under :class:`Accumulation`. Fully sharded strategies use it under 16-bit
    compute (why, and at what price: :mod:`parallelkit.core.precision`). Conceptually, with ``n`` replicas::

        grads = mean(float32(grad(loss)(compute(params), b_r)) for b_r in split(batch, n))

    Args:
      replicas: ``n``.
      spmd_axes: the mesh axes the replica axis lies on (``vmap``'s ``spmd_axis_name``).
      dtype: the dtype of the copies (the compute dtype).
      place_rows: lays out the ``(replicas, micro, ...)`` batch.
      place_copies: lays out the ``(replicas, *shape)`` copies of every parameter.
      place_grads: lays out the gradients, as the sum over the copies gives them.
      within_replica: the context one replica's loss is traced in.
    """

    replicas: int
    spmd_axes: str | tuple[str, ...] | None
    dtype: Any
    place_rows: Callable[[Batch], Batch] = _identity
    place_copies: Callable[[PyTree], PyTree] = _identity
    place_grads: Callable[[PyTree], PyTree] = _identity
    within_replica: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)

    def __call__(self, loss: Callable, params: PyTree, batch: Batch, extras: dict) -> tuple[tuple, PyTree]:
        """``((loss, (aux, model_state)), grads)``: the replicas' means, and the gradients of the mean loss."""
        copies = _replica_copies(self.replicas, self.dtype, self.place_copies, self.place_grads)

        def mean_loss(params, batch, **extras):
            rows = self.place_rows(jax.tree.map(lambda x: x.reshape(self.replicas, -1, *x.shape[1:]), batch))
            key = extras.pop("rng", None)
            with self.within_replica():
                out = _per_replica(self, lambda b, kw, p: loss(p, b, **kw), rows, extras, key, copies(params))
            return jax.tree.map(lambda x: _mean(x, (0,)), out)

        # The backward pass makes the copies again rather than keep them from the forward pass (as fully
        # sharded training gathers its parameters again): kept, every device would hold all of them.
        mean_loss = jax.checkpoint(mean_loss, policy=jax.checkpoint_policies.save_anything_except_these_names(_COPIES))

        _check_batch(batch, 1, self.replicas)
        return jax.value_and_grad(mean_loss, has_aux=True)(params, batch, **extras)


def _replica_copies(
    replicas: int, dtype: Any, place: Callable[[PyTree], PyTree] = _identity, place_sum: Callable = _identity
) -> Callable:
    """``copies(params)``: every floating parameter cast to ``dtype`` and repeated ``replicas`` times on a new
    leading axis (laid out by ``place``); its transpose casts each copy's cotangent back to the parameter's
    dtype, then sums the copies (where a plain cast then broadcast would sum in ``dtype`` first), laid out
    by ``place_sum``.

    >>> copies = _replica_copies(2, jnp.bfloat16)
    >>> copies({"w": jnp.ones(3)})["w"].dtype, copies({"w": jnp.ones(3)})["w"].shape
    (dtype(bfloat16), (2, 3))
    >>> jax.grad(lambda p: copies(p)["w"].astype(jnp.float32).sum())({"w": jnp.ones(3)})["w"].tolist()
    [2.0, 2.0, 2.0]
    """

    def forward(params):
        copied = jax.tree.map(lambda p: jnp.broadcast_to(p, (replicas, *jnp.shape(p))), cast_floating(params, dtype))
        return jax.tree.map(lambda c: checkpoint_name(c, _COPIES), place(copied))

    @jax.custom_vjp
    def copies(params):
        return forward(params)

    def fwd(params):
        return forward(params), jax.tree.map(lambda p: jnp.zeros((), jnp.result_type(p)), params)

    def bwd(dtypes, cotangents):
        def back(c, like):
            if not is_floating(like):
                return np.zeros(c.shape[1:], jax.dtypes.float0)
            return c.astype(like.dtype).sum(0)

        return (place_sum(jax.tree.map(back, cotangents, dtypes)),)

    copies.defvjp(fwd, bwd)
    return copies


def _mean(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """The mean of ``x`` over ``axes``, in ``x``'s dtype."""
    return jnp.mean(x, axis=axes).astype(x.dtype)
