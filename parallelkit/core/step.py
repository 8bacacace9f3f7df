"""The training step every strategy shares, and the callable that places the batch and runs it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from .accumulate import Accumulation, ReplicaCopies
from .contract import LossInputError, batch_size, explain_input_error, loss_with_aux
from .mesh import outside_callers_mesh
from .precision import (
    Precision,
    all_finite,
    check_param_dtypes,
    guarded,
    mixed_loss,
    select,
    unscale,
    with_loss_scale,
)
from .skipped import StepWatch
from .state import TrainState
from .types import Batch, LossFn, Metrics, PyTree

if TYPE_CHECKING:
    from .protocol import StrategyProtocol as Strategy


def train_step(
    loss_fn: LossFn,
    state: TrainState,
    batch: Batch,
    sync: Callable[[PyTree], PyTree] = lambda tree: tree,
    replica_key: Callable[[jax.Array], jax.Array] = lambda key: key,
    accumulate: Accumulation | ReplicaCopies | None = None,
    precision: Precision | None = None,
    update: Callable[[TrainState, PyTree], TrainState] = TrainState.apply_gradients,
) -> tuple[TrainState, Metrics]:
    """The single-device step, shared by every strategy.

    ``sync`` is where gradients meet: the identity on one device or under ``jit``
    with shardings (the compiler inserts the all-reduce), ``lax.pmean`` under ``pmap``.
    It also averages the metrics and the new model state. ``replica_key`` turns the
    step's key into this replica's (the identity where the program sees the global batch).
    ``accumulate`` (:class:`~parallelkit.core.accumulate.Accumulation`) runs the batch as
    microbatches and averages their gradients before ``sync`` (or
    :class:`~parallelkit.core.accumulate.ReplicaCopies` maps one pass over the replicas); None: one
    pass over the batch.
    ``precision`` (:class:`~parallelkit.core.precision.Precision`) casts the passes, scales the
    loss and skips an update whose gradients are not all finite (after ``sync``, so every
    replica decides alike); None: the parameters' own dtype.
    ``update(state, grads)`` applies the met gradients (:meth:`TrainState.apply_gradients`; an SPMD
    step on an Explicit mesh runs it in the optimizer state's layout, as ZeRO 1 and 2 need).
    Traced for a :class:`Step` whose ``keep_finite`` is set (``pk.fit``'s), a step whose loss is not
    finite returns its input state unchanged (its metrics still report the loss).
    """
    batch_size(batch)  # runs while tracing: arrays of one batch must agree on its size
    rng, extras = state.rng, {}
    if rng is not None:
        rng, key = jax.random.split(rng)
        extras["rng"] = replica_key(key)
    if state.model_state is not None:
        extras["model_state"] = state.model_state
    loss, aux, model_state, grads = loss_and_grads(
        loss_fn, state.params, batch, extras, accumulate=accumulate, precision=precision, loss_scale=state.loss_scale
    )
    grads, metrics, model_state = sync((grads, {"loss": loss, **aux}, model_state))
    finite = None if precision is None or precision.loss_scale is None else all_finite(grads)

    def updated() -> TrainState:
        return update(state, grads).replace(rng=rng, model_state=model_state)

    new, scaling = guarded_update(state, updated, precision, finite, keep_finite_choice(), metrics["loss"])
    return new, {**metrics, **scaling}


def guarded_update(
    state: TrainState,
    updated: Callable[[], TrainState],
    precision: Precision | None,
    finite: jax.Array | None,
    keep: Callable | None,
    loss: jax.Array | None,
) -> tuple[TrainState, dict]:
    """The state after ``updated()`` and the metrics a loss scale adds: skipped by the scale unless ``finite``
    (:func:`~parallelkit.core.precision.guarded`), and ``state`` unchanged where ``keep`` is set and ``loss``
    is not finite (:func:`unless_not_finite`; the same metrics: a loss scale's read the old state only)."""
    return unless_not_finite(
        keep,
        loss,
        lambda: guarded(precision, state, updated(), finite),
        lambda: (state, guarded(precision, state, state, finite)[1]),
    )


def keep_finite_choice() -> Callable | None:
    """How the step being traced (or called) keeps its input state when its loss is not finite.

    ``lax.cond`` or a select (see ``_KEEP_FINITE``) inside a :class:`Step` whose ``keep_finite`` is
    set, None elsewhere. A step whose programs are compiled apart from its trace (the off-device
    strategies', a pipeline's) reads it when called and compiles one program for each answer.
    """
    return _KEEP_FINITE.get()


def unless_not_finite(keep: Callable | None, loss: jax.Array, updated: Callable, unchanged: Callable) -> Any:
    """``updated()``, or ``unchanged()`` where ``keep`` is set and ``loss`` is not finite.

    ``keep``: :func:`keep_finite_choice`'s answer, ``lax.cond``'s contract (both branches give the same
    tree); None: ``updated()`` alone, nothing checked.
    """
    if keep is None:
        return updated()
    return keep(jnp.isfinite(loss), updated, unchanged)


def _selected(ok: jax.Array, updated: Callable, unchanged: Callable) -> Any:
    """``updated()`` where ``ok``, else ``unchanged()``, leaf by leaf: ``lax.cond``'s contract, as one select."""
    return select(ok, updated(), unchanged())


# Set while a Step with keep_finite traces or runs (Step._dispatch): how train_step (and, through
# keep_finite_choice, the off-device strategies' and a pipeline's updates) keeps a step whose loss is not
# finite from changing the state. On CPU devices lax.cond: on two shared cores (an MLP 784-1024-1024-10,
# batch 256, Adam, one device) it timed within noise of no check (median ratio per round 0.99-1.04),
# where a select cost 7-13 %. Elsewhere a select: element-wise work, where a conditional can stop to
# read its predicate on the host in the middle of the step (not measured on an accelerator).
_KEEP_FINITE: ContextVar[Callable | None] = ContextVar("keep_finite", default=None)


def loss_and_grads(
    loss_fn: LossFn,
    params: PyTree,
    batch: Batch,
    extras: dict,
    *,
    accumulate: Accumulation | ReplicaCopies | None = None,
    precision: Precision | None = None,
    loss_scale: PyTree = None,
) -> tuple[jax.Array, dict, PyTree, PyTree]:
    """``(loss, aux, new_model_state, grads)`` of one replica's batch, not yet synchronised.

    With ``precision`` the passes run in its compute dtype and the gradients come back in its
    ``params`` dtype, unscaled (:func:`~parallelkit.core.precision.mixed_loss`); ``loss_scale``
    is the state's dynamic scale, if any.
    """
    loss = loss_with_aux(loss_fn)
    scale = None
    if precision is not None:
        check_param_dtypes(params, precision)
        scale = precision.scale(loss_scale)
        loss = mixed_loss(loss, precision, scale)
    if accumulate is None:
        (value, (aux, model_state)), grads = jax.value_and_grad(loss, has_aux=True)(params, batch, **extras)
    else:
        (value, (aux, model_state)), grads = accumulate(loss, params, batch, extras)
    if precision is None:
        return value, aux, model_state, grads
    (value, aux) = aux  # the unscaled float32 loss and metrics
    return value, aux, model_state, unscale(grads, precision, scale)


# At most this many steps queued on simulated CPU devices; XLA's own limit is 32 a device,
# past which a multi-device program can deadlock (see parallelkit.core.devices).
MAX_STEPS_IN_FLIGHT = 8


@dataclass(frozen=True)
class Placed:
    """A global batch already placed by ``strategy`` (see :func:`parallelkit.run.prefetch`); ``size``: its examples."""

    batch: Batch
    size: int
    strategy: Strategy


class Step:
    """A compiled training step: ``state, metrics = step(state, batch)``.

    Places the global host batch the way its strategy wants, then calls the jitted
    (or pmapped) function. ``lower(state, batch)`` gives the lowered program, for
    reading its HLO (see :mod:`parallelkit.measure.inspect`).

    Dispatch stays asynchronous: a call returns before the device finishes, so a
    plain ``for batch in batches: state, metrics = step(state, batch)`` keeps the
    devices busy. On several CPU devices every ``MAX_STEPS_IN_FLIGHT // 2``-th call waits for
    the call that many calls before it, so no more than ``MAX_STEPS_IN_FLIGHT`` steps are ever
    queued and the loop can never queue enough work to deadlock XLA's CPU runtime; on
    accelerators nothing waits.

    Passing a state that an earlier call already consumed (its buffers are donated
    to the step) raises a ``ValueError`` that says so. With a dynamic loss scale
    (``precision``), a state without one gets a fresh one on the way in
    (:func:`~parallelkit.core.precision.with_loss_scale`), and a run whose steps are skipped one
    after another (gradients never finite) warns once (:mod:`parallelkit.core.skipped`).

    Setting ``keep_finite = True`` before the first call (``pk.fit`` does) compiles a step that
    returns its input state unchanged when the loss is not finite, so that the last state whose
    loss was finite survives the donation; the metrics still report the loss. A strategy whose
    step is not :func:`train_step` (a pipeline's, the off-device strategies') keeps it the same
    way (:func:`unless_not_finite`), where it applies its update.
    """

    def __init__(
        self,
        fn: Callable,
        place_batch: Callable[[Batch], Batch],
        strategy: Strategy,
        precision: Precision | None = None,
    ):
        self.fn = fn
        self.place_batch = place_batch
        self.strategy = strategy
        self.precision = precision
        devices = strategy.devices
        paced = len(devices) > 1 and all(d.platform == "cpu" for d in devices)
        # The outputs of every (MAX_STEPS_IN_FLIGHT // 2)-th call, kept to wait on; None: no pacing.
        self._in_flight: deque | None = deque() if paced else None
        self._calls = 0
        scaled = precision is not None and precision.loss_scale is not None
        # Warns of a run whose steps are all skipped; None turns it off (pk.fit stops such a run itself).
        self.watch: StepWatch | None = StepWatch(precision) if scaled else None
        self.keep_finite = False
        self._keep = jax.lax.cond if all(d.platform == "cpu" for d in devices) else _selected

    @outside_callers_mesh
    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        # A donated state must never reach the program: pmap crashes the process on one.
        # Donation deletes every leaf at once, so the step counter tells (a cheap check).
        if is_deleted(getattr(state, "step", None)):
            raise ValueError(DONATED_STATE)
        state = with_loss_scale(state, self.precision)
        try:
            out = self._dispatch(self.fn, state, batch)
        except LossInputError as err:  # raised while tracing, at the first call: the steps that run pay nothing
            raise self._explained(err, state, batch) from err.__cause__
        except (RuntimeError, ValueError) as err:
            if "deleted" in str(err) and any(is_deleted(x) for x in jax.tree.leaves(state)):
                raise ValueError(DONATED_STATE) from err
            raise
        if self.watch is not None:
            self.watch.observe(out[1])
        if self._in_flight is not None:
            self._pace(out[1])
        return out

    def _pace(self, metrics: Metrics) -> None:
        """Every ``MAX_STEPS_IN_FLIGHT // 2``-th call, wait for the one that many calls before it.

        Each step's program follows the one before it on every device, so that call done means all
        before it are: at most ``MAX_STEPS_IN_FLIGHT`` steps are queued. The other calls pay one
        addition (queueing every call's output and waiting for the oldest half of them cost about 1 % of
        a small step on simulated CPU devices: ``benchmarks/README.md``, "Pacing one call in four").
        """
        self._calls += 1
        if self._calls % (MAX_STEPS_IN_FLIGHT // 2):
            return
        self._in_flight.append(metrics)
        if len(self._in_flight) > 1:
            for leaf in jax.tree.leaves(self._in_flight.popleft())[:1]:  # the outputs are ready together
                leaf.block_until_ready()

    def _dispatch(self, fn: Callable, state: TrainState, batch: Batch) -> Any:
        """``fn(state, placed batch)``, traced (if it traces now) to keep the state of a non-finite step."""
        if not self.keep_finite:
            return fn(state, self._placed(batch))
        token = _KEEP_FINITE.set(self._keep)
        try:
            return fn(state, self._placed(batch))
        finally:
            _KEEP_FINITE.reset(token)

    def _placed(self, batch: Batch) -> Batch:
        """The batch as the program takes it: placed now, or already by :func:`parallelkit.run.prefetch`."""
        if not isinstance(batch, Placed):
            return self.place_batch(batch)
        if batch.strategy is not self.strategy:
            raise ValueError(
                f"This batch was placed by {batch.strategy!r}, not by this step's {self.strategy!r}: "
                "prefetch with the strategy that runs the step, pk.prefetch(batches, strategy)."
            )
        return batch.batch

    @outside_callers_mesh
    def lower(self, state: TrainState, batch: Batch):
        state = with_loss_scale(state, self.precision)
        try:
            return self._dispatch(self.fn.lower, state, batch)
        except LossInputError as err:
            raise self._explained(err, state, batch) from err.__cause__

    def _explained(self, err: LossInputError, state: TrainState, batch: Batch) -> LossInputError:
        """``err`` again, naming this step's strategy, the global batch's arrays and the parameters' weights."""
        host = batch.batch if isinstance(batch, Placed) else batch
        params = self.strategy.unreplicate(state.params)
        return LossInputError(explain_input_error(err, self.strategy, params, host), missing_key=err.missing_key)

    def __repr__(self) -> str:
        return f"Step({self.strategy!r})"


def check_step_call(who: str, step: Any, state: Any) -> None:
    """Raise a ``TypeError`` naming what was given when ``step`` and ``state`` are not a step and its state.

    For the tools that compile or run ``step(state, batch)`` (``who``: ``"pk.inspect.flops"``, ...):
    a strategy or a loss passed where its step belongs, or parameters where the state belongs.
    """
    if hasattr(step, "init") and hasattr(step, "step"):
        raise TypeError(
            f"{who} got the strategy {step!r}, not a step: pass step = strategy.step(loss_fn) and its state, "
            f"{who}(step, state, batch)."
        )
    if not hasattr(step, "lower"):
        name = getattr(step, "__name__", type(step).__name__)
        raise TypeError(
            f"{who} got {name!r}, which is not a compiled step (it has no .lower): pass strategy.step(loss_fn) "
            "(or a jax.jit function) with the state it takes."
        )
    if isinstance(step, Step) and not isinstance(state, TrainState):
        raise TypeError(
            f"{who} got a {type(state).__name__} as the state: pass the state the strategy made, "
            f"state = strategy.init(params, optimizer), not the parameters."
        )


DONATED_STATE = (
    "This state was already consumed by a training step: the step donates its input state's buffers "
    "to the new state, so the old arrays are deleted. Use the state the step (or pk.fit's result) "
    "returned, as in `state, metrics = step(state, batch)`, or keep a copy made before the step "
    "(`jax.tree.map(jnp.copy, state)`)."
)


def is_deleted(leaf: Any) -> bool:
    """Whether ``leaf`` is a JAX array whose buffers were donated or deleted."""
    return isinstance(leaf, jax.Array) and leaf.is_deleted()
