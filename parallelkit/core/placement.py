"""Where every leaf of a state lives: devices, memory kind, partition spec, copies, bytes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LeafPlacement:
    """Where one leaf of the state lives."""

    path: str
    shape: tuple[int, ...]  # the logical shape, as the single-device program sees it
    dtype: str
    devices: tuple[int, ...]  # ids of the devices holding some or all of it
    memory_kind: str | None
    spec: str  # the PartitionSpec, or the sharding's name
    copies: int  # how many full copies exist across the devices
    bytes_per_device: int


def total_bytes(rows: Sequence[LeafPlacement]) -> int:
    """Bytes a state takes over all its devices: every device's share of every leaf.

    A replicated leaf counts once per device that holds a copy; a sharded one, its shards.

    >>> rows = [LeafPlacement(".params['w']", (4,), "float32", (0, 1), "device", "P()", 2, 16),
    ...         LeafPlacement(".params['b']", (4,), "float32", (0, 1), "device", "P('data')", 1, 8)]
    >>> total_bytes(rows)
    48
    """
    return sum(row.bytes_per_device * len(row.devices) for row in rows)


def bytes_by_part(rows: Sequence[LeafPlacement]) -> dict[str, int]:
    """Bytes one device holds of each part of a state (``params``, ``opt_state``, ``step``, ...).

    Sums :meth:`Strategy.describe`'s rows by the state's top-level field, the largest
    device's share of each leaf.

    >>> rows = [LeafPlacement(".params['w']", (4,), "float32", (0, 1), "device", "P('data')", 1, 8),
    ...         LeafPlacement(".opt_state[0].mu['w']", (4,), "float32", (0, 1), "device", "P('data')", 1, 8)]
    >>> bytes_by_part(rows)
    {'params': 8, 'opt_state': 8}
    """
    parts: dict[str, int] = {}
    for row in rows:
        part = re.match(r"\.?(\w+)", row.path).group(1)
        parts[part] = parts.get(part, 0) + row.bytes_per_device
    return parts
