"""Central storage (TensorFlow's CentralStorageStrategy): one copy of the state, off the compute devices."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import optax
from jax.sharding import SingleDeviceSharding

from ...core.accumulate import accumulated_placement, check_accumulate
from ...core.mesh import outside_callers_mesh
from ...core.precision import Precision, check_precision
from ...core.state import TrainState, create_state
from ...core.step import Step, keep_finite_choice
from ...core.types import LossFn, PyTree
from ..base import refuse_explicit
from .base import NOT_EXPLICIT, OffDeviceStrategy
from .rows import (
    PushPullStep,
    ReplicaRows,
    apply_mean_gradients,
    compute_sharding,
    host_sharding,
    push_rows,
    replica_gradients,
)


class _CentralUpdate:
    """The push and the update of central storage: the rows to the storage device, one program there.

    ``update(state, rows) -> (state, metrics)``; :meth:`lowered` gives the update
    program as it runs (the traffic report reads its host-memory arguments from it).
    """

    def __init__(self, storage: SingleDeviceSharding, precision: Precision | None = None):
        self.storage, self.precision = storage, precision
        self.compute = compute_sharding(storage)
        self._programs: dict[Callable | None, Callable] = {}

    def program(self, keep: Callable | None = None) -> Callable:
        """The jitted update, built once; with ``keep`` (:func:`~parallelkit.core.step.keep_finite_choice`'s
        answer) it keeps the state of a step whose loss is not finite."""
        if keep not in self._programs:
            self._programs[keep] = jax.jit(
                functools.partial(apply_mean_gradients, compute=self.compute, precision=self.precision, keep=keep),
                in_shardings=(self.storage, self.compute),
                out_shardings=(self.storage, self.compute),
                donate_argnums=0,
            )
        return self._programs[keep]

    def __call__(self, state: TrainState, rows: ReplicaRows):
        return self.program(keep_finite_choice())(state, push_rows(rows, self.compute))

    def lowered(self, state: TrainState, rows: ReplicaRows) -> list:
        return [self.program(keep_finite_choice()).lower(state, push_rows(rows, self.compute))]


class CentralStorage(OffDeviceStrategy):
    """One copy of parameters and optimizer state in host memory; the devices only compute.

    Conceptually, with ``n`` devices and a global batch ``b``::

        params_i = copy(params)                     # pull: host -> device i, for every i
        grads_i = grad(loss_fn)(params_i, b[i * len(b) // n : (i + 1) * len(b) // n])
        grads = mean(copy_to(storage, grads_i) for i in range(n))   # push to the storage device
        params = update(params, grads)   # once: state copied in from host memory, updated, written back

    which equals the single-device step on ``b``, as :func:`~parallelkit.Mirrored`'s does (the loss a mean
    over the examples). With ``step(loss_fn, accumulate=K)`` it equals one step on the whole batch and pulls
    and pushes the same bytes whatever ``K`` (each device averages its ``K`` microbatches' gradients first).

    Randomness and model state work as under ``pmap``: with ``rng=`` each replica
    draws its own dropout masks (its index folded into the step's key), and the
    replicas' new model state is averaged with the gradients. BatchNorm equals
    SingleDevice when the model averages its batch statistics over the ``data`` axis
    (``pk.models.CNN(..., bn_axis_name="data")``, SyncBatchNorm).

    Args:
      devices: how many compute devices (the first ``n``), or which; all by default.
      storage: the device whose host memory holds the state; the first compute device by default.
      explicit: False (Auto mode); True is refused: the state lives in host memory and a step is several
        programs, not one over a mesh of Explicit axes.

    Raises:
      ValueError: ``explicit=True``.
    """

    def __init__(
        self,
        devices: int | Sequence[jax.Device] | None = None,
        storage: jax.Device | None = None,
        *,
        explicit: bool = False,
    ):
        refuse_explicit("CentralStorage", explicit, NOT_EXPLICIT)
        super().__init__(devices)
        self.storage = host_sharding(storage if storage is not None else self.devices[0])

    @outside_callers_mesh
    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        state = create_state(params, tx, opt_state, model_state=model_state, rng=rng)
        return jax.device_put(state, self.storage)

    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step:
        """Pull, compute (``accumulate`` microbatches per device, averaged there), push and update.

        With ``precision`` the workers cast, scale and unscale (:mod:`parallelkit.core.precision`); the
        storage device skips an update whose gradients were not all finite, and keeps the dynamic scale.
        A global batch that does not divide by ``accumulate x devices`` is a ``ValueError``.
        """
        check_accumulate(accumulate)
        check_precision(precision)
        compute = replica_gradients(loss_fn, self.mesh, precision, accumulate)
        step = PushPullStep(self.pull, compute, _CentralUpdate(self.storage, precision))
        return Step(step, accumulated_placement(self.place_batch, accumulate, self.num_replicas), self, precision)

    def __repr__(self) -> str:
        return f"CentralStorage(devices={self.num_replicas}, storage={self.storage.memory_kind})"
