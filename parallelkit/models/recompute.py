"""Recomputation: :func:`remat` with JAX's named policies, and a layout's recomputation (:func:`recomputation`:
``none``, ``selective``, ``full``) for the kit's transformers.

References:
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from ..core.axes import setting

POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")
RECOMPUTE = ("none", "selective", "full")  # a layout's recomputation, for every model of the kit

_RECOMPUTATION: contextvars.ContextVar[str] = contextvars.ContextVar("recomputation", default="none")


def _checkpoint_policy(name: str) -> Callable[..., bool]:
    """The ``jax.checkpoint_policies`` function called ``name``.

    >>> _checkpoint_policy("dots_saveable") is jax.checkpoint_policies.dots_saveable
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
    _checkpoint_policy(remat)
    return remat


def remat(fn: Callable[..., Any], policy: str = "nothing_saveable") -> Callable[..., Any]:
    """``fn`` recomputed in the backward pass instead of keeping its activations, under ``policy``.

    ``fn`` is a layer: a function whose arguments are arrays (or trees of arrays) and NNX
    modules, wrapped with ``nnx.remat`` (``jax.checkpoint`` that also takes modules), or an
    NNX module, whose call is wrapped the same way. Arguments that are not arrays (a head
    count, a flag) must be bound before wrapping, for example with a ``lambda``.
    Same results as ``fn``; the policies are :data:`POLICIES` (docs/memory.md says what each keeps).

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
    saveable = _checkpoint_policy(policy)
    if isinstance(fn, nnx.Module):
        return functools.partial(nnx.remat(lambda module, *args: module(*args), policy=saveable), fn)
    return nnx.remat(fn, policy=saveable)


def maybe_remat(fn: Callable[..., Any], policy: str | None) -> Callable[..., Any]:
    """``remat(fn, policy)``, or ``fn`` itself when ``policy`` is None (a model's ``remat=False``)."""
    return fn if policy is None else remat(fn, policy)


def check_recomputation(name: str) -> None:
    """Raise a ValueError naming :data:`RECOMPUTE` unless ``name`` is one of them."""
    if name not in RECOMPUTE:
        raise ValueError(
            f"Unknown recomputation {name!r}: use one of {', '.join(map(repr, RECOMPUTE))} "
            "(pk.models.remat takes jax.checkpoint_policies' names instead)."
        )


def recomputation(name: str) -> contextlib.AbstractContextManager:
    """A block inside which the kit's transformers recompute as ``name`` says (one of :data:`RECOMPUTE`).

    Open it where the step is traced (in the loss function, or in a strategy that takes a recomputation):
    the models read it then (:func:`active_recomputation`), not at every call.

    >>> with recomputation("full"):
    ...     active_recomputation()
    'full'
    >>> active_recomputation()
    'none'

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    check_recomputation(name)
    return setting(_RECOMPUTATION, name)


def active_recomputation() -> str:
    """The recomputation of the innermost :func:`recomputation` block: ``"none"`` outside any."""
    return _RECOMPUTATION.get()


def block_policy(name: str) -> str | None:
    """The policy (a name of :data:`POLICIES`) a transformer block runs under for recomputation ``name``.

    ``"nothing_saveable"`` for ``"full"``; None (the block is not wrapped) for ``"none"`` and for
    ``"selective"``, which recomputes inside attention only (:func:`_scores_policy`).

    >>> block_policy("none"), block_policy("selective"), block_policy("full")
    (None, None, 'nothing_saveable')

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    check_recomputation(name)
    return "nothing_saveable" if name == "full" else None


def _scores_policy(name: str) -> str | None:
    """The policy (a name of :data:`POLICIES`) attention's scores and softmax run under for recomputation ``name``.

    ``"nothing_saveable"`` for ``"selective"``: from the queries, keys and values, the backward pass
    computes the scores and probabilities again. None (not wrapped) for ``"none"`` and for ``"full"``,
    whose block recomputes them already (:func:`block_policy`).

    >>> _scores_policy("none"), _scores_policy("selective"), _scores_policy("full")
    (None, 'nothing_saveable', None)

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    check_recomputation(name)
    return "nothing_saveable" if name == "selective" else None


def recompute_block(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, a transformer block, wrapped as the active recomputation says (:func:`block_policy`).

    Read when ``fn``'s caller is traced. ``fn`` takes arrays and modules, as for :func:`remat`.
    """
    return maybe_remat(fn, block_policy(active_recomputation()))


def recompute_scores(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, attention's scores and softmax, wrapped as the active recomputation says (:func:`_scores_policy`).

    Read when ``fn``'s caller is traced. ``fn`` takes arrays (None for an absent one), as for :func:`remat`.
    """
    return maybe_remat(fn, _scores_policy(active_recomputation()))
