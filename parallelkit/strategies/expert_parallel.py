"""Expert parallelism (:class:`ExpertParallel`): each device holds some of the experts, and tokens travel to them by
all-to-all.

>>> import parallelkit as pk
>>> ExpertParallel(expert=1, devices=jax.devices()[:1])
ExpertParallel(expert=1, data=1)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from ..core import partition
from ..core.devices import first_devices
from ..core.types import DATA, EXPERT, PyTree, is_count
from .parallel import EXPERT_RULES as EXPERT_RULES
from .parallel import Parallel
from .spmd import EXPLICIT


class ExpertParallel(Parallel):
    """``data`` x ``expert`` devices: the tokens split over all of them, the experts over ``expert``.

    Conceptually, on device ``(i, j)`` with ``d x e`` devices and a global batch ``b``::

        my tokens = slice (i * e + j) of b;    my experts = slice j of every expert weight
        moe_layer routes my tokens as one group; all-to-all over `expert` -> my experts -> all-to-all back
        grads of slice j = sum over the devices' contributions (all-reduce over `data`)

    which equals the single-device step when its ``moe_layer`` calls use ``groups=d * e``.

    Args:
      expert: devices that split the experts (the ``expert`` mesh axis).
      data: groups of ``expert`` devices (the ``data`` mesh axis); ``None``: all the devices
        (or those given) divided by ``expert``.
      rules: ``(regex, spec)`` partition rules for the parameters (a spec may be a tuple of
        logical names). Default: the logical axes the parameters declare, ``expert`` split
        over ``expert`` and every other name replicated; :data:`EXPERT_RULES` for parameters
        that declare no ``expert`` axis.
      devices: which devices; all by default when ``data`` is ``None``, else the first ``data x expert``.
      explicit: a mesh of Explicit axes (each slice its array's type).

    Raises:
      DeviceCountError: devices that do not split into ``data x expert``.
      ValueError: an axis size that is not a whole number >= 1; at ``init``, an expert weight
        whose expert axis ``expert`` does not divide.

    Warns:
      DeviceSubsetWarning: with ``data`` and without ``devices``, when ``data x expert`` is
        fewer than all the devices.
      UserWarning: at ``init``, when no parameter is split over ``expert`` (a model without expert
        weights, or rules that split none): the step is then data parallelism over every device.
    """

    def __init__(
        self,
        expert: int,
        data: int | None = None,
        *,
        rules: partition.Rules | PyTree | None = None,
        devices: Sequence[jax.Device] | None = None,
        explicit: bool = False,
    ):
        for name, size in (("expert", expert), ("data", data)):
            if size is not None and not is_count(size):
                raise ValueError(f"ExpertParallel({name}={size!r}): an axis size must be a whole number >= 1.")
        if devices is None and data is not None:
            devices = first_devices(
                expert, data, lambda d: f"ExpertParallel(expert={expert}, data={d})", "expert x data"
            )
        super().__init__(data, expert=expert, rules=rules, devices=devices, explicit=explicit)

    shown_axes = (EXPERT,)  # the mesh keeps its `expert` axis at expert=1

    # The layer's shard_map splits the batch's own axes: the step cannot map the replicas (SPMD.maps_replicas), so
    # accumulated microbatches' gradients and 16-bit precision's gradient reduction stay where XLA puts them.
    maps_replicas = False

    # Its step's own collectives are all-to-alls of the dispatched tokens (TopologyModel times them as pairwise
    # exchanges); their payload depends on the layers' capacity, which the traffic's sizes do not hold, so
    # expected_collectives gives no formula and the measured all-to-alls are reported as they are.
    pattern = "expert"

    def __repr__(self) -> str:
        shape = f"expert={self.mesh.shape[EXPERT]}, data={self.mesh.shape[DATA]}"
        return f"ExpertParallel({shape}{EXPLICIT if self.explicit else ''})"
