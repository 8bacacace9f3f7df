"""Central storage (TensorFlow's CentralStorageStrategy): one copy of the state, off the compute devices.

Parameters and optimizer state live once, in host memory. Each step runs three
stages, and the bytes of each are real transfers between memories:

1. **pull**: the parameters are copied from host memory to every compute device;
2. **compute**: each device takes its slice of the global batch and computes its
   own gradients (one compiled program, ``jax.shard_map`` over the ``data`` axis);
   no collective runs between the devices;
3. **push and update**: the per-replica gradients are copied back to the owner of
   the state, averaged there into one copy, and the optimizer update is applied
   once, centrally (a second compiled program on the owner's device).

The same three stages, with the state cut into several owners, are a parameter
server (:mod:`parallelkit.strategies.parameter_server`); both share this module's
helpers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from functools import cached_property

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ..axes import DATA
from ..mesh import make_mesh
from .base import (
    Batch,
    LossFn,
    PyTree,
    Step,
    Strategy,
    TrainState,
    _loss_with_aux,
    create_state,
    put_batch,
    refuse_step_extras,
)

HOST_MEMORY = "pinned_host"


def host_sharding(device: jax.Device) -> SingleDeviceSharding:
    """Host memory beside ``device``: its ``pinned_host`` memory where it has one, else the CPU backend's device.

    JAX documents memory kinds for accelerators; JAX 0.10 on CPU also offers
    ``pinned_host`` (a separate memory space of the same RAM), which is what
    simulated devices use. A backend without it falls back to the CPU device.
    """
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST_MEMORY in kinds:
        return SingleDeviceSharding(device, memory_kind=HOST_MEMORY)
    return SingleDeviceSharding(jax.devices("cpu")[0])


def compute_sharding(sharding: SingleDeviceSharding) -> SingleDeviceSharding:
    """The compute memory of the device behind ``sharding`` (where XLA runs the update)."""
    device = next(iter(sharding.device_set))
    return SingleDeviceSharding(device, memory_kind=device.default_memory().kind)


def replica_gradients(loss_fn: LossFn, mesh: Mesh) -> Callable:
    """``(params, batch) -> (grads, metrics)``, one row per replica, nothing reduced.

    Conceptually, with ``n`` replicas and the global batch ``b``::

        rows = [value_and_grad(loss_fn)(params, b[i * len(b) // n : (i + 1) * len(b) // n]) for i in range(n)]
        grads, metrics = stack(rows)  # leading axis n, row i on device i

    ``params`` arrive replicated on the mesh (the pull); the outputs stay sharded on
    ``data``, so the program holds no collective: the reduction is the owner's job.
    """

    def per_replica(params: PyTree, batch: Batch):
        (loss, (aux, _)), grads = jax.value_and_grad(_loss_with_aux(loss_fn), has_aux=True)(params, batch)
        return jax.tree.map(lambda x: x[None], (grads, {"loss": loss, **aux}))

    # check_vma=False: with it on, differentiating replicated (unvarying) params against a
    # sharded batch inserts a psum of the gradients, the all-reduce we want to leave out.
    sharded = jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=P(DATA), check_vma=False)
    return jax.jit(sharded)


def apply_mean_gradients(
    state: TrainState, grads: PyTree, metrics: PyTree, compute: SingleDeviceSharding
) -> tuple[TrainState, PyTree]:
    """The owner's update (inside ``jit``): average the replicas' rows, then one optimizer step.

    The state is brought from host memory into ``compute`` memory first (XLA computes
    there; the jitted caller writes the result back out). The mean of per-replica mean
    gradients is the gradient of the global mean loss, what the single-device step
    computes (up to float summation order).
    """
    state = jax.device_put(state, compute)
    mean = functools.partial(jnp.mean, axis=0)
    return state.apply_gradients(jax.tree.map(mean, grads)), jax.tree.map(mean, metrics)


class PushPullStep:
    """Pull, compute, push-and-update, as one callable; ``lower`` gives the workers' program.

    Args:
      pull: ``state -> params`` replicated on the workers (host-to-device copies).
      compute: the jitted :func:`replica_gradients`.
      push_update: ``(state, grads, metrics) -> (state, metrics)``: moves the rows to
        the owners and applies the update there.
      choose: optional ``pulled params -> params the workers use`` (an older version, for
        simulated asynchrony); the identity by default.
    """

    def __init__(self, pull: Callable, compute: Callable, push_update: Callable, choose: Callable | None = None):
        self.pull, self.compute, self.push_update, self.choose = pull, compute, push_update, choose

    def __call__(self, state: TrainState, batch: Batch):
        params = self.pull(state)
        if self.choose is not None:
            params = self.choose(params)
        grads, metrics = self.compute(params, batch)
        return self.push_update(state, grads, metrics)

    def lower(self, state: TrainState, batch: Batch):
        return self.compute.lower(self.pull(state), batch)

    @property
    def delays(self) -> list[int]:
        """How many updates old each step's pulled parameters were, so far (empty when never stale)."""
        return list(getattr(self.choose, "delays", []))


class OffDeviceStrategy(Strategy):
    """Shared base: workers on a ``data`` mesh compute, the state lives elsewhere."""

    def __init__(self, devices: int | Sequence[jax.Device] | None = None):
        super().__init__(devices)
        self.mesh = make_mesh(self.devices, data=len(self.devices))

    @cached_property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA))

    def place_batch(self, batch: Batch) -> Batch:
        """Send each slice of the global batch to its worker (a clear error when it does not split)."""
        return put_batch(batch, self.batch_sharding, self.num_replicas)


class CentralStorage(OffDeviceStrategy):
    """One copy of parameters and optimizer state in host memory; the devices only compute.

    Conceptually, with ``n`` devices and a global batch ``b``::

        params_i = copy(params)                     # pull: host -> device i, for every i
        grads_i = grad(loss_fn)(params_i, b[i * len(b) // n : (i + 1) * len(b) // n])
        grads = mean(copy_to_host(grads_i) for i in range(n))   # push, then reduce on the host
        params = update(params, grads)              # once, on the one host copy

    which equals the single-device step on ``b`` because the loss is a mean.

    Args:
      devices: how many compute devices (the first ``n``), or which; all by default.
      storage: the device whose host memory holds the state; the first compute device by default.
    """

    def __init__(self, devices: int | Sequence[jax.Device] | None = None, storage: jax.Device | None = None):
        super().__init__(devices)
        self.storage = host_sharding(storage if storage is not None else self.devices[0])

    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        refuse_step_extras(self, model_state, rng)
        return jax.device_put(create_state(params, tx, opt_state), self.storage)

    def step(self, loss_fn: LossFn) -> Step:
        compute = compute_sharding(self.storage)
        update = jax.jit(
            lambda state, rows: apply_mean_gradients(state, *rows, compute),
            in_shardings=(self.storage, compute),
            out_shardings=(self.storage, compute),
            donate_argnums=0,
        )

        def push_update(state, grads, metrics):
            # push: every replica's gradient row is copied to the storage device
            return update(state, jax.device_put((grads, metrics), compute))

        pull = lambda state: jax.device_put(state.params, self.replicated)  # noqa: E731
        return Step(PushPullStep(pull, replica_gradients(loss_fn, self.mesh), push_update), self.place_batch, self)

    def __repr__(self) -> str:
        return f"CentralStorage(devices={self.num_replicas}, storage={self.storage.memory_kind})"
