"""Mesh axis names, and logical axis rules (:class:`AxisRules`) that map a model's axis names onto them;
:func:`constrain` places an activation by its logical axes.

>>> rules = AxisRules((("batch", "data"), ("length", "seq")))
>>> rules.spec(("batch", "length", "embed"))
P('data', 'seq', None)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .types import DATA as DATA  # the mesh axes' names live with the vocabulary; read here too
from .types import EXPERT as EXPERT
from .types import FSDP as FSDP
from .types import MODEL as MODEL
from .types import SEQ as SEQ
from .types import STAGE as STAGE
from .types import MeshAxes as MeshAxes

# The logical axes the kit's models name (pk.models, attention, experts); rules may name others.
_LOGICAL = ("batch", "length", "norm_length", "embed", "heads", "mlp", "vocab", "expert", "hidden_channels")


def axis_names(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes one rule target or ``PartitionSpec`` entry names: none, one, or each of a tuple.

    >>> axis_names(None), axis_names("data"), axis_names(("data", "model"))
    ((), ('data',), ('data', 'model'))
    """
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def split_size(mesh: Mesh, entry: MeshAxes) -> int:
    """How many pieces ``entry`` (as :func:`axis_names` reads it) cuts a dimension into on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in axis_names(entry))


@dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axis (or axes, or ``None`` for replicated), first rule wins.

    A logical name no rule mentions is replicated in a parameter's or a batch's spec, and
    left to the compiler in :func:`constrain`. Within one array a mesh axis splits
    at most one dimension: a later name whose mesh axis is already used is replicated
    (MaxText's rule), so ``("batch", "length")`` with both on ``data`` splits only the batch.

    Args:
      rules: ``(logical name, mesh axis or axes or None)`` pairs.
    """

    rules: tuple[tuple[str, MeshAxes], ...] = ()

    def __post_init__(self) -> None:
        pairs = tuple(tuple(pair) for pair in self.rules)
        for pair in pairs:
            if len(pair) != 2 or not isinstance(pair[0], str) or not _is_mesh_axes(pair[1]):
                raise ValueError(
                    f"An axis rule is a pair (logical name, mesh axis or tuple of axes or None), got {pair!r}."
                )
        object.__setattr__(self, "rules", pairs)

    def mesh_axes(self, name: str | None) -> MeshAxes:
        """The mesh axes of one logical name (``None``: replicated, also for a name no rule mentions)."""
        for logical, axes in self.rules:
            if logical == name:
                return axes
        return None

    def spec(self, names: Sequence[str | None], unknown: object = None) -> P:
        """The ``PartitionSpec`` of an array whose dimensions are called ``names``.

        Args:
          names: one logical name (or None) per dimension.
          unknown: the entry of a name no rule mentions: ``None`` (replicated) or ``P.UNCONSTRAINED``.
        """
        used: set[str] = set()
        entries = []
        for name in names:
            if name is not None and all(logical != name for logical, _ in self.rules):
                entries.append(unknown)
                continue
            group = axis_names(self.mesh_axes(name))
            if any(axis in used for axis in group):
                group = ()
            used.update(group)
            entries.append(None if not group else group[0] if len(group) == 1 else tuple(group))
        return P(*entries)

    def check(self, mesh: Mesh) -> None:
        """Raise a ValueError when a rule names a mesh axis that ``mesh`` lacks."""
        for logical, axes in self.rules:
            for axis in axis_names(axes):
                if axis not in mesh.shape:
                    raise ValueError(
                        f"The axis rule {logical!r} -> {axes!r} names mesh axis {axis!r}, but the mesh has only "
                        f"{tuple(mesh.shape)}. Build the mesh with that axis (pk.mesh.make_mesh({axis}=...)) "
                        f"or map {logical!r} to one of its axes (or None)."
                    )


def _is_mesh_axes(axes: object) -> bool:
    return axes is None or isinstance(axes, str) or (isinstance(axes, tuple) and all(isinstance(a, str) for a in axes))


_ACTIVE: contextvars.ContextVar[tuple[Mesh, AxisRules] | None] = contextvars.ContextVar("axis_rules", default=None)


@contextlib.contextmanager
def setting(variable: contextvars.ContextVar, value: object) -> Iterator[None]:
    """``variable`` set to ``value`` inside the block."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def active_rules(mesh: Mesh, rules: AxisRules) -> contextlib.AbstractContextManager:
    """Make :func:`constrain` use ``rules`` on ``mesh`` inside the block (a strategy wraps its tracing in it)."""
    return setting(_ACTIVE, (mesh, rules))


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` laid out as the active rules say for dimensions called ``names``; ``x`` itself when none are active.

    Rules are active while a strategy built with them traces its step
    (:class:`parallelkit.strategies.spmd.SPMD`); on one device, under ``pmap`` or in
    plain code this returns ``x`` unchanged. On an Auto mesh it is ``with_sharding_constraint``
    (a hint the partitioner follows); on an Explicit one, ``jax.sharding.reshard`` (the array's
    type changes, and JAX inserts the collective that moves it). A name no rule mentions leaves its dimension
    to the compiler (``P.UNCONSTRAINED``), so a preset whose rules name only ``batch``
    keeps the layout its parameter specs imply (tensor-parallel heads stay split).

    >>> import jax.numpy as jnp
    >>> constrain(jnp.ones((2, 3)), ("batch", "embed")).shape
    (2, 3)

    Raises:
      TypeError: ``names`` given as one string (``"batch"``) rather than a tuple of names.
      ValueError: ``names`` with a different count from ``x``'s dimensions; or, while rules
        are active, a name that neither the rules, the kit's models (:data:`_LOGICAL`) nor the
        mesh know, which would leave its dimension to the compiler without a word.
    """
    if isinstance(names, str):
        raise TypeError(
            f"constrain(x, {names!r}): pass one name per dimension as a tuple, such as ({names!r},) or "
            f"('batch', 'embed'), not a string."
        )
    if len(names) != x.ndim:
        raise ValueError(f"constrain got {len(names)} axis names {tuple(names)} for an array of shape {x.shape}.")
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    known = {logical for logical, _ in rules.rules} | set(_LOGICAL) | set(mesh.shape)
    if unknown := [name for name in names if name is not None and name not in known]:
        raise ValueError(
            f"constrain(x, {tuple(names)}): no axis rule, kit model or mesh axis knows {unknown[0]!r} (the rules "
            f"name {sorted({logical for logical, _ in rules.rules})}; the kit's models use {_LOGICAL}). Check the "
            f"spelling, or give the strategy a rule for it: ({unknown[0]!r}, None) to keep it whole, or a mesh axis."
        )
    spec = rules.spec(names, unknown=P.UNCONSTRAINED)
    if explicit_active():  # the layout is the array's type: reshard it; an unnamed dimension keeps its own
        held = held_spec(x)
        return jax.sharding.reshard(x, P(*(held[i] if e is P.UNCONSTRAINED else e for i, e in enumerate(spec))))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def held_spec(x: jax.Array) -> tuple[MeshAxes, ...]:
    """Where each dimension of ``x`` lies, read from its type on an Explicit mesh: one entry per dimension
    (``None``: whole), however short the type's own spec is."""
    held = jax.typeof(x).sharding.spec.partitions
    return tuple(held[i] if i < len(held) else None for i in range(x.ndim))


def explicit_active() -> bool:
    """Whether the mesh set for this trace (``jax.set_mesh``) has Explicit axes, so that arrays' types carry their
    shardings (an SPMD step on an Explicit mesh sets it; on one device or in plain code there is none).

    >>> explicit_active()
    False
    """
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and set(mesh.axis_types) == {jax.sharding.AxisType.Explicit}


def active() -> tuple[Mesh, AxisRules] | None:
    """The ``(mesh, rules)`` of the innermost :func:`active_rules` block, or ``None`` outside any.

    >>> active() is None
    True
    """
    return _ACTIVE.get()


_CONTEXT_METHOD: contextvars.ContextVar[str | None] = contextvars.ContextVar("context_method", default=None)


def context_method(name: str) -> contextlib.AbstractContextManager:
    """Inside the block, attention whose ``length`` the active rules split uses method ``name``.

    :func:`parallelkit.models.layers.attention.attend` reads it when it is traced (``"allgather"``
    when no block is open); :func:`parallelkit.models.layers.attention.method` checks the name first.
    """
    return setting(_CONTEXT_METHOD, name)


def active_context_method() -> str | None:
    """The method of the innermost :func:`context_method` block, or ``None`` outside any."""
    return _CONTEXT_METHOD.get()
