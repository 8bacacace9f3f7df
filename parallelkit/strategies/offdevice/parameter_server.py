"""Parameter servers (TensorFlow's ParameterServerStrategy, ``--ps_hosts``): state sharded over PS shards."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import SingleDeviceSharding

from ...core.accumulate import accumulated_placement, refuse_accumulation
from ...core.devices import warn_if_shared
from ...core.mesh import outside_callers_mesh
from ...core.precision import Precision, check_precision
from ...core.reports import StepTraffic
from ...core.state import TrainState, check_same_tree, prng_key
from ...core.step import Step, keep_finite_choice
from ...core.types import Batch, LossFn, PyTree
from ..base import refuse_explicit
from ..split_update import check_update_splits
from .asynchronous import AsyncStep, AsyncWorkers, worker_time_array
from .base import NOT_EXPLICIT, OffDeviceStrategy
from .partition import Partition, Sharded, check_num_shards
from .rows import (
    PushPullStep,
    ReplicaRows,
    apply_mean_gradients,
    compute_sharding,
    host_sharding,
    push_rows,
    replica_gradients,
)

_MODES = ("sync", "async")

_ASYNC_ACCUMULATION = (
    "In mode='async' every worker's gradient is applied alone as it arrives: there is no step-wide "
    "synchronisation for microbatches to share. Accumulate with mode='sync', or give the async run a "
    "smaller batch."
)


class ParameterServer(OffDeviceStrategy):
    """Parameters and optimizer state sharded over ``num_shards`` PS shards; workers pull and push.

    Conceptually, with ``n`` workers, shards ``s_1..s_k`` and a global batch ``b``::

        params = concat(s_1, ..., s_k)                    # pull: every worker gets every shard
        grads_i = grad(loss_fn)(params, b[i * len(b) // n : (i + 1) * len(b) // n])
        for j in range(k):                                # push: each piece goes to its owner,
            s_j = update_j(s_j, mean(grads_i[piece j] for i in range(n)))   # which updates it

    ``step(loss_fn, accumulate=K)`` (sync mode) accumulates as :class:`~parallelkit.CentralStorage` does.

    In ``"sync"`` mode this equals the single-device step for optimizers that act
    element by element (SGD, momentum, Adam, AdamW): each shard keeps the optimizer
    state of its own flat slice, as TensorFlow's PS tasks do, and updates it alone.
    An optimizer that needs more than one element at a time (``optax.clip_by_global_norm``,
    the per-parameter norms of LAMB and LARS, a weight-decay mask chosen by path) would
    see only its shard's slice, so :meth:`init` refuses it, in both modes, after a probe
    (:func:`~parallelkit.strategies.split_update.check_update_splits`).

    A PRNG key and model state (BatchNorm statistics) live with shard 0 and work as
    in :class:`~parallelkit.CentralStorage`: each worker draws its own dropout masks,
    and the workers' model state is averaged.

    In ``"async"`` mode each worker's gradient is applied on its own, as it arrives
    (``n`` updates per step for ``n`` workers, each on ``1/n`` of the global batch),
    computed on the parameters its worker pulled, which other workers may have
    updated since (who pushes when: ``worker_times``, ``seed`` and ``staleness`` below).
    ``step.fn.pushes`` records every applied gradient (worker, version, delay), and the
    workers keep the copies they pulled: use a fresh ``step(loss_fn)`` for each run.
    See :mod:`parallelkit.strategies.offdevice.asynchronous`.

    Args:
      num_shards: how many PS shards, from 1 to the number of parameter elements.
      mode: ``"sync"`` or ``"async"``.
      staleness: in ``"async"`` mode, the oldest gradient applied, in updates (``>= 0``;
        ``None``: no bound).
      devices: how many workers (the first ``n`` devices), or which; all by default.
      seed: seeds the async workers' schedule.
      worker_times: in ``"async"`` mode, each worker's relative time per gradient
        (equal by default).
      explicit: False (Auto mode); True is refused, as for :class:`~parallelkit.CentralStorage`.

    Raises:
      ValueError: an unknown mode, a staleness or worker times that do not fit it, a shard count
        that is not a whole number >= 1, or ``explicit=True``.

    Warns:
      DeviceSubsetWarning: without ``devices``, when there are more shards than devices, so
        that some devices hold two shards (shard ``j`` lives beside device ``j % n``).
    """

    def __init__(
        self,
        num_shards: int = 1,
        mode: str = "sync",
        staleness: int | None = None,
        devices: int | Sequence[jax.Device] | None = None,
        seed: int = 0,
        worker_times: Sequence[float] | None = None,
        *,
        explicit: bool = False,
    ):
        refuse_explicit("ParameterServer", explicit, NOT_EXPLICIT)
        if mode not in _MODES:
            raise ValueError(f"ParameterServer(mode={mode!r}): choose one of {_MODES}.")
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0):
            raise ValueError(f"staleness={staleness!r}: it counts updates, so use an integer >= 0 (or None: no bound).")
        if mode == "sync" and (staleness is not None or worker_times is not None):
            given = "staleness" if staleness is not None else "worker_times"
            raise ValueError(f"{given} needs mode='async'; sync training waits for every worker and is never stale.")
        check_num_shards(num_shards)
        super().__init__(devices)
        self.num_shards, self.mode, self.staleness, self.seed = num_shards, mode, staleness, seed
        self.worker_times = None if worker_times is None else tuple(worker_times)
        if mode == "async":
            worker_time_array(self.num_replicas, self.worker_times)  # a clear error now, not at the first step
        self.shard_storage = tuple(host_sharding(self.devices[j % self.num_replicas]) for j in range(num_shards))
        if devices is None:
            warn_if_shared(num_shards, self.devices, f"ParameterServer(num_shards={num_shards})", "shards")

    pattern = "parameter_server"
    formula = "P = P_1 + ... + P_k"

    @property
    def updates_per_step(self) -> int:
        """The updates one step applies (its state's counter grows by as many): one a worker in async mode, else 1."""
        return self.num_replicas if self.mode == "async" else 1

    @property
    def pull_label(self) -> str:
        return f"parameters from {self.num_shards} shard(s) (pull)"

    @property
    def push_label(self) -> str:
        return f"gradients to {self.num_shards} shard(s) (push)"

    def owner_loads(self, rows: ReplicaRows) -> tuple[int, ...]:
        """Gradient bytes each shard receives per step: ``n`` rows of its slice."""
        return tuple(int(shard.nbytes) for shard in rows.grads.shards)

    def round_trip_bytes(self, state: TrainState) -> tuple[int, str]:
        """The state, plus the step counter each shard but the first reads and writes (its own copy)."""
        extra = (self.num_shards - 1) * int(state.step.nbytes)
        return super().round_trip_bytes(state)[0] + extra, "S + (k-1) step counters"

    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch, accumulate: int = 1) -> StepTraffic:
        """The bytes of one synchronous step (see :meth:`OffDeviceStrategy.traffic`); sync mode only."""
        if self.mode == "async":
            raise ValueError(
                f"{self!r}: traffic is measured for a synchronous step. Asynchronously, each applied gradient "
                "moves a pull and a push of P for its worker and a state round trip at every shard, and each "
                f"dropped one another pull: measure ParameterServer({self.num_shards}, devices=...) for those flows."
            )
        return super().traffic(loss_fn, state, batch, accumulate)

    def checkpoint_refusal(self) -> str | None:
        if self.mode == "sync":
            return None
        return (
            f"{self!r}: an async run lives partly outside its state (each worker's pulled copy of the parameters, "
            "the workers' simulated clocks), so a checkpoint of the state could not resume it exactly. "
            "Checkpoint a mode='sync' run, or train async without checkpoint_dir."
        )

    def partition(self, params: PyTree) -> Partition:
        """How ``params`` are cut over the shards (``print(strategy.partition(params).table(strategy.devices))``)."""
        return Partition.of(params, self.num_shards)

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
        """Cut the parameters over the shards and give each shard ``tx.init`` of its own slice.

        Raises:
          ValueError: an optimizer whose update of the slices differs from its update of the
            whole tree (see :func:`~parallelkit.strategies.split_update.check_update_splits`),
            or an ``opt_state`` that is not one state per shard.
        """
        part = self.partition(params)
        check_update_splits(
            tx, params, part.split, part.join, strategy=repr(self),
            how=f"runs the optimizer on each of its {self.num_shards} shards' flat slices of the parameters "
            "separately" if self.num_shards > 1 else "runs the optimizer on the parameters flattened into one vector",
            layout=("parameter server", self.num_shards),
            what_to_do="Train with an element-wise optimizer (optax.sgd, momentum, adam, adamw without a mask), "
            "or with SingleDevice, Mirrored or FullySharded, which update every parameter at once.",
        )  # fmt: skip
        slices = part.split(params)
        if opt_state is not None:  # a given state is per shard: tx.init of each shard's slice
            check_same_tree(jax.eval_shape(lambda: tuple(tx.init(s) for s in slices)), opt_state,
                            what="opt_state", against="the shards' tx.init")  # fmt: skip
        else:
            opt_state = tuple(tx.init(s) for s in slices)
        placed = [
            jax.device_put((s, o), where) for s, o, where in zip(slices, opt_state, self.shard_storage, strict=True)
        ]
        # the step counter, the key and the model state live with shard 0 (host copies: the step donates them)
        step, rng, model_state = jax.device_put(
            jax.device_get((jnp.zeros((), jnp.int32), prng_key(rng), model_state)), self.shard_storage[0]
        )
        params = Sharded(tuple(p for p, _ in placed), part)
        return TrainState(
            step=step, params=params, opt_state=tuple(o for _, o in placed), tx=tx, rng=rng, model_state=model_state
        )

    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step:
        """Pull, compute, push and update (sync or async); ``accumulate > 1`` in sync mode only.

        ``accumulate=K``: each worker scans ``K`` microbatches of its slice and averages their gradients
        before its one push; a global batch that does not divide by ``K x workers`` is a ``ValueError``.
        Async mode refuses ``K > 1`` (``NotImplementedError``): each push there is an update of its own.

        ``precision``: the workers cast, scale and unscale, and every shard skips its update unless
        all the workers' gradients were finite (each worker pushes that flag to every shard); the
        dynamic scale lives with shard 0. In async mode each push is an update of its own, skipped
        or not and the scale adjusted push by push; a round's ``grads_finite`` metric is then the
        fraction of its pushes that were finite, and its ``loss_scale`` the scale after its last push.
        """
        if self.mode == "async":
            refuse_accumulation(repr(self), accumulate, _ASYNC_ACCUMULATION)
        check_precision(precision)
        push_update = ShardedUpdate(self.shard_storage, precision)
        if self.mode == "async":
            workers = AsyncWorkers(self.num_replicas, self.worker_times, self.staleness, self.seed)
            pushes = AsyncStep(_flat_loss(loss_fn), self.devices, push_update, workers, precision)
            return Step(pushes, self.place_batch, self, precision)
        compute = replica_gradients(_flat_loss(loss_fn), self.mesh, precision, accumulate)
        place = accumulated_placement(self.place_batch, accumulate, self.num_replicas)
        return Step(PushPullStep(self.pull, compute, push_update), place, self, precision)

    def unreplicate(self, tree: PyTree) -> PyTree:
        """One host copy; sharded parameters come back as the original tree."""
        host = jax.device_get(tree)
        return jax.tree.map(
            lambda x: x.partition.join(x.shards) if isinstance(x, Sharded) else x,
            host,
            is_leaf=lambda x: isinstance(x, Sharded),
        )

    def __repr__(self) -> str:
        extra = f", staleness={self.staleness}" if self.mode == "async" else ""
        extra += f", worker_times={self.worker_times}" if self.worker_times is not None else ""
        return f"ParameterServer(num_shards={self.num_shards}, mode={self.mode!r}{extra}, workers={self.num_replicas})"


class ShardedUpdate:
    """The push and the updates of the PS shards: each gradient piece to its owner, one program per shard.

    ``update(state, rows) -> (state, metrics)``; :meth:`lowered` gives each shard's
    update program as it runs (the traffic report reads their host-memory arguments).
    """

    def __init__(self, shard_storage: Sequence[SingleDeviceSharding], precision: Precision | None = None):
        self.storage, self.precision = tuple(shard_storage), precision
        self.computes = [compute_sharding(where) for where in self.storage]  # built once, not every step

    def _calls(self, state: TrainState, rows: ReplicaRows):
        """Each shard's program and its arguments: its slice of every gradient row, pushed to its device.

        In a step that keeps its state when the loss is not finite
        (:func:`~parallelkit.core.step.keep_finite_choice`), every shard is pushed the loss rows too,
        so that each decides alike and alone.
        """
        keep = keep_finite_choice()
        loss = {} if keep is None else {"loss": rows.metrics["loss"]}
        for j, (where, compute) in enumerate(zip(self.storage, self.computes, strict=True)):
            if j == 0:  # shard 0 also takes the metrics, the key, the model state and the loss scale
                mine = rows.replace(grads=rows.grads.shards[0])
                step, extras = state.step, (state.rng, state.model_state, state.loss_scale)
            else:  # every shard takes the workers' finite flags (None without a loss scale)
                mine = ReplicaRows(rows.grads.shards[j], loss, finite=rows.finite)
                step, extras = jax.device_put(state.step, where), (None, None, None)
            program = _shard_update_program(where, self.precision, keep)
            yield program, (state.tx, step, state.params.shards[j], state.opt_state[j], extras,
                            push_rows(mine, compute))  # fmt: skip

    def __call__(self, state: TrainState, rows: ReplicaRows):
        new = [program(*args) for program, args in self._calls(state, rows)]
        step, _, _, (rng, model_state, loss_scale), metrics = new[0]
        params = Sharded(tuple(n[1] for n in new), state.params.partition)
        opt_state = tuple(n[2] for n in new)
        new_state = state.replace(step=step, params=params, opt_state=opt_state, rng=rng, model_state=model_state)
        return new_state.replace(loss_scale=loss_scale), metrics

    def lowered(self, state: TrainState, rows: ReplicaRows) -> list:
        return [program.lower(*args) for program, args in self._calls(state, rows)]


def _flat_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` on the shards' flat slices (the partition rebuilds the tree). One function per loss, so that
    every strategy over the same loss hands JAX the same function and finds its programs compiled."""
    try:
        return _shared_flat_loss(loss_fn)
    except TypeError:  # an unhashable callable: a function of its own
        return _on_shards(loss_fn)


def _on_shards(loss_fn: LossFn) -> LossFn:
    def flat_loss(shards: Sharded, batch: Batch, **extras):
        return loss_fn(shards.partition.join(shards.shards), batch, **extras)

    return flat_loss


_shared_flat_loss = functools.lru_cache(maxsize=64)(_on_shards)


@functools.lru_cache(maxsize=64)
def _shard_update_program(
    where: SingleDeviceSharding, precision: Precision | None = None, keep: Callable | None = None
):
    """The compiled update of the shard stored at ``where``: (tx, step, params, opt_state, extras, rows) in.

    ``extras`` is ``(rng, model_state, loss_scale)`` on shard 0 and ``(None, None, None)`` elsewhere; the
    step counter is read, not donated (shard 0's copy may be the one the other shards read). ``keep``: keep
    the shard as it was when the pushed loss is not finite (:func:`~parallelkit.core.step.keep_finite_choice`).
    One program per place, policy and keep, shared by every strategy that stores a shard there: JAX then
    compiles it once for each optimizer and shapes, not once per strategy.
    """
    compute = compute_sharding(where)
    return jax.jit(
        functools.partial(_shard_update, compute=compute, precision=precision, keep=keep),
        static_argnums=0,
        in_shardings=(where, where, where, where, compute),
        out_shardings=(where, where, where, where, compute),
        donate_argnums=(2, 3, 4),
    )


def _shard_update(tx, step, params, opt_state, extras, rows, *, compute, precision=None, keep=None):
    """One shard's update: the shared :func:`apply_mean_gradients` on its own slice and optimizer state."""
    rng, model_state, loss_scale = extras
    owned = TrainState(
        step=step, params=params, opt_state=opt_state, tx=tx, rng=rng, model_state=model_state, loss_scale=loss_scale
    )
    state, metrics = apply_mean_gradients(owned, rows, compute, precision, keep)
    return state.step, state.params, state.opt_state, (state.rng, state.model_state, state.loss_scale), metrics
