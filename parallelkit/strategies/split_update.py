"""Does an optimizer give the same update when a strategy runs it on pieces of the parameters?

:func:`check_update_splits` is the probe :class:`~parallelkit.ParameterServer` (each shard's flat
slice) and :class:`~parallelkit.Pipeline` (each stage's layers) run when they build their state:
``tx.init`` and two ``tx.update`` calls on the whole tree and on its pieces, with deterministic
gradients at a small and at a very large scale (so that any clipping threshold is crossed), the
updates compared. It is a probe, not a proof; a passed probe is remembered for the same optimizer
object, split and shapes. Which optimizers split and why (element-wise ones do;
``clip_by_global_norm``, LAMB, LARS and masks by path do not) is taught in notebook 04.

>>> import numpy as np, optax
>>> params = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}
>>> split, join = (lambda t: [{"a": t["a"]}, {"b": t["b"]}]), (lambda ps: ps[0] | ps[1])
>>> words = dict(strategy="A demo", how="runs the optimizer on each of its 2 pieces separately", what_to_do="")
>>> check_update_splits(optax.adam(1e-3), params, split, join, **words)
>>> check_update_splits(optax.clip_by_global_norm(1.0), params, split, join, **words)
Traceback (most recent call last):
ValueError: A demo runs the optimizer on each of its 2 pieces separately, ...
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import jax
import numpy as np
import optax

from ..core.types import PyTree

_SCALES = (1e-6, 1e6)  # probe gradients: small enough for no clip to act, then large enough for any to
RTOL = 1e-5  # float32: an element-wise optimizer gives the same update whole or in pieces, to rounding


def _probe_gradients(params: PyTree, scale: float) -> PyTree:
    """Deterministic gradients shaped like ``params``: ``scale x sin(0.7 i + 0.3)`` for the ``i``-th element overall.

    Computed in NumPy (float64, then each leaf's dtype); leaves that are not floating point get zeros.

    >>> _probe_gradients({"w": np.zeros(3)}, 2.0)["w"].round(3).tolist()
    [0.591, 1.683, 1.983]
    """
    leaves, treedef = jax.tree.flatten(params)
    grads, offset = [], 0
    for leaf in leaves:
        x = np.asarray(leaf)
        if np.issubdtype(x.dtype, np.inexact):
            index = np.arange(offset, offset + x.size, dtype=np.float64).reshape(x.shape)
            grads.append((scale * np.sin(0.7 * index + 0.3)).astype(x.dtype))
        else:
            grads.append(np.zeros_like(x))
        offset += x.size
    return treedef.unflatten(grads)


class _PieceFailed(Exception):
    """The optimizer raised on a piece (not on the whole)."""


def check_update_splits(
    tx: optax.GradientTransformation,
    params: PyTree,
    split: Callable[[PyTree], Sequence[PyTree]],
    join: Callable[[Sequence[PyTree]], PyTree],
    *,
    strategy: str,
    how: str,
    what_to_do: str,
    layout: Hashable = None,
) -> None:
    """Raise a ValueError if ``tx`` run on each piece of ``params`` differs from ``tx`` run on the whole.

    The probe (the module docstring's) is one small program, compiled and run on the host CPU, its
    gradients :func:`_probe_gradients` at each of :data:`_SCALES`.

    Args:
      tx: the optimizer.
      params: the parameters (host or device arrays; copied to the host once).
      split: the tree -> the pieces the strategy updates separately (traceable; any tree shaped
        like ``params``).
      join: the pieces' updates -> one tree shaped like ``params`` (traceable).
      strategy: names the strategy, for the error.
      how: how it runs the optimizer, for the error (``"runs the optimizer on each of its 2 stages separately"``).
      what_to_do: the error's last sentence.
      layout: what ``split`` depends on besides the tree's shapes (the shard count, the stages'
        layers). Given, a passed probe is remembered for this optimizer object, layout and
        parameter shapes and dtypes, and not run again for them (a pipeline explorer builds
        many pipelines of one model and one optimizer); None: always run.

    Raises:
      ValueError: the updates differ (naming the first parameter where they do, by how much,
        and at which probe scale), or ``tx`` fails on a piece.
    """
    params = jax.device_get(params)  # one piece may still differ from the whole: a flat slice is not the tree
    remembered = _remembered(tx, layout, params)
    if remembered in _PASSED:
        return

    def probe(params, all_grads):
        pieces = split(params)
        whole_state = tx.init(params)
        try:
            piece_states = [tx.init(p) for p in pieces]
        except Exception as err:  # a user's transform, failing in its own way on a piece
            raise _PieceFailed(len(pieces)) from err
        updates = []
        for grads in all_grads:
            whole, whole_state = tx.update(grads, whole_state, params)
            try:
                results = [tx.update(g, s, p) for g, s, p in zip(split(grads), piece_states, pieces, strict=True)]
            except Exception as err:
                raise _PieceFailed(len(pieces)) from err
            piece_states = [state for _, state in results]
            updates.append((whole, join([u for u, _ in results])))
        return updates

    head = f"{strategy} {how}, "
    try:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            grads = [_probe_gradients(params, scale) for scale in _SCALES]
            updates = jax.device_get(jax.jit(probe)(params, grads))
    except _PieceFailed as failed:
        err = failed.__cause__
        raise ValueError(
            f"{head}and this optimizer fails on a piece ({type(err).__name__}: {err}), as a mask or setting "
            f"chosen by the parameter tree's paths does when it is given a piece instead. {what_to_do}"
        ) from err
    for scale, (whole, joined) in zip(_SCALES, updates, strict=True):
        mismatch = _first_mismatch(whole, joined)
        if mismatch is not None:
            path, diff, size = mismatch
            why = (
                "Only large gradients set them apart, as a clip by the global norm does "
                "(optax.clip_by_global_norm): each piece would be clipped by its own norm."
                if scale == max(_SCALES)
                else "They differ even for small gradients: the update combines elements that the pieces "
                "separate, as a norm per parameter does when a piece cuts through a parameter (LAMB and LARS "
                "trust ratios), or a mask or setting chosen by the parameter's path."
            )
            raise ValueError(
                f"{head}and this optimizer's update of the whole parameters differs from its pieces' updates "
                f"put together: at {path} by up to {diff:.3g} (updates there up to {size:.3g}), with probe "
                f"gradients of scale {scale:g}. {why} {what_to_do}"
            )
    if remembered is not None:
        if len(_PASSED) >= _REMEMBER_AT_MOST:
            _PASSED.clear()
        _PASSED.add(remembered)


_PASSED: set = set()  # the keys of probes that passed (see ``layout``)
_REMEMBER_AT_MOST = 256


def _remembered(tx: optax.GradientTransformation, layout: Hashable, params: PyTree) -> Hashable:
    """The key a passed probe is remembered under; None when it is not to be remembered."""
    if layout is None:
        return None
    shapes = tuple((np.shape(x), np.result_type(x).str) for x in jax.tree.leaves(params))
    key = (tx, layout, jax.tree.structure(params), shapes)
    try:
        hash(key)
    except TypeError:  # an optimizer holding something unhashable: probe every time
        return None
    return key


def _first_mismatch(whole: PyTree, joined: PyTree) -> tuple[str, float, float] | None:
    """(path, max |difference|, max |whole update|) of the first leaf that differs beyond rounding; None if none."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(whole), jax.tree.leaves(joined), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        size = float(np.nanmax(np.abs(a), initial=0.0))
        if not np.allclose(a, b, rtol=RTOL, atol=RTOL * size, equal_nan=True):
            return jax.tree_util.keystr(path), float(np.nanmax(np.abs(a - b))), size
    return None
