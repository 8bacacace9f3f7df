"""Functional form of NNX modules: ``(apply, params, model_state)`` as plain dicts a strategy can place."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx


class Functional(NamedTuple):
    """A Flax NNX module in functional form: ``apply``, its parameters, its mutable state (or ``None``)."""

    apply: Callable[..., Any]
    params: dict
    model_state: dict | None


def from_nnx(module: nnx.Module) -> Functional:
    """Turn any NNX module into ``(apply, params, model_state)``: plain dicts a strategy can place.

    ``params`` holds the ``nnx.Param`` variables; ``model_state`` the rest of the
    module's state, such as BatchNorm's running statistics (``None`` when there is
    none). The module's ``__call__`` may take ``train`` and ``rngs`` keywords; then::

        logits = apply(params, x)                                   # a model without state
        logits = apply(params, x, rng=key)                          # dropout drawn from `key`
        logits, model_state = apply(params, x, model_state=state)   # BatchNorm: new statistics
        logits = apply(params, x, model_state=state, train=False)   # inference: running averages

    Dropout is on exactly when ``rng`` is given; ``train=False`` makes BatchNorm use its
    running averages (and returns the logits alone).

    >>> from parallelkit.models import CNN
    >>> model = from_nnx(CNN((8, 8, 1), 10, batch_norm=True, rngs=nnx.Rngs(0)))
    >>> sorted(model.model_state["norms"][0])
    ['mean', 'var']
    """
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    rest_dict = nnx.to_pure_dict(rest)
    takes = set(inspect.signature(type(module).__call__).parameters)

    def apply(params: dict, x: jax.Array, *, rng: jax.Array | None = None, model_state=None, train: bool = True):
        if model_state is not None and not rest_dict:
            raise ValueError(
                f"{type(module).__name__} has no state besides its parameters, but model_state was given. "
                "Leave model_state out (of strategy.init, pk.fit and apply)."
            )
        model = nnx.merge(graphdef, nnx.State(params), nnx.State(model_state if model_state is not None else rest_dict))
        keywords = {}
        if "train" in takes:
            keywords["train"] = train
        if "rngs" in takes:
            keywords["rngs"] = rng
        elif rng is not None:
            raise ValueError(f"{type(module).__name__} draws no randomness: its __call__ takes no `rngs`.")
        out = model(x, **keywords)
        if model_state is None or not train:
            return out
        return out, nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

    return Functional(apply, nnx.to_pure_dict(params), rest_dict or None)


def functional(module: nnx.Module) -> tuple[Callable[..., Any], dict]:
    """``(apply, params)`` of a module without mutable state; see :func:`from_nnx` for the general case.

    Raises:
      ValueError: the module has state besides its parameters (BatchNorm statistics):
        use :func:`from_nnx`, which returns it too.
    """
    model = from_nnx(module)
    if model.model_state is not None:
        raise ValueError(
            f"{type(module).__name__} has state besides its parameters ({', '.join(model.model_state)}): "
            "use pk.models.from_nnx(module), which returns (apply, params, model_state)."
        )
    return model.apply, model.params


def graph_and_params(module: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """A sub-module's static graph and its parameters as a plain dict."""
    graphdef, params = nnx.split(module)
    return graphdef, nnx.to_pure_dict(params)


def param_bytes(params: dict) -> int:
    """Total bytes of a parameter tree (what one full gradient all-reduce carries)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
