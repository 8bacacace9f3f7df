"""The order in which the backward pass finishes each parameter's gradient, read from the loss's jaxpr
(:func:`gradient_order`), for gradient buckets."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from .contract import loss_with_aux
from .types import Batch, LossFn, PyTree

_Position = tuple[int, ...]  # where an equation sits: its index, then its index in each body it is nested in


def gradient_order(loss_fn: LossFn, params: PyTree, batch: Batch, **extras) -> tuple[int, ...]:
    """Indices into ``jax.tree.leaves(params)``, in the order the backward pass finishes their gradients.

    The reverse of each leaf's first use in the forward pass of ``loss_fn(params, batch, **extras)``
    (``extras``: the ``rng`` and ``model_state`` a step passes, if any); leaves first used by the
    same equation keep the reverse of their tree order, and a leaf the loss never reads (its
    gradient is zero from the start) comes first. A *use* is an equation that combines the leaf
    with the batch (or anything computed from it): one that reads parameters and constants alone
    (a cast, a reshape, a slice) only prepares it, and the uses of what it returns count instead.
    Inside a nested call (``jax.jit``, ``jax.checkpoint``, a custom derivative, a ``scan``) the
    equations of its body count, in their order. Traces the loss once (``jax.make_jaxpr``):
    arrays or ``jax.ShapeDtypeStruct`` shapes do.

    >>> import jax.numpy as jnp
    >>> def loss(p, b):  # "a" is used first, "b" last: the backward pass finishes b's gradient first
    ...     return jnp.mean((jnp.tanh(b["x"] @ p["a"]) @ p["b"]) ** 2)
    >>> gradient_order(loss, {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 1))}, {"x": jnp.ones((2, 3))})
    (1, 0)
    """
    loss = loss_with_aux(loss_fn)
    closed = jax.make_jaxpr(lambda p, b, e: loss(p, b, **e))(params, batch, extras)
    count = len(jax.tree.leaves(params))
    jaxpr = closed.jaxpr
    reads_data = [i >= count for i in range(len(jaxpr.invars))]
    first = _first_uses(jaxpr, reads_data, [None] * len(jaxpr.outvars), ())[:count]
    never = (float("inf"),)  # an unread leaf sorts as if used after everything: its gradient comes first
    return tuple(sorted(reversed(range(count)), key=lambda i: first[i] or never, reverse=True))


def _first_uses(
    jaxpr: Jaxpr, reads_data: Sequence[bool], out_uses: Sequence[_Position | None], prefix: _Position
) -> list[_Position | None]:
    """For each input of ``jaxpr``: the position of its first use (None: none), nested under ``prefix``.

    ``reads_data`` says which inputs depend on the batch; ``out_uses`` are the first uses of
    ``jaxpr``'s outputs in the program around it (what an input that is only prepared inherits).
    """
    data = {v for v, flag in zip(jaxpr.invars, reads_data, strict=True) if flag}
    for eqn in jaxpr.eqns:  # forward: which values depend on the batch
        if any(isinstance(v, Var) and v in data for v in eqn.invars):
            data.update(eqn.outvars)
    first: dict[Var, _Position] = {}

    def note(v: object, at: _Position | None) -> None:
        if isinstance(v, Var) and not isinstance(v, Literal) and at is not None:
            first[v] = min(first.get(v, at), at)

    for v, at in zip(jaxpr.outvars, out_uses, strict=True):
        note(v, at)
    for index in reversed(range(len(jaxpr.eqns))):  # backward: a value's uses all come after it
        eqn = jaxpr.eqns[index]
        outs = [first.get(v) for v in eqn.outvars]
        if not any(isinstance(v, Var) and v in data for v in eqn.invars):  # prepares parameters: its outputs' uses
            for v in eqn.invars:
                note(v, min((o for o in outs if o is not None), default=None))
            continue
        body = _body(eqn)
        if body is None:
            for v in eqn.invars:
                note(v, (*prefix, index))
            continue
        inner_data = [isinstance(v, Var) and v in data for v in eqn.invars]
        for v, at in zip(eqn.invars, _first_uses(body, inner_data, outs, (*prefix, index)), strict=True):
            note(v, at)
    return [first.get(v) for v in jaxpr.invars]


def _body(eqn: JaxprEqn) -> Jaxpr | None:
    """The one body an equation calls, if its inputs and outputs are the body's, one for one (jit, scan, ...)."""
    bodies = [p.jaxpr if isinstance(p, ClosedJaxpr) else p for p in eqn.params.values()
              if isinstance(p, ClosedJaxpr | Jaxpr)]  # fmt: skip
    if len(bodies) != 1:
        return None
    body = bodies[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        return None
    return body
