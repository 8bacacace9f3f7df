"""Asynchronous parameter-server training: every worker's gradient applied on its own, as it arrives.

References:
  Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", 2013."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from ...core.mesh import outside_callers_mesh
from ...core.precision import Precision
from ...core.state import TrainState
from ...core.step import keep_finite_choice
from ...core.types import Batch, LossFn
from .rows import gradient_rows

_JITTER = 0.25  # each gradient computation takes its worker's time x U(1 - _JITTER, 1 + _JITTER)


@dataclass(frozen=True)
class _Push:
    """One gradient the shards applied: who computed it, on which version, and how stale it was."""

    worker: int
    version: int  # updates applied to the parameters it was computed on (0: the initial ones)
    delay: int  # updates other workers applied between its pull and its push

    @property
    def applied_to(self) -> int:
        """The version it was applied to (it produced version ``applied_to + 1``)."""
        return self.version + self.delay


def worker_time_array(workers: int, worker_times: Sequence[float] | None) -> np.ndarray:
    """Each worker's relative time per gradient (1 for all by default), or a clear error."""
    times = np.ones(workers) if worker_times is None else np.asarray(worker_times, dtype=float)
    if times.shape != (workers,) or not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError(
            f"worker_times={worker_times!r}: give one time per worker ({workers}), each a number > 0 "
            "(the relative time a worker takes to compute one gradient)."
        )
    return times


class AsyncWorkers:
    """The workers' clocks, simulated on a seeded schedule: who pushes next, on which version.

    All workers pull version 0 at time 0. The worker whose computation ends first pushes
    (ties go to the lower index); if its gradient is more than ``staleness`` updates old
    it is dropped and the worker pulls the current version and computes again,
    otherwise it is applied (the version grows by one) and the worker pulls the new one.

    Three equal workers start on version 0 together; after the first round each finds the
    other two's pushes applied since its pull:

    >>> workers = AsyncWorkers(3, seed=0)
    >>> for _ in range(6):
    ...     push, dropped = workers.next_push()
    ...     workers.applied()
    ...     print(push)
    _Push(worker=2, version=0, delay=0)
    _Push(worker=1, version=0, delay=1)
    _Push(worker=0, version=0, delay=2)
    _Push(worker=2, version=1, delay=2)
    _Push(worker=1, version=2, delay=2)
    _Push(worker=0, version=3, delay=2)
    """

    def __init__(
        self, workers: int, worker_times: Sequence[float] | None = None, staleness: int | None = None, seed: int = 0
    ):
        self.times, self.staleness = worker_time_array(workers, worker_times), staleness
        self.rng = np.random.default_rng(seed)
        self.version = 0  # updates applied so far
        self.pulled = [0] * workers  # the version each worker holds
        self.finish = [self._duration(w) for w in range(workers)]  # when each worker's gradient is ready
        self.dropped = 0  # gradients dropped for being staler than the bound
        self._pushing: int | None = None  # the worker whose push next_push returned last

    def _duration(self, worker: int) -> float:
        return float(self.times[worker] * self.rng.uniform(1 - _JITTER, 1 + _JITTER))

    def _pull(self, worker: int) -> None:
        self.pulled[worker] = self.version
        self.finish[worker] += self._duration(worker)

    def next_push(self) -> tuple[_Push, list[int]]:
        """The next gradient to apply, and the workers that dropped theirs and pulled the current version first.

        Call :meth:`applied` after applying it.
        """
        repulled = []
        while True:
            worker = min(range(len(self.finish)), key=lambda w: (self.finish[w], w))
            delay = self.version - self.pulled[worker]
            if self.staleness is None or delay <= self.staleness:
                self._pushing = worker
                return _Push(worker, self.pulled[worker], delay), repulled
            self.dropped += 1
            self._pull(worker)
            repulled.append(worker)

    def applied(self) -> None:
        """The push :meth:`next_push` returned was applied: one version more, and its worker pulls it."""
        self.version += 1
        self._pull(self._pushing)

    def schedule(self, pushes: int) -> list[_Push]:
        """The next ``pushes`` gradients applied, with nothing trained: the clocks alone.

        >>> [p.delay for p in AsyncWorkers(3, seed=0).schedule(6)]
        [0, 1, 2, 2, 2, 2]
        """
        applied = []
        for _ in range(pushes):
            applied.append(self.next_push()[0])
            self.applied()
        return applied


class AsyncStep:
    """One round of asynchronous PS training: the next ``n`` pushes, each applied on its own.

    ``state, metrics = step(state, batch)``; ``metrics`` are the mean of the round's
    pushes' metrics, each measured by its worker on the parameters it pulled, except a dynamic
    ``loss_scale``, which is the scale after the round's last push.
    ``pushes`` lists every applied gradient so far (:class:`_Push`), ``delays`` their delays.

    Args:
      loss_fn: the loss on the strategy's parameters (the shards' flat slices).
      devices: the workers' devices, in the order the batch is sliced over them.
      update: ``(state, rows) -> (state, metrics)``, the shards' push and update for
        rows of one gradient (:class:`~parallelkit.strategies.offdevice.parameter_server.ShardedUpdate`).
      workers: the simulated clocks.
      precision: a :class:`~parallelkit.Precision` policy (None: the parameters' dtype). Each
        push is an update of its own: with a loss scale, one whose gradient is not finite is
        skipped and the scale adjusted, push by push; a worker computes with the scale it pulled.

    In a step that keeps its state when the loss is not finite (``Step.keep_finite``, ``pk.fit``'s),
    a push whose loss is not finite changes nothing, the state's counter included; the simulated
    clocks (and ``pushes``) count it as an update all the same.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        devices: Sequence[jax.Device],
        update: Callable,
        workers: AsyncWorkers,
        precision: Precision | None = None,
    ):
        self.devices, self.update, self.workers = tuple(devices), update, workers
        self.places = [SingleDeviceSharding(d, memory_kind=d.default_memory().kind) for d in self.devices]
        self.gradient = _gradient_program(loss_fn, precision)
        self.programs: list = []  # each worker's compiled gradient program, for the slices' shapes in `shapes`
        self.shapes: list | None = None
        self.copies: list = []  # each worker's pulled (params, model_state, loss_scale), on its device
        self.pushes: list[_Push] = []
        self.start: int | None = None  # the state's step counter when this run began
        self.unchanged = 0  # pushes that changed nothing, their loss not finite (counted a round late)
        self.losses: list = []  # the last round's pushes' losses, where a push whose loss is not finite is kept

    @property
    def delays(self) -> list[int]:
        """How many updates old each applied gradient was, in the order applied."""
        return [p.delay for p in self.pushes]

    def pull(self, state: TrainState, worker: int) -> tuple:
        """Every shard (and the model state and loss scale) copied to ``worker``'s device: the copy it computes on."""
        return jax.device_put((state.params, state.model_state, state.loss_scale), self.places[worker])

    def _check_continues(self, state: TrainState) -> None:
        step, losses = jax.device_get((state.step, self.losses))  # one wait a round, as before
        step, self.losses = int(step), []
        self.unchanged += sum(not np.isfinite(loss) for loss in losses)
        applied = self.workers.version - self.unchanged
        if self.start is None:
            self.start = step
        elif step != self.start + applied:
            raise ValueError(
                f"This async ParameterServer step has applied {applied} updates since step "
                f"{self.start}, but was handed a state at step {step}. Its workers hold copies of their own run's "
                "parameters, so it continues only the state it returned last: make a fresh strategy.step(loss_fn) "
                "for another run."
            )

    @outside_callers_mesh
    def __call__(self, state: TrainState, batch: Batch):
        self._check_continues(state)
        slices = _slices(batch, self.devices)
        if not self.copies:  # every worker pulls the starting parameters
            self.copies = [self.pull(state, w) for w in range(len(self.devices))]
        shapes = [jax.tree.map(lambda x: (x.shape, x.dtype), data) for data in slices]
        if shapes != self.shapes:  # each worker compiles for its slice's shapes (again for a batch of new shapes)
            self.programs = [
                self.gradient.lower(*self._arguments(state, w, self.copies[w], slices[w])).compile()
                for w in range(len(self.devices))
            ]
            self.shapes = shapes
        metrics = []
        for data in slices:  # push k of the round computes on slice k
            push, repulled = self.workers.next_push()
            for w in repulled:  # dropped a stale gradient: pulls the current parameters again
                self.copies[w] = self.pull(state, w)
            w = push.worker
            rows = self.programs[w](*self._arguments(state, w, self.copies[w], data))
            state, pushed = self.update(state, rows)
            if keep_finite_choice() is not None:  # this push changed nothing if its loss is not finite
                self.losses.append(pushed["loss"])
            self.workers.applied()
            self.pushes.append(push)
            self.copies[w] = self.pull(state, w)
            metrics.append(pushed)
        mean = jax.tree.map(lambda *m: sum(m) / len(m), *metrics)
        if "loss_scale" in mean and state.loss_scale is not None:  # a mean of scales is a scale no push used
            # A copy: the next round donates the state, and a metric still unread (the skipped-steps watch
            # reads it once it is ready) must not be the state's own buffer.
            mean["loss_scale"] = jnp.copy(state.loss_scale.scale)
        return state, mean

    def _arguments(self, state: TrainState, worker: int, copy: tuple, data: Batch) -> tuple:
        """``worker``'s gradient program's arguments: its pulled ``copy``, and its slice ``data`` and key placed."""
        params, model_state, loss_scale = copy
        key = None if state.rng is None else jax.device_put(state.rng, self.places[worker])
        return params, jax.device_put(data, self.places[worker]), key, model_state, worker, loss_scale

    @outside_callers_mesh
    def lower(self, state: TrainState, batch: Batch):
        """The first worker's gradient program (it holds no collective: each worker computes alone)."""
        return self.gradient.lower(*self._arguments(state, 0, self.pull(state, 0), _slices(batch, self.devices)[0]))


@functools.lru_cache(maxsize=64)
def _gradient_program(loss_fn: LossFn, precision: Precision | None) -> Callable:
    """The jitted gradient program of ``loss_fn``: one per loss and policy, shared by every run's workers, so a
    second run (another staleness bound, say) finds JAX's compiled programs for the same shapes and devices."""
    return jax.jit(functools.partial(gradient_rows, loss_fn, precision=precision))


def _slices(batch: Batch, devices: Sequence[jax.Device]) -> list[Batch]:
    """The placed global batch's slice on each device, in device order."""
    by_device = [
        {shard.device: shard.data for shard in x.addressable_shards} for x in jax.tree.leaves(batch)
    ]  # one dict per leaf
    treedef = jax.tree.structure(batch)
    return [treedef.unflatten([leaf[d] for leaf in by_device]) for d in devices]
