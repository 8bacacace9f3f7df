"""Multi-worker mirrored data parallelism (MultiWorkerMirroredStrategy, multi-node DDP) on one global mesh."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from ..core.contract import check_divisible
from ..core.devices import resolve_devices
from ..core.mesh import make_mesh
from ..core.reports import ExpectedCollective, Sizes
from ..core.types import Batch, PyTree
from . import data_parallel
from .spmd import BATCH_ON_DATA, EXPLICIT, SPMD

_FEEDS = ("global", "local")


class MultiWorkerMirrored(SPMD):
    """Replicate the model on every device of every process and all-reduce the gradients.

    Conceptually, with ``n`` devices over all processes and a global batch ``b``,
    this is exactly :class:`Mirrored`::

        grads = mean(grad(loss_fn)(params, b_i) for b_i in split(b, n))  # across processes
        params = update(params, grads)                                   # everywhere, identically

    Call :func:`parallelkit.run.distributed.initialize` first; with one process it is
    ``Mirrored(backend="jit")``. An :class:`~parallelkit.SPMD` preset: one ``data`` axis
    over every device, the batch on it, the state replicated.

    Args:
      devices: the global devices to use; ``jax.devices()`` (all processes) by default.
      batch: ``"global"`` (every process passes the whole global batch) or ``"local"``
        (each passes its slice).
      explicit: a mesh of Explicit axes (the state's and the batch's shardings in their types).
    """

    def __init__(self, devices: Sequence[jax.Device] | None = None, batch: str = "global", *, explicit: bool = False):
        if batch not in _FEEDS:
            raise ValueError(f"MultiWorkerMirrored(batch={batch!r}): choose one of {_FEEDS}.")
        # Devices in process order, so each process's rows of the batch are one contiguous block.
        chosen = sorted(resolve_devices(devices), key=lambda d: (d.process_index, d.id))
        super().__init__(make_mesh(chosen, data=len(chosen), explicit=explicit), rules=BATCH_ON_DATA)
        self.feed = batch
        self.num_processes = len({d.process_index for d in self.devices})

    def place_batch(self, batch: Batch) -> Batch:
        """Build the global batch array from this process's rows only (``batch`` says which: docs/multi_host.md)."""
        if self.feed == "global":
            check_divisible(batch, self.num_replicas)
            return jax.tree.map(
                lambda x: jax.make_array_from_callback(x.shape, self.batch_sharding, lambda index: x[index]), batch
            )
        check_divisible(batch, len(self.mesh.local_devices))
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(
                self.batch_sharding, x, (x.shape[0] * self.num_processes, *x.shape[1:])
            ),
            batch,
        )

    @property
    def fed_replicas(self) -> int:
        """The replicas the batch each process passes is cut into: all of them, or with ``"local"`` its own."""
        return self.num_replicas if self.feed == "global" else len(self.mesh.local_devices)

    def unreplicate(self, tree: PyTree) -> PyTree:
        """One host copy, read from this process's own replica (the state is replicated everywhere);
        host arrays (NumPy) come back as they are."""
        return jax.tree.map(lambda x: np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x), tree)

    pattern = "mirrored"

    def expected_collectives(self, sizes: Sizes) -> tuple[ExpectedCollective, ...]:
        """The gradients and the scalar metrics, all-reduced: ``P + M`` bytes (XLA fuses them into one)."""
        return data_parallel.expected_collectives(sizes)

    def __repr__(self) -> str:
        shape = f"devices={self.num_replicas}, processes={self.num_processes}"
        return f"MultiWorkerMirrored({shape}{EXPLICIT if self.explicit else ''})"
