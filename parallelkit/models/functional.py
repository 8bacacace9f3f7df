"""Functional form of NNX modules: ``(apply, params, model_state)`` as plain dicts a strategy can place, with their
declared logical axes (:func:`declared_axes`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

Axes = tuple[str | None, ...]  # one logical name (or None) per dimension of a parameter


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
    running averages (and returns the logits alone). The logical axes the parameters
    declare are recorded for :func:`declared_axes`.

    >>> from parallelkit.models import CNN
    >>> model = from_nnx(CNN((8, 8, 1), 10, batch_norm=True, rngs=nnx.Rngs(0)))
    >>> sorted(model.model_state["norms"][0])
    ['mean', 'var']
    """
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    rest_dict, params = nnx.to_pure_dict(rest), nnx.to_pure_dict(params)
    record_axes(params, param_axes(module))
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

    return Functional(apply, params, rest_dict or None)


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


def with_axes(init: Callable[..., jax.Array], names: Axes) -> Callable[..., Any]:
    """``init`` whose parameter declares the logical axes ``names`` (a name or None per dimension).

    ``nnx.with_partitioning(init, names, eager_sharding=False)``: the names stay metadata,
    and the values are placed by a strategy later (Flax would otherwise place them at once,
    which needs a mesh whose axes have these names).

    >>> dense = nnx.Linear(2, 4, kernel_init=with_axes(nnx.initializers.lecun_normal(), ("embed", "mlp")),
    ...                    rngs=nnx.Rngs(0))
    >>> param_axes(dense)
    {'bias': None, 'kernel': ('embed', 'mlp')}
    """
    return nnx.with_partitioning(init, tuple(names), eager_sharding=False)


def param_axes(module: nnx.Module) -> dict:
    """The logical axis names each parameter of ``module`` declares, as a plain dict shaped like its parameters.

    A parameter declares its axes with ``nnx.with_partitioning(init, names)`` (one name or
    ``None`` per dimension); one without that annotation gets ``None``. The kit's models
    declare theirs with :func:`with_axes`.

    >>> from parallelkit.models import MLP
    >>> param_axes(MLP(4, (8,), 2, rngs=nnx.Rngs(0)))["hidden"][0]
    {'bias': ('mlp',), 'kernel': ('features', 'mlp')}
    """
    axes: dict = {}
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        *parents, last = path
        node = axes
        for key in parents:
            node = node.setdefault(key, {})
        names = variable.get_metadata().get("out_sharding")
        node[last] = tuple(names) if names is not None else None
    return axes


# The axes declared by the last module that from_nnx turned into parameters of a given tree structure
# and shapes: the plain dicts strategies receive carry no metadata, so this is where they find it.
_DECLARED: dict[tuple, dict] = {}


def declared_axes(params: dict) -> dict | None:
    """The logical axes (as :func:`param_axes` gives) of the module whose parameters ``params`` are.

    Found by the tree structure and shapes of ``params``: the declaration of the last module
    turned into this functional form by :func:`from_nnx` (or :func:`functional`, or
    :func:`parallelkit.models.build`). ``None`` when no such module declared any axes.

    >>> from parallelkit.models import MLP
    >>> _, params = functional(MLP(4, (8,), 2, rngs=nnx.Rngs(0)))
    >>> declared_axes(params)["head"]
    {'bias': ('classes',), 'kernel': ('mlp', 'classes')}
    >>> declared_axes({"w": np.zeros(3)}) is None
    True

    A list of per-layer parameters (:func:`parallelkit.models.as_layers`' ``params``, or a pipeline stage's
    run of them) declares what its layers declare, a layer that declares nothing its leaves' ``None``:

    >>> [axes["head"]["bias"] for axes in declared_axes([params, params])]
    [('classes',), ('classes',)]
    """
    found = _DECLARED.get(_signature(params))
    if found is not None or not isinstance(params, list | tuple):
        return found
    layers = [declared_axes(layer) for layer in params]
    if all(axes is None for axes in layers):
        return None
    pairs = zip(params, layers, strict=True)
    return [jax.tree.map(lambda _: None, layer) if axes is None else axes for layer, axes in pairs]


def record_axes(params: dict, axes: dict) -> None:
    """Record ``axes`` for trees like ``params`` (:func:`declared_axes`); forget an older record when ``axes``
    declares nothing."""
    key = _signature(params)
    if any(names is not None for names in jax.tree.leaves(axes, is_leaf=lambda x: x is None or isinstance(x, tuple))):
        _DECLARED[key] = axes
    else:
        _DECLARED.pop(key, None)


def _signature(params: dict) -> tuple:
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple(tuple(np.shape(leaf)) for leaf in leaves)
