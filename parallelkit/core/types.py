"""The package's vocabulary: the types a step is written in, the mesh axes' names, and what a count is.

Every module that only speaks of these imports them from here, which imports nothing of the
package. The types are aliases for annotations (:mod:`.contract` checks a batch and a loss);
the mesh axes' names are the constants every mesh is built with (:mod:`.mesh`) and every rule
maps onto (:mod:`.axes`).

>>> is_count(2), is_count(2.0), is_count(True), is_number(0.5)
(True, False, False, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

PyTree = Any  # nested dicts, lists and tuples of arrays, as jax.tree reads them
Batch = Mapping[str, Any]  # arrays sharing their leading (batch) axis, by name
LossFn = Callable[[PyTree, Batch], Any]  # -> loss, or (loss, aux dict), or (loss, aux, new model state)
Metrics = dict[str, jax.Array]

# The mesh axes, in one place (as haliax's ResourceAxis).
DATA = "data"  # replicas: each holds a slice of the batch
FSDP = "fsdp"  # fully sharded data parallelism: a slice of the batch and of every large weight
STAGE = "stage"  # pipeline parallelism: each holds some of the layers
SEQ = "seq"  # sequence parallelism: each holds a slice of the tokens
EXPERT = "expert"  # expert parallelism: each holds some of the experts
MODEL = "model"  # tensor parallelism: each holds a slice of the weights

MeshAxes = str | tuple[str, ...] | None  # what one logical axis maps to: a mesh axis, several, or none


def is_count(size: object, least: int = 1) -> bool:
    """Whether ``size`` is a whole number >= ``least`` (an axis size, a device or element count); a bool is not.

    NumPy integers count as whole numbers.

    >>> is_count(2), is_count(np.int64(2)), is_count(0), is_count(2.0), is_count(True)
    (True, True, False, False, False)
    >>> is_count(0, least=0), is_count(False, least=0), is_count(-1, least=0)
    (True, False, False)
    """
    return isinstance(size, int | np.integer) and not isinstance(size, bool) and bool(size >= least)


def is_number(x: object) -> bool:
    """Whether ``x`` is a real number (NumPy scalars too); a bool is not."""
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)
