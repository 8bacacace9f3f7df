"""Central storage (TensorFlow's CentralStorageStrategy): one copy of the state, off the compute devices.

Parameters and optimizer state live once, in host memory. Each step runs three
stages, and the bytes of each are real transfers between memories:

1. **pull**: the parameters are copied from host memory to every compute device;
2. **compute**: each device takes its slice of the global batch and computes its
   own gradients (one compiled program, ``jax.shard_map`` over the ``data`` axis);
   no collective runs between the devices. With ``accumulate=K`` each device runs its
   slice as ``K`` microbatches in a ``lax.scan`` and averages their gradients there, so
   it still pushes one gradient row a step;
3. **push and update**: the per-replica gradients are copied to the owner's device
   (its default memory: a device-to-device copy, as TensorFlow would copy them to the
   CPU), and a second compiled program there copies the state in from host memory,
   averages the gradients into one, applies the optimizer update once and writes the
   state back to host memory. The arithmetic runs on the owner's device, not on the
   CPU host; the state crosses between host memory and that device twice a step, and
   the traffic report counts both crossings.

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
from flax import struct
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ..core.accumulate import Accumulation, accumulated_placement, check_accumulate
from ..core.axes import DATA
from ..core.contract import Batch, LossFn, PyTree, put_batch
from ..core.mesh import make_mesh
from ..core.precision import Precision, all_finite, check_precision, guarded
from ..core.reports import D2D, D2H, H2D, Flow, StepTraffic
from ..core.state import TrainState, create_state
from ..core.step import Step, loss_and_grads
from ..measure.inspect import collectives, host_memory_bytes
from ..measure.traffic import batch_flow, bus_bytes, per_replica_bytes, sizes
from .base import Strategy

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
    return SingleDeviceSharding(jax.local_devices(backend="cpu")[0])


def compute_sharding(sharding: SingleDeviceSharding) -> SingleDeviceSharding:
    """The compute memory of the device behind ``sharding`` (where XLA runs the update)."""
    device = next(iter(sharding.device_set))
    return SingleDeviceSharding(device, memory_kind=device.default_memory().kind)


@struct.dataclass
class ReplicaRows:
    """What the workers hand back: one row per replica (leading axis), except ``rng``.

    ``grads``, ``metrics`` and ``model_state`` (BatchNorm statistics, or None) are
    stacked over the replicas, row ``i`` on worker ``i``; ``rng`` is the state's key
    for the next step (None without one), the same on every worker. With a loss scale,
    ``finite`` says whether each replica's gradients were all finite (None without one).
    """

    grads: PyTree
    metrics: PyTree
    model_state: PyTree = None
    rng: jax.Array | None = None
    finite: jax.Array | None = None


def gradient_rows(
    loss_fn: LossFn,
    params: PyTree,
    batch: Batch,
    rng: jax.Array | None,
    model_state: PyTree,
    replica,
    loss_scale: PyTree = None,
    *,
    precision: Precision | None = None,
    accumulate: Accumulation | None = None,
) -> ReplicaRows:
    """One replica's gradients, metrics and model state, each as a row (a leading axis of 1), and the next key.

    With a key, the replica draws its own randomness from it: ``rng, key = split(rng)``,
    then ``fold_in(key, replica)``, as under ``pmap``. With ``precision`` the gradients are
    cast and unscaled on the worker, before the push (``loss_scale``: the state's dynamic scale).
    With ``accumulate`` the replica's batch runs as microbatches whose gradients are averaged
    on the worker (:class:`~parallelkit.core.accumulate.Accumulation`): still one row.
    """
    extras = {} if model_state is None else {"model_state": model_state}
    if rng is not None:
        rng, key = jax.random.split(rng)
        extras["rng"] = jax.random.fold_in(key, replica)
    loss, aux, model_state, grads = loss_and_grads(
        loss_fn, params, batch, extras, accumulate=accumulate, precision=precision, loss_scale=loss_scale
    )
    rows = jax.tree.map(lambda x: x[None], (grads, {"loss": loss, **aux}, model_state))
    finite = None if precision is None or precision.loss_scale is None else all_finite(grads)[None]
    return ReplicaRows(*rows, rng=rng, finite=finite)


def replica_gradients(loss_fn: LossFn, mesh: Mesh, precision: Precision | None = None, accumulate: int = 1) -> Callable:
    """``(params, batch, rng, model_state, loss_scale) -> ReplicaRows``: one row per replica, nothing reduced.

    Conceptually, with ``n`` replicas and the global batch ``b``::

        rng, key = split(rng)                            # as the single-device step does
        rows = [value_and_grad(loss_fn)(params, b[i * len(b) // n : (i + 1) * len(b) // n],
                                        rng=fold_in(key, i), model_state=model_state) for i in range(n)]

    Each replica draws its own randomness (its index folded into the step's key, as
    under ``pmap``). ``params``, ``rng`` and ``model_state`` arrive replicated on the
    mesh (the pull); the rows stay sharded on ``data``, so the program holds no
    collective of its own: the reduction is the owner's job. (A model that averages
    BatchNorm statistics over the ``data`` axis adds that all-reduce to the forward pass.)
    With ``accumulate=K`` each replica scans ``K`` microbatches of its slice and averages
    their gradients locally: the rows, and so the push, are the same size as with ``K = 1``.
    """
    micro = None if check_accumulate(accumulate) == 1 else Accumulation(accumulate)

    def per_replica(params: PyTree, batch: Batch, rng: jax.Array | None, model_state: PyTree, loss_scale: PyTree):
        replica = jax.lax.axis_index(DATA)
        return gradient_rows(
            loss_fn, params, batch, rng, model_state, replica, loss_scale, precision=precision, accumulate=micro
        )

    # check_vma=False: with it on, differentiating replicated (unvarying) params against a
    # sharded batch inserts a psum of the gradients, the all-reduce we want to leave out.
    # The next key is the same on every replica, so it comes back replicated (P()).
    out_specs = ReplicaRows(P(DATA), P(DATA), P(DATA), P(), P(DATA))
    sharded = jax.shard_map(
        per_replica, mesh=mesh, in_specs=(P(), P(DATA), P(), P(), P()), out_specs=out_specs, check_vma=False
    )
    return jax.jit(sharded)


def push_rows(rows: ReplicaRows, owner: SingleDeviceSharding) -> tuple[ReplicaRows, ...]:
    """The push: every replica's row copied to the owner's device, one :class:`ReplicaRows` a replica.

    Each row goes straight from its worker's device to the owner's, and the owner's own
    row is not copied at all. (``jax.device_put`` of the stacked rows, an array sharded
    over the workers, would gather it through host NumPy instead: it waits for the
    workers and copies every byte twice.) The key travels with the first row.
    """
    leaves, treedef = jax.tree.flatten((rows.grads, rows.metrics, rows.model_state, rows.finite))
    by_replica = [list(row) for row in zip(*map(_replica_shards, leaves), strict=True)]
    pushed = jax.device_put(by_replica, owner)
    rng = None if rows.rng is None else jax.device_put(rows.rng, owner)
    rebuilt = (treedef.unflatten(row) for row in pushed)
    return tuple(ReplicaRows(g, m, s, rng=rng if i == 0 else None, finite=f) for i, (g, m, s, f) in enumerate(rebuilt))


def _replica_shards(x: jax.Array) -> list[jax.Array]:
    """The rows of ``x`` (sharded over its leading axis) as single-device arrays, in replica order."""
    return [s.data for s in sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)]


def join_rows(pushed: Sequence[ReplicaRows]) -> ReplicaRows:
    """The pushed rows stacked again, one leading axis (inside the owner's program, where it costs no copy)."""
    rows = jax.tree.map(lambda *r: jnp.concatenate(r), *(p.replace(rng=None) for p in pushed))
    return rows.replace(rng=pushed[0].rng)


def apply_mean_gradients(
    state: TrainState, pushed: Sequence[ReplicaRows], compute: SingleDeviceSharding, precision: Precision | None = None
) -> tuple[TrainState, PyTree]:
    """The owner's update (inside ``jit``): average the replicas' rows, then one optimizer step.

    The state is brought from host memory into ``compute`` memory first (XLA computes
    there; the jitted caller writes the result back out). The mean of per-replica mean
    gradients is the gradient of the global mean loss, what the single-device step
    computes (up to float summation order). Model state rows are averaged too, as
    ``pmap``'s ``pmean`` does; the key becomes the workers' next key. With a loss scale the
    update is skipped unless every replica's gradients were finite
    (:func:`~parallelkit.core.precision.guarded`).
    """
    state, rows = jax.device_put(state, compute), join_rows(pushed)
    mean = functools.partial(jax.tree.map, mean_rows)
    new = state.apply_gradients(mean(rows.grads)).replace(rng=rows.rng, model_state=mean(rows.model_state))
    if precision is None or precision.loss_scale is None:
        return new, mean(rows.metrics)
    new, scaling = guarded(precision, state, new, jnp.all(rows.finite))
    return new, {**mean(rows.metrics), **scaling}


def mean_rows(x: jax.Array) -> jax.Array:
    """The mean over the leading (replica) axis, as ``(x[0] + x[1] + ... + x[n-1]) / n``.

    The same numbers as ``jnp.mean(x, axis=0)``, written as ``n - 1`` additions of whole
    rows because XLA's CPU backend reduces over a leading axis slowly: for the gradients
    of a 784-1024-1024-10 MLP from 2 replicas, 18.8 ms against 0.5 ms for the additions.
    """
    total = x[0]
    for i in range(1, x.shape[0]):
        total = total + x[i]
    return total / x.shape[0]


class CentralUpdate:
    """The push and the update of central storage: the rows to the storage device, one program there.

    ``update(state, rows) -> (state, metrics)``; :meth:`lowered` gives the update
    program as it runs (the traffic report reads its host-memory arguments from it).
    """

    def __init__(self, storage: SingleDeviceSharding, precision: Precision | None = None):
        self.compute = compute_sharding(storage)
        self.program = jax.jit(
            functools.partial(apply_mean_gradients, compute=self.compute, precision=precision),
            in_shardings=(storage, self.compute),
            out_shardings=(storage, self.compute),
            donate_argnums=0,
        )

    def __call__(self, state: TrainState, rows: ReplicaRows):
        return self.program(state, push_rows(rows, self.compute))

    def lowered(self, state: TrainState, rows: ReplicaRows) -> list:
        return [self.program.lower(state, push_rows(rows, self.compute))]


class PushPullStep:
    """Pull, compute, push-and-update, as one callable; ``lower`` gives the workers' program.

    Args:
      pull: ``state -> (params, rng, model_state, loss_scale)`` replicated on the workers (host-to-device copies).
      compute: the jitted :func:`replica_gradients`.
      push_update: ``(state, rows) -> (state, metrics)``: moves the rows to the owners
        and applies the update there; its ``lowered(state, rows)`` lists the update programs.
    """

    def __init__(self, pull: Callable, compute: Callable, push_update: Callable):
        self.pull, self.compute, self.push_update = pull, compute, push_update

    def __call__(self, state: TrainState, batch: Batch):
        params, *rest = self.pull(state)
        return self.push_update(state, self.compute(params, batch, *rest))

    def lower(self, state: TrainState, batch: Batch):
        params, *rest = self.pull(state)
        return self.compute.lower(params, batch, *rest)


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

    traffic_pattern = "central"
    pull_label, push_label, formula = "parameters (pull)", "gradients (push to the storage device)", "P"

    def owner_loads(self, rows: ReplicaRows) -> tuple[int, ...]:
        """Gradient bytes each owner of the state receives per step (all replicas' rows)."""
        return (sum(int(x.nbytes) for x in jax.tree.leaves(rows.grads)),)

    def round_trip_bytes(self, state: TrainState) -> tuple[int, str]:
        """(bytes, formula) of the state its update programs copy in from host memory, and back, per step."""
        return sum(int(x.nbytes) for x in jax.tree.leaves(state)), "S = P + O + step, key, model state"

    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch, accumulate: int = 1) -> StepTraffic:
        """Every transfer of a step, measured on the arrays and programs this strategy really runs.

        Runs one pull and the workers' gradient computation (real copies; ``state`` is
        left as it is) and measures what lands on each worker; reads the workers'
        compiled program for collectives (none, unless the model adds its own) and the
        update programs for the state they copy in from host memory and write back.
        Per replica: the batch slice, the pull (host memory to each worker), the push
        (each worker's rows to the owner's device; the owner's own row stays where it
        is). At the owners, once per step: the state's round trip. ``accumulate``: measure the
        step that runs ``K`` microbatches (each worker averages their gradients before its one push).
        """
        step = self.step(loss_fn, accumulate)
        size = sizes(self, loss_fn, state, batch)
        params, *rest = step.fn.pull(state)  # real copies, host memory -> every worker
        placed = step.place_batch(batch)
        rows = step.fn.compute(params, placed, *rest)  # rows stay on their workers
        found = collectives(step.fn.compute, params, placed, *rest)
        measure = functools.partial(per_replica_bytes, devices=self.devices)
        flows = (
            batch_flow(self, batch),
            Flow(H2D, self.pull_label, measure(params), size.params, self.formula, "pulled arrays, per device"),
            Flow(D2D, self.push_label, measure(rows.grads), size.params, self.formula, "pushed gradient rows"),
            Flow(D2D, "metrics (push)", measure(rows.metrics), size.metrics, "M", "pushed metric rows"),
            Flow(D2D, "collectives", sum(c.bytes for c in found), 0, "0", "compiled HLO of the workers"),
        )
        moved = [host_memory_bytes(u.compile().as_text()) for u in step.fn.push_update.lowered(state, rows)]
        expected, formula = self.round_trip_bytes(state)
        source = "host-memory {} of the update program(s)"
        owner_flows = (
            Flow(H2D, "state in (host memory -> owner)", sum(m[0] for m in moved), expected, formula,
                 source.format("arguments")),
            Flow(D2H, "state out (owner -> host memory)", sum(m[1] for m in moved), expected, formula,
                 source.format("results")),
        )  # fmt: skip
        return StepTraffic(repr(self), self.traffic_pattern, size.replicas, size.params, size.metrics, flows,
                           self.owner_loads(rows), bus_bytes(found), owner_flows)  # fmt: skip


class CentralStorage(OffDeviceStrategy):
    """One copy of parameters and optimizer state in host memory; the devices only compute.

    Conceptually, with ``n`` devices and a global batch ``b``::

        params_i = copy(params)                     # pull: host -> device i, for every i
        grads_i = grad(loss_fn)(params_i, b[i * len(b) // n : (i + 1) * len(b) // n])
        grads = mean(copy_to(storage, grads_i) for i in range(n))   # push to the storage device
        params = update(params, grads)   # once: state copied in from host memory, updated, written back

    which equals the single-device step on ``b`` because the loss is a mean over the
    examples (an unweighted one: a loss divided by a per-replica count, such as unmasked
    tokens, averages differently).

    With ``step(loss_fn, accumulate=K)`` each device cuts its slice into ``K`` microbatches,
    scans them and averages their gradients before its one push, so a step pulls and pushes
    the same bytes whatever ``K``; it equals one step on the whole batch.

    Randomness and model state work as under ``pmap``: with ``rng=`` each replica
    draws its own dropout masks (its index folded into the step's key), and the
    replicas' new model state is averaged with the gradients. BatchNorm equals
    SingleDevice when the model averages its batch statistics over the ``data`` axis
    (``pk.models.CNN(..., bn_axis_name="data")``, SyncBatchNorm).

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

        def pull(state: TrainState):
            return jax.device_put((state.params, state.rng, state.model_state, state.loss_scale), self.replicated)

        compute = replica_gradients(loss_fn, self.mesh, precision, accumulate)
        step = PushPullStep(pull, compute, CentralUpdate(self.storage, precision))
        return Step(step, accumulated_placement(self.place_batch, accumulate, self.num_replicas), self, precision)

    def __repr__(self) -> str:
        return f"CentralStorage(devices={self.num_replicas}, storage={self.storage.memory_kind})"
