"""The types every room speaks of: a parameter tree, a batch, a loss function, a step's metrics.

Each is an alias for annotations: nothing here checks a value (:mod:`.contract` does, for a batch and a loss).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

PyTree = Any  # nested dicts, lists and tuples of arrays, as jax.tree reads them
Batch = Mapping[str, Any]  # arrays sharing their leading (batch) axis, by name
LossFn = Callable[[PyTree, Batch], Any]  # -> loss, or (loss, aux dict), or (loss, aux, new model state)
Metrics = dict[str, jax.Array]
