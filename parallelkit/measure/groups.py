"""Which mesh axes a compiled collective runs over, and a step's traffic per axis.

>>> from jax.sharding import Mesh
>>> mesh = Mesh(np.array(jax.devices()[:1] * 8, dtype=object).reshape(2, 2, 2), ("data", "seq", "model"))
>>> groups_axes(((0, 1), (2, 3), (4, 5), (6, 7)), mesh), groups_axes(((0, 4), (1, 5), (2, 6), (3, 7)), mesh)
(('model',), ('data',))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from ..core.reports import D2D, Flow, StepTraffic
from .inspect import Collective, summarize
from .traffic import compiled_traffic

if TYPE_CHECKING:
    from ..core.contract import Batch, LossFn
    from ..core.protocol import StrategyProtocol as Strategy
    from ..core.state import TrainState


def groups_axes(groups: Sequence[Sequence[int]], mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` along which the devices of any one of ``groups`` differ, in the mesh's order.

    A group is read as places in ``mesh.devices`` in row-major order (an SPMD program's device
    assignment on a mesh, whose places its replica groups name); a collective-permute's (source,
    target) pairs are groups of two.

    Raises:
      ValueError: a group names a place the mesh does not have.
    """
    places = [int(i) for group in groups for i in group]
    if places and max(places) >= mesh.devices.size:
        raise ValueError(f"A group names device {max(places)}, but the mesh {dict(mesh.shape)} has {mesh.devices.size}:"
                         " pass the mesh the step was compiled on.")  # fmt: skip
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group, dtype=int), mesh.devices.shape))
        varying |= {axis for axis in range(coords.shape[0]) if len(set(coords[axis])) > 1}
    return tuple(name for i, name in enumerate(mesh.axis_names) if i in varying)


def mesh_axes(collective: Collective, mesh: jax.sharding.Mesh) -> tuple[str, ...] | None:
    """The axes of ``mesh`` ``collective`` runs over; None where its program names no groups (one of every device)."""
    groups = collective.pairs if collective.op == "collective-permute" else collective.groups
    return None if groups is None else groups_axes(groups, mesh)


def by_axis(found: Sequence[Collective], mesh: jax.sharding.Mesh) -> dict[tuple[str, ...], dict[str, dict[str, int]]]:
    """Per set of mesh axes, per kind: how many collectives run over them and their bytes per device.

    A collective whose groups hold every device (or that names none) counts under all of the mesh's axes
    of size above one; one whose groups hold a single device (a no-op) under ``()``.
    """
    every = tuple(name for name, size in mesh.shape.items() if size > 1)
    grouped: dict[tuple[str, ...], list[Collective]] = {}
    for c in found:
        axes = mesh_axes(c, mesh)
        grouped.setdefault(every if axes is None else axes, []).append(c)
    return {axes: summarize(group) for axes, group in grouped.items()}


def axis_traffic(
    strategy: Strategy, loss_fn: LossFn, state: TrainState, batch: Batch, roles: dict[tuple[str, ...], dict[str, str]]
) -> StepTraffic:
    """The traffic of one compiled SPMD step, per set of mesh axes: each collective kind over each set of axes
    the program runs it on (:func:`by_axis`), its formula column the role ``roles`` gives it there, or "not in
    the model" where it gives none (no formula for the bytes either way)."""

    def per_axis(found: list[Collective], _) -> list[Flow]:
        return [
            Flow(
                D2D,
                f"{op} over {' x '.join(axes) or 'one device'}",
                row["bytes"],
                None,
                roles.get(axes, {}).get(op, "not in the model"),
                "compiled HLO",
            )  # fmt: skip
            for axes, kinds in by_axis(found, strategy.mesh).items()
            for op, row in kinds.items()
        ]

    return compiled_traffic(strategy, loss_fn, state, batch, per_axis)
