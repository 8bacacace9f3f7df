"""Context parallelism: the sequence split over devices, attention by all-gather, ring or all-to-all.

The devices form a ``data`` x ``seq`` grid. Every batch array is split on its leading
axis over ``data`` and on its second (the tokens) over ``seq``; the rules map the
logical axes ``length`` and ``norm_length`` (the residual stream's) to ``seq``, so every activation the model constrains
(:func:`parallelkit.core.axes.constrain`) keeps its length split, and
:func:`parallelkit.models.layers.attention.attend` runs as :func:`parallelkit.models.layers.attention.context_parallel`
by the strategy's method: the one place where a token needs the others. The
parameters are replicated (or laid out by ``rules``); their gradients are summed over
every device, as the shardings imply. One ``jax.jit`` of the single-device step, as for
every SPMD preset.

>>> ContextParallel(seq=1, devices=jax.devices()[:1])
ContextParallel(seq=1, method='ring', data=1)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import jax

from ..core import partition
from ..core.axes import DATA, SEQ, context_method
from ..core.contract import Batch, LossFn, PyTree
from ..core.devices import DeviceCountError, first_devices
from ..core.mesh import is_count, make_mesh
from ..core.reports import StepTraffic
from ..core.state import TrainState
from ..measure.traffic import compiled_traffic
from ..models.layers import attention
from .spmd import BATCH, EXPLICIT, SPMD

LENGTH = "length"  # the logical name of the tokens' axis, a batch array's second
NORM_LENGTH = "norm_length"  # the residual stream's length (pk.models.GPT): split the same way
TOKENS = (BATCH, LENGTH)  # how a batch array's axes are named unless batch_axes says otherwise


class ContextParallel(SPMD):
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
        mesh = make_mesh(devices, data=data, seq=seq, explicit=explicit)
        split = ((BATCH, DATA), (LENGTH, SEQ), (NORM_LENGTH, SEQ))
        super().__init__(mesh, rules=split, param_rules=rules, batch_axes=batch_axes)
        self.method = method

    unnamed_batch_axes = TOKENS  # every batch array not named in batch_axes: split on axis 0 and on its tokens

    def place_batch(self, batch: Batch) -> Batch:
        """Send each block of every sequence to its device; clear errors for arrays that do not split.

        The checks run only when placing fails, in either mode: on an Auto mesh JAX refuses an array too short
        for its spec with a ``ValueError``, on an Explicit one with a bare ``AssertionError``.
        """
        try:
            return super().place_batch(batch)
        except (ValueError, AssertionError):
            self._check_tokens(batch)
            raise

    def _check_tokens(self, batch: Batch) -> None:
        """Raise a clear error for an array whose token axis is missing or does not divide by ``seq``."""
        seq = self.mesh.shape[SEQ]
        named = batch.items() if isinstance(batch, Mapping) else enumerate(jax.tree.leaves(batch))
        for key, leaf in named:
            unnamed = self.unnamed_batch_axes
            names = self.batch_axes.get(key, unnamed) if isinstance(batch, Mapping) else unnamed
            if LENGTH not in names:
                continue
            axis = names.index(LENGTH)
            shape = getattr(leaf, "shape", ())
            if len(shape) <= axis:
                raise ValueError(
                    f"{self!r} splits axis 0 of every batch array over data and axis {axis} over seq, but batch "
                    f"array {key!r} has shape {tuple(shape)}. If it is one sequence without a batch axis, give it "
                    f"one (batch[{key!r}][None], shape (1, {', '.join(map(str, shape))})); if it holds one value "
                    f"per example and no tokens, name it in batch_axes={{{key!r}: ('batch',)}}."
                )
            if shape[axis] % seq:
                raise ValueError(
                    f"The sequence length {shape[axis]} of batch array {key!r} does not split over seq={seq} "
                    f"devices: use a length divisible by {seq}, or a seq that divides {shape[axis]}."
                )

    def tracing(self) -> contextlib.AbstractContextManager:
        """The rules (:meth:`SPMD.tracing`) and the attention method, while the step traces."""
        return _with_method(super().tracing(), self.method)

    def replica_tracing(self) -> contextlib.AbstractContextManager:
        return _with_method(super().replica_tracing(), self.method)

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


@contextlib.contextmanager
def _with_method(rules: contextlib.AbstractContextManager, method: str) -> Iterator[None]:
    with rules, context_method(method):
        yield
