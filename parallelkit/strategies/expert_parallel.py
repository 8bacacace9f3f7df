"""Expert parallelism: each device holds some of the experts, and tokens travel to them by all-to-all.

The devices form a ``data`` x ``expert`` grid. The batch is split over all of them;
every parameter that declares the logical axis ``expert`` (as the MoE
:class:`~parallelkit.models.GPT` does, found by :func:`parallelkit.models.declared_axes`)
is split along it over ``expert``; for parameters that declare no logical axes, every one
whose path ends in ``w_in``, ``w_out``, ``b_in`` or ``b_out`` (the expert weights of
:func:`parallelkit.models.layers.experts.moe_layer`) is split along its leading (expert) axis. The rest
is replicated; where nothing is split (a model without experts), ``init`` warns that the step is data
parallelism. The rules map the logical
axis ``expert`` to the mesh axis ``expert``, so while the step traces,
:func:`~parallelkit.models.layers.experts.moe_layer` runs as :func:`~parallelkit.models.layers.experts.expert_parallel`:
each device routes its own tokens as one group and two all-to-alls inside
``jax.shard_map`` carry them to their experts' devices and back. Everything else in the
step is the single-device step under ``jax.jit``; the gradients of replicated parameters
(and of the expert weights, over ``data``) are all-reduced as the shardings imply.

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
