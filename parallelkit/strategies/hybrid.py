"""Hybrid parallelism (:class:`Hybrid`): data parallel on one mesh axis, tensor parallel on the other."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from ..core import partition
from ..core.devices import first_devices
from ..core.types import DATA, MODEL, PyTree, is_count
from .parallel import Parallel
from .spmd import EXPLICIT
from .tensor import hybrid_hint, model_specs


class Hybrid(Parallel):
    """``data`` x ``model`` devices: the batch split over ``data``, the weights over ``model``.

    Conceptually, on device ``(i, j)`` with a global batch ``b``::

        slice j of every split weight; b[i * len(b) // d : (i + 1) * len(b) // d]
        forward and backward as TensorParallel within row i (all-reduces over `model`)
        grads of slice j = mean over i of row i's grads           (all-reduce over `data`)

    which equals the single-device step.

    Args:
      data: how many data-parallel groups (the ``data`` mesh axis).
      model: devices per group that split the weights (the ``model`` mesh axis).
      rules: partition rules over the ``model`` axis, as for :class:`~parallelkit.TensorParallel`
        (the kit's MLP, CNN and transformer have defaults).
      shard_data: also shard the weights over ``data`` (FSDP on the data axis).
      min_size: with ``shard_data``, leaves with fewer elements stay replicated over ``data``.
      sequence_parallel: Megatron's sequence parallelism within each ``model`` group, as for
        :class:`~parallelkit.TensorParallel`.
      devices: which devices, ``data x model`` of them; the first ``data x model`` by default.
      explicit: a mesh of Explicit axes (as :class:`~parallelkit.TensorParallel`'s ``explicit``).

    Raises:
      DeviceCountError: devices that are not ``data x model`` in number.
      ValueError: an axis size that is not a whole number >= 1; at ``init``, the rule
        errors of TensorParallel.

    Warns:
      DeviceSubsetWarning: without ``devices``, when ``data x model`` is fewer than all the
        devices (``Hybrid(3, 2)`` on 8 leaves 2 idle).
    """

    def __init__(
        self,
        data: int,
        model: int,
        rules: partition.Rules | PyTree | None = None,
        *,
        shard_data: bool = False,
        min_size: int = partition.MIN_SHARD_SIZE,
        sequence_parallel: bool = False,
        devices: Sequence[jax.Device] | None = None,
        explicit: bool = False,
    ):
        for name, size in (("data", data), ("model", model)):
            if not is_count(size):
                raise ValueError(f"Hybrid({name}={size!r}): an axis size must be a whole number >= 1.")
        if devices is None:  # the first data x model devices, with a warning if that leaves some idle
            devices = first_devices(model, data, *hybrid_hint(model))
        super().__init__(data, zero=3 if shard_data else 0, tensor=model, sequence_parallel=sequence_parallel,
                         min_size=min_size, devices=devices, explicit=explicit)  # fmt: skip
        self.rules, self.shard_data = rules, shard_data

    shown_axes = (MODEL,)  # the mesh keeps its `model` axis at model=1

    def model_specs(self, params: PyTree) -> PyTree:
        return model_specs(params, self.rules, self.mesh)

    pattern = "hybrid"

    def expected_collectives(self, sizes) -> None:
        """No formula: activation all-reduces over ``model`` and gradient ones over ``data`` mix in one
        program; the measured payloads are reported as they are."""
        return None

    def __repr__(self) -> str:
        shard = (
            (", shard_data=True" if self.shard_data else "")
            + (", sequence_parallel=True" if self.sequence_parallel else "")
            + (EXPLICIT if self.explicit else "")
        )
        return f"Hybrid(data={self.mesh.shape[DATA]}, model={self.mesh.shape['model']}{shard})"
