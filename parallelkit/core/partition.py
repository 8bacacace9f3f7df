"""Partition rules: which slice of each parameter lives on which devices.

A rule is a pair ``(regex, PartitionSpec)``. A parameter's path is its keys joined
by ``/`` (``hidden/0/kernel``); the first rule whose regex ``re.search``-matches the
path gives its spec. A parameter that no rule matches is an error naming it: end
the rules with ``(".*", P())`` to replicate everything else. This is the style of
t5x and levanter; a Flax model that carries its own annotations
(``nnx.with_partitioning``) gives its specs through :func:`nnx_specs` (mesh axis names)
or :func:`logical_specs` (logical names, mapped by axis rules) instead.

The optimizer state follows the parameters: each leaf of ``tx.init(params)`` that
stands for a parameter (Adam's ``mu`` and ``nu``, momentum's trace) gets that
parameter's spec, found with ``optax.tree_map_params``; scalars such as Adam's
step ``count`` are replicated.

>>> import numpy as np
>>> specs = param_specs({"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}},
...                     [("kernel", P(None, "model")), (".*", P())])
>>> specs["dense"]["kernel"], specs["dense"]["bias"]
(P(None, 'model'), P())
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .axes import axis_names, split_size
from .types import PyTree

Rules = Sequence[tuple[str, P]]


def path_label(path: tuple) -> str:
    """A key path in slash form: ``(DictKey('hidden'), DictKey('kernel'))`` -> ``'hidden/kernel'``."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def param_specs(params: PyTree, rules: Rules | PyTree) -> PyTree:
    """The ``PartitionSpec`` of every parameter, as a tree shaped like ``params``.

    Args:
      params: the parameters (arrays, or anything with a ``.shape``).
      rules: ``(regex, PartitionSpec)`` pairs, first match wins; or a tree of specs
        shaped like ``params`` (``None`` for replicated), as :func:`nnx_specs` returns.

    Raises:
      ValueError: parameters that no rule matches (all of them are listed), or a
        tree of specs that does not have the structure of ``params``.
    """
    if _is_rule_list(rules):
        compiled = [(re.compile(pattern), spec) for pattern, spec in rules]
        unmatched = []

        def spec_of(path, _leaf):
            label = path_label(path)
            for pattern, spec in compiled:
                if pattern.search(label):
                    return spec
            unmatched.append(label)
            return P()

        specs = jax.tree_util.tree_map_with_path(spec_of, params)
        if unmatched:
            raise ValueError(
                f"No partition rule matches {len(unmatched)} parameter(s): {', '.join(unmatched)}. "
                'Add rules for them, or end the rules with (".*", P()) to replicate the rest.'
            )
        return specs
    try:
        return jax.tree.map(lambda _, spec: P() if spec is None else spec, params, rules, is_leaf=_is_spec_leaf)
    except ValueError as err:
        raise ValueError(
            f"The partition specs do not have the structure of the parameters ({err}). "
            "Give one PartitionSpec (or None) per parameter, or (regex, PartitionSpec) rules."
        ) from err


def logical_rules(rules: Rules | PyTree, spec_of: Callable[[Sequence[str | None]], P]) -> Rules | PyTree:
    """``rules`` with every spec given as logical axis names turned into a ``PartitionSpec`` by ``spec_of``.

    A rule's spec may be a ``PartitionSpec`` (kept) or a tuple of logical names, one per
    dimension (``("embed", "mlp")``), which ``spec_of`` (:meth:`parallelkit.core.axes.AxisRules.spec`)
    maps to mesh axes. A tree of specs is returned as it is.

    >>> from parallelkit.core.axes import AxisRules
    >>> logical_rules([("kernel", ("embed", "mlp"))], AxisRules((("mlp", "model"),)).spec)
    [('kernel', P(None, 'model'))]
    """
    if not _is_rule_list(rules):
        return rules
    return [(pattern, spec if isinstance(spec, P) else spec_of(spec)) for pattern, spec in rules]


def logical_specs(axes: PyTree, spec_of: Callable[[Sequence[str | None]], P]) -> PyTree:
    """The ``PartitionSpec`` of each parameter from the logical names its dimensions declare.

    ``axes`` is a tree of name tuples (``("embed", "mlp")``), ``None`` where a parameter
    declares none (replicated), as :func:`parallelkit.models.param_axes` gives; ``spec_of``
    (:meth:`parallelkit.core.axes.AxisRules.spec`) maps names to mesh axes. A spec that
    splits no dimension is written ``P()``.

    >>> from parallelkit.core.axes import AxisRules
    >>> logical_specs({"w": ("embed", "mlp"), "b": ("embed",), "n": None}, AxisRules((("mlp", "model"),)).spec)
    {'b': P(), 'n': P(), 'w': P(None, 'model')}
    """

    def spec(names: Sequence[str | None] | None) -> P:
        found = P() if names is None else spec_of(names)
        return found if any(entry is not None for entry in found) else P()

    return jax.tree.map(spec, axes, is_leaf=lambda x: x is None or isinstance(x, tuple))


# Leaves with fewer elements stay replicated under fully sharded training: gathering them would
# cost a collective's latency for a few bytes. DeepSpeed's stage3_param_persistence_threshold plays
# this part (100,000 elements by default); this default suits the kit's small teaching models.
MIN_SHARD_SIZE = 1024


def fully_sharded_specs(
    params: PyTree, axis: str, size: int, *, min_size: int = MIN_SHARD_SIZE, base: PyTree = None
) -> PyTree:
    """Add ``axis`` (of ``size`` devices) to the spec of every leaf large enough to shard.

    The stated rule: a leaf of at least ``min_size`` elements is split over ``axis`` along
    its **largest dimension that is not split already and divides evenly** by ``size``
    times the devices already splitting it (none here); a smaller leaf, or one with no
    such dimension, keeps its spec (replicated over ``axis``).

    Args:
      params: the parameters (anything with ``.shape``).
      axis: the mesh axis to shard over (``"data"`` for ZeRO / FSDP).
      size: that axis's size.
      min_size: the smallest leaf, in elements, that is sharded.
      base: specs to start from (for example tensor-parallel ones); all replicated by default.

    >>> fully_sharded_specs({"w": np.zeros((6, 64)), "b": np.zeros(64)}, "data", 4, min_size=100)
    {'b': P(), 'w': P(None, 'data')}
    """
    base = jax.tree.map(lambda _: P(), params) if base is None else base

    def add_axis(leaf, spec: P) -> P:
        shape = np.shape(leaf)
        entries = list(spec) + [None] * (len(shape) - len(spec))
        if int(np.prod(shape, dtype=np.int64)) < min_size:
            return spec
        free = [d for d, n in enumerate(shape) if entries[d] is None and n % size == 0]
        if not free:
            return spec
        entries[max(free, key=lambda d: shape[d])] = axis  # the largest; the first among equals
        return P(*entries)

    return jax.tree.map(add_axis, params, base, is_leaf=_is_spec_leaf)


def check_specs(params: PyTree, specs: PyTree, mesh: Mesh) -> None:
    """Raise a ValueError naming the first parameter whose spec does not fit ``mesh`` or its shape.

    A spec fits when every axis it names is one of the mesh's, it has no more
    entries than the array has dimensions, and each split dimension divides evenly
    by the product of the sizes of the axes that split it.
    """
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for (path, leaf), spec in zip(leaves, jax.tree.leaves(specs, is_leaf=_is_spec_leaf), strict=True):
        label, shape = path_label(path), tuple(leaf.shape)
        if len(spec) > len(shape):
            raise ValueError(f"{label} has shape {shape}, too few dimensions for the partition spec {spec}.")
        for dim, entry in enumerate(spec):
            axes = axis_names(entry)
            missing = [axis for axis in axes if axis not in mesh.shape]
            if missing:
                raise ValueError(
                    f"The partition spec {spec} of {label} names mesh axis {missing[0]!r}, but the mesh has only "
                    f"{tuple(mesh.shape)}. Use those axis names in the rules (or build the mesh with that axis)."
                )
            parts = split_size(mesh, entry)
            if shape[dim] % parts:
                raise ValueError(
                    f"{label} has shape {shape}: its dimension {dim} ({shape[dim]}) does not split evenly over "
                    f"{' x '.join(axes)} = {parts} devices. Choose a width divisible by {parts}, "
                    f"or replicate {label} with a rule ({label!r}, P())."
                )


def state_specs(params_specs: PyTree, tx: optax.GradientTransformation, params: PyTree) -> PyTree:
    """Specs of ``tx.init(params)``: each leaf that stands for a parameter gets that parameter's spec."""
    opt_shapes = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx,
        lambda _, spec: spec,
        opt_shapes,
        params_specs,
        transform_non_params=lambda _: P(),
        is_leaf=_is_spec_leaf,
    )


def shardings(mesh: Mesh, specs: PyTree) -> PyTree:
    """``NamedSharding(mesh, spec)`` for every spec of a tree."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec_leaf)


def nnx_specs(module: Any) -> PyTree:
    """The partition specs a Flax NNX module carries (``nnx.with_partitioning``), as a plain nested dict.

    Parameters without an annotation get ``P()`` (replicated). Pass the result as
    ``rules`` to a strategy that splits parameters. Build the module inside
    ``with nnx.use_eager_sharding(False):`` so that Flax keeps the annotations as
    metadata instead of asking for a mesh to place the values at once; the strategy
    places them. The annotations are taken as mesh axis names; for logical names (as the
    kit's models declare) use :func:`logical_specs` with axis rules.
    """
    from flax import nnx

    specs = nnx.get_partition_spec(nnx.state(module, nnx.Param))
    return nnx.to_pure_dict(specs)


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, P)


def _is_rule_list(rules: Any) -> bool:
    return (
        isinstance(rules, list | tuple)
        and len(rules) > 0
        and all(isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) for r in rules)
    )


_MOVED = {name: f"parallelkit.models.megatron:{name}" for name in ("megatron_mlp_rules", "megatron_cnn_rules",
                                                                    "megatron_transformer_rules")}  # fmt: skip


def __getattr__(name: str) -> Any:
    """The Megatron rules' old names here, for one release: they live beside their models now."""
    from .renamed import renamed  # loaded when an old name is asked for

    return renamed(__name__, _MOVED)(name)
