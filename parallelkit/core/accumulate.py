"""Gradient accumulation: ``K`` microbatches inside one compiled step, the gradients synchronised once.

``strategy.step(loss_fn, accumulate=K)`` cuts each replica's slice of the global batch into
``K`` equal microbatches and runs them one after another in a ``lax.scan``, summing the
gradients in the loop's carry; the step then averages them and synchronises once, as
PyTorch's DDP does with ``no_sync()`` on the first ``K - 1`` microbatches. Conceptually,
for one replica with its slice ``b`` of the global batch::

    grads = mean(grad(loss_fn)(params, b_k) for b_k in split(b, K))  # no communication
    grads = all_reduce_mean(grads)                                   # once a step

which equals one step on the whole batch because the loss is a mean over equal-sized
microbatches. Where the program is one per device (``pmap``, ``shard_map``) the scan runs
there and the synchronisation is the explicit one after it (for central storage and
parameter servers, the push of each worker's one gradient row). Where it is one ``jax.jit``
with shardings the compiler would all-reduce inside the loop, once per microbatch; there
the replicas are an explicit axis of the program (``jax.vmap`` with ``spmd_axis_name``),
so each device's gradients stay its own row in the carry and the mean over the rows after
the loop is the one all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from .contract import Batch, PyTree, batch_size

SUPPORTED = (
    "SingleDevice, Mirrored (both backends), MultiWorkerMirrored, TensorParallel, FullySharded, Hybrid, SPMD, "
    "CentralStorage and ParameterServer (mode='sync')"
)


def check_accumulate(accumulate: Any) -> int:
    """``accumulate`` as the number of microbatches a step runs; raises unless it is a whole number >= 1.

    >>> check_accumulate(4)
    4
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(
            f"accumulate={accumulate!r}: the number of microbatches a step cuts each replica's slice of the "
            "batch into must be a whole number >= 1 (1: no accumulation)."
        )
    return accumulate


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
            f"{SUPPORTED} can. {hint}".strip()
        )


def check_batch(batch: Batch, accumulate: int, replicas: int) -> int:
    """The microbatch size of one replica; a global batch that does not divide by ``accumulate x replicas`` raises.

    >>> check_batch({"x": jnp.zeros((64, 3))}, 4, 8)
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
        check_batch(batch, accumulate, replicas)
        return place_batch(batch)

    return place


def microbatches(batch: Batch, accumulate: int, replicas: int) -> Batch:
    """Each array as ``(accumulate, replicas, micro, ...)``: microbatch ``k`` is the ``k``-th ``1/K`` of every slice.

    Replica ``r``'s slice is rows ``r * B/n`` to ``(r + 1) * B/n`` of the global batch, as the
    strategy places it, so no example moves between devices.

    >>> microbatches({"x": jnp.arange(8)}, 2, 2)["x"].tolist()
    [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    """
    check_batch(batch, accumulate, replicas)
    return jax.tree.map(lambda x: x.reshape(replicas, accumulate, -1, *x.shape[1:]).swapaxes(0, 1), batch)


def _identity(tree: PyTree) -> PyTree:
    return tree


@dataclass(frozen=True)
class Accumulation:
    """How one step accumulates: ``steps`` microbatches, on ``replicas`` rows of the program's batch.

    With ``replicas == 1`` the program's batch is one replica's (a per-device program, or one
    device): a plain scan. With ``replicas > 1`` the program sees the global batch (``jax.jit``
    with shardings) and maps the gradient over the replicas with ``jax.vmap``.

    Args:
      steps: ``K``, the microbatches a step runs.
      replicas: the replica axis the program maps over (1: none).
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

    def __call__(self, grad_fn: Callable, params: PyTree, batch: Batch, extras: dict) -> tuple[tuple, PyTree]:
        """``((loss, (aux, model_state)), grads)`` as ``grad_fn`` gives them, averaged over every microbatch.

        ``grad_fn(params, batch, **extras)`` is ``jax.value_and_grad`` of the loss. Microbatch ``k``
        draws with ``fold_in(extras["rng"], k)`` (mapped, each replica with its own split of that key);
        each starts from the step's model state, and the new model states are averaged, as the metrics are.
        """
        micro = self.place_microbatches(microbatches(batch, self.steps, self.replicas))
        rng = extras.get("rng")

        def one(params, mb, key):
            kw = extras if key is None else {**extras, "rng": key}
            if self.replicas == 1:
                return grad_fn(params, jax.tree.map(lambda x: x[0], mb), **kw)
            keys = None if key is None else jax.random.split(key, self.replicas)
            with self.within_replica():
                mapped = jax.vmap(
                    lambda b, k: grad_fn(params, b, **(kw if k is None else {**kw, "rng": k})),
                    in_axes=(0, None if keys is None else 0),
                    spmd_axis_name=self.spmd_axes,
                )
                return mapped(mb, keys)

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


def _mean(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """The mean of ``x`` over ``axes``, in ``x``'s dtype."""
    return jnp.mean(x, axis=axes).astype(x.dtype)
