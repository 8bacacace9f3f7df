"""Recomputation: keep fewer activations for the backward pass, and compute them again when it needs them.

A layer wrapped by :func:`remat` keeps, from its forward pass, only what its policy saves;
the backward pass recomputes the rest from the layer's inputs. The activations held between
the two passes can shrink, at the price of computing the layer's forward pass again (up to
once more); the results are the same up to float rounding. The policies are JAX's
(``jax.checkpoint_policies``):

- ``"nothing_saveable"``: keep nothing inside the layer, only its inputs; least memory, most recomputation.
- ``"dots_saveable"``: keep the results of matrix products, recompute what lies between them.
- ``"dots_with_no_batch_dims_saveable"``: keep only the products without batch dimensions in the
  ``dot_general`` sense (``x @ kernel``, not attention's per-example ``einsum`` of queries and keys).
- ``"everything_saveable"``: keep everything, recompute nothing (as without recomputation).

PyTorch's ``torch.utils.checkpoint`` is the same idea with the first policy.

The compiler decides what is kept in the end. Read from the compiled program with
:func:`parallelkit.measure.inspect.memory_per_device` on XLA's CPU backend, the temporaries of
layers run by ``jax.lax.scan`` (:class:`~parallelkit.models.Tower`) fall, while XLA merges the
recomputation of layers in an unrolled Python loop (:class:`~parallelkit.models.MLP`,
:class:`~parallelkit.models.Transformer`) back into their forward pass, so theirs do not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


def checkpoint_policy(name: str) -> Callable[..., bool]:
    """The ``jax.checkpoint_policies`` function called ``name``.

    >>> checkpoint_policy("dots_saveable") is jax.checkpoint_policies.dots_saveable
    True

    Raises:
      ValueError: a name that is not one of :data:`POLICIES`.
    """
    if name not in POLICIES:
        raise ValueError(
            f"Unknown recomputation policy {name!r}: choose one of {', '.join(map(repr, POLICIES))} "
            "(jax.checkpoint_policies of the same names)."
        )
    return getattr(jax.checkpoint_policies, name)


def remat_policy(remat: bool | str) -> str | None:
    """The policy a model's ``remat`` option asks for: ``None`` for False, ``"nothing_saveable"`` for True.

    >>> remat_policy(False), remat_policy(True), remat_policy("dots_saveable")
    (None, 'nothing_saveable', 'dots_saveable')

    Raises:
      ValueError: anything but False, True or a name of :data:`POLICIES`.
    """
    if remat is False or remat is True:
        return "nothing_saveable" if remat else None
    if not isinstance(remat, str):
        raise ValueError(
            f"remat must be False, True or a policy name ({', '.join(map(repr, POLICIES))}), not {remat!r}."
        )
    checkpoint_policy(remat)
    return remat


def remat(fn: Callable[..., Any], policy: str = "nothing_saveable") -> Callable[..., Any]:
    """``fn`` recomputed in the backward pass instead of keeping its activations, under ``policy``.

    ``fn`` is a layer: a function whose arguments are arrays (or trees of arrays) and NNX
    modules, wrapped with ``nnx.remat`` (``jax.checkpoint`` that also takes modules), or an
    NNX module, whose call is wrapped the same way. Arguments that are not arrays (a head
    count, a flag) must be bound before wrapping, for example with a ``lambda``.
    Same results as ``fn``; see the module docstring for the policies.

    >>> import jax.numpy as jnp
    >>> layer = remat(lambda w, x: jnp.tanh(x @ w), "dots_saveable")
    >>> float(jax.grad(lambda w: layer(w, jnp.ones((1, 2))).sum())(jnp.zeros((2, 3))).sum())
    6.0
    >>> dense = remat(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> dense(jnp.ones((1, 2))).shape
    (1, 3)

    Raises:
      ValueError: an unknown policy name, listing the known ones.
    """
    saveable = checkpoint_policy(policy)
    if isinstance(fn, nnx.Module):
        return functools.partial(nnx.remat(lambda module, *args: module(*args), policy=saveable), fn)
    return nnx.remat(fn, policy=saveable)


def maybe_remat(fn: Callable[..., Any], policy: str | None) -> Callable[..., Any]:
    """``remat(fn, policy)``, or ``fn`` itself when ``policy`` is None (a model's ``remat=False``)."""
    return fn if policy is None else remat(fn, policy)
