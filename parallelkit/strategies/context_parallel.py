"""Context parallelism (:class:`ContextParallel`): the sequence split over devices, attention by all-gather, ring or
all-to-all.

>>> ContextParallel(seq=1, devices=jax.devices()[:1])
ContextParallel(seq=1, method='ring', data=1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from ..core import partition
from ..core.devices import DeviceCountError, first_devices
from ..core.reports import StepTraffic
from ..core.state import TrainState
from ..core.types import DATA, SEQ, Batch, LossFn, PyTree, is_count
from ..measure.traffic import compiled_traffic
from ..models.layers import attention
from .parallel import LENGTH as LENGTH
from .parallel import NORM_LENGTH as NORM_LENGTH
from .parallel import TOKENS as TOKENS
from .parallel import Parallel
from .spmd import EXPLICIT


class ContextParallel(Parallel):
    """``data`` x ``seq`` devices: the batch over ``data``, every sequence over ``seq``, attention by ``method``.

    Conceptually, on device ``(i, j)`` with ``d x s`` devices and global tokens ``x`` of length ``T``::

        my tokens = x[rows i of d, positions j * T/s : (j + 1) * T/s]
        every layer but attention works on my tokens alone (a token's MLP needs only the token)
        attention: my queries against every earlier key, the keys fetched by `method`
        grads = sum over all d x s devices of my tokens' gradients    (all-reduce)

    which equals the single-device step. Dropout draws its masks from the step's key
    for the global batch, as on one device, so with dropout on the parameters are equal too.

    Args:
      seq: devices that split each sequence (the ``seq`` mesh axis).
      method: how attention fetches the keys and values of the other positions, one of
        :data:`parallelkit.models.layers.attention.METHODS`: ``"allgather"``, ``"ring"``, ``"ring_zigzag"``
        or ``"ulysses"`` (see :func:`parallelkit.models.layers.attention.context_parallel`).
      data: groups of ``seq`` devices that split the batch (the ``data`` mesh axis); ``None``:
        all the devices (or those given) divided by ``seq``.
      rules: ``(regex, spec)`` partition rules for the parameters (a spec may be a tuple of
        logical names); every parameter replicated by default.
      batch_axes: the logical names of a batch array's axes, by its key, ``batch`` first.
        Every array not named is ``("batch", "length")``: split on axis 0 over ``data`` and
        on axis 1 over ``seq``; name an array without a token axis ``("batch",)``.
      devices: which devices; all by default when ``data`` is ``None``, else the first ``data x seq``.
      explicit: a mesh of Explicit axes (each slice its array's type).

    Raises:
      DeviceCountError: ``seq`` (or ``data x seq``) larger than the devices, or devices that
        do not split into groups of ``seq``.
      ValueError: an axis size that is not a whole number >= 1, or an unknown method; when a
        batch is placed, a length that does not divide by ``seq``, or an array with no token
        axis that ``batch_axes`` does not name; when the step traces, heads that do not
        divide by ``seq`` under Ulysses (raised by :mod:`parallelkit.models.layers.attention`).

    Warns:
      DeviceSubsetWarning: with ``data`` and without ``devices``, when ``data x seq`` is
        fewer than all the devices.
    """

    def __init__(
        self,
        seq: int,
        method: str = "ring",
        data: int | None = None,
        *,
        rules: partition.Rules | PyTree | None = None,
        batch_axes: Mapping[str, Sequence[str | None]] | None = None,
        devices: Sequence[jax.Device] | None = None,
        explicit: bool = False,
    ):
        for name, size in (("seq", seq), ("data", data)):
            if size is not None and not is_count(size):
                raise ValueError(f"ContextParallel({name}={size!r}): an axis size must be a whole number >= 1.")
        attention.check_method(method)
        total = len(devices) if devices is not None else len(jax.devices())
        if seq * (data or 1) > total:
            asked, there = ("data x seq", f"seq={seq}, data={data}") if data else ("seq", f"seq={seq}")
            raise DeviceCountError(
                f"ContextParallel({there}) needs {seq * (data or 1)} devices, but {total} "
                f"{'were given' if devices is not None else 'exist'}: use {asked} <= {total} "
                "(pk.simulate_devices(n) before JAX starts gives more simulated devices)."
            )
        if devices is None and data is not None:
            devices = first_devices(seq, data, lambda d: f"ContextParallel(seq={seq}, data={d})", "seq x data")
        super().__init__(data, context=seq, context_method=method, rules=rules, batch_axes=batch_axes,
                         devices=devices, explicit=explicit)  # fmt: skip
        self.method = method

    shown_axes = (SEQ,)  # the mesh keeps its `seq` axis at seq=1

    @staticmethod
    def pattern_for(method: str = "ring") -> str:
        """The cost model's pattern of context parallelism by ``method`` (``context_ring``, ...)."""
        return f"context_{method}"

    @property
    def pattern(self) -> str:
        return self.pattern_for(self.method)

    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic:
        """The compiled step's traffic (:func:`parallelkit.measure.traffic.compiled_traffic`), with the batch
        slice's formula ``B/(n x seq)``: each device holds ``1/seq`` of its replica's tokens."""
        found = compiled_traffic(self, loss_fn, state, batch)
        first, *rest = found.flows
        seq = self.mesh.shape[SEQ]
        first = dataclasses.replace(first, expected=first.expected / seq, formula="B/(n x seq)")
        return dataclasses.replace(found, flows=(first, *rest))

    def __repr__(self) -> str:
        shape = f"seq={self.mesh.shape[SEQ]}, method={self.method!r}, data={self.mesh.shape[DATA]}"
        return f"ContextParallel({shape}{EXPLICIT if self.explicit else ''})"
