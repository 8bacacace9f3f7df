"""The contract every strategy keeps, and the training step they all share.

A strategy decides *where state lives* and *how gradients meet*; the model, the
loss, the optimizer and the data stay plain JAX, Flax and Optax. Every strategy:

- ``init(params, tx)`` places parameters and optimizer state, returning a :class:`TrainState`;
- ``step(loss_fn)`` returns a :class:`Step`: ``state, metrics = step(state, batch)``,
  where ``batch`` is the *global* batch as host arrays and the loss is its mean;
- ``unreplicate(tree)`` brings one host (NumPy) copy back, for inspection and checkpoints;
- ``place_batch(batch)`` places the global host batch as the step takes it;
- ``describe(state)`` lists where every leaf lives.

The whole protocol the tools call is :class:`~parallelkit.strategies.protocol.StrategyProtocol`;
what they know about each strategy beyond it is in :mod:`parallelkit.strategies.catalog`.
Strategies that split parameters (:class:`~parallelkit.TensorParallel`) take their
partition rules in their constructor, so ``init`` and ``step`` keep this shape for
all of them; see :mod:`parallelkit.strategies.spmd`.
"""

from __future__ import annotations

import abc
import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from ..devices import resolve_devices
from ..partition import path_label as path_label  # re-exported: one spelling of a leaf's path
from .protocol import Batch as Batch
from .protocol import LossFn as LossFn
from .protocol import LossInputError as LossInputError
from .protocol import Metrics as Metrics
from .protocol import PyTree as PyTree
from .protocol import _loss_with_aux as _loss_with_aux
from .protocol import batch_size as batch_size
from .protocol import guard_inputs as guard_inputs

if TYPE_CHECKING:
    from ..traffic import ExpectedCollective, Sizes, StepTraffic


@struct.dataclass
class TrainState:
    """Parameters, optimizer state and step count; the optimizer rides along, static.

    Two optional parts belong to the step as well:

    - ``rng``: a PRNG key, split every step; the loss gets a fresh key as ``rng=``
      (for dropout). Under ``jax.jit`` with shardings the key draws randomness for the
      *global* batch, exactly as on one device; replicas that compute on their own
      (``pmap``) fold their replica index into it, so each draws its own.
    - ``model_state``: mutable model state such as BatchNorm statistics; the loss gets
      it as ``model_state=`` and returns ``(loss, aux, new_model_state)``.
    """

    step: jax.Array
    params: PyTree
    opt_state: PyTree
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    rng: jax.Array | None = None
    model_state: PyTree = None

    def apply_gradients(self, grads: PyTree) -> TrainState:
        """One optimizer update: what every strategy does once the gradients have met."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates), opt_state=opt_state)


def create_state(
    params: PyTree,
    tx: optax.GradientTransformation,
    opt_state: PyTree = None,
    *,
    model_state: PyTree = None,
    rng: int | jax.Array | None = None,
) -> TrainState:
    """A fresh :class:`TrainState`, checking a given ``opt_state`` against ``tx.init(params)``.

    The state holds copies: strategies donate it to their step, which must never
    delete the caller's own arrays. ``rng`` may be a seed (an int) or a key from
    ``jax.random.PRNGKey``.

    Raises:
      ValueError: ``opt_state`` (for example from a checkpoint) does not fit ``params``.
    """
    expected = jax.eval_shape(tx.init, params)
    if opt_state is None:
        opt_state = tx.init(params)
    else:
        check_same_tree(expected, opt_state, what="opt_state", against="tx.init(params)")
    params, opt_state, model_state, rng = jax.tree.map(
        lambda x: jnp.array(x, copy=True), (params, opt_state, model_state, prng_key(rng))
    )
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, tx=tx, rng=rng, model_state=model_state
    )


def prng_key(rng: int | jax.Array | None) -> jax.Array | None:
    """A PRNG key from a seed (an int); a key (or None) passes through unchanged."""
    return jax.random.PRNGKey(rng) if isinstance(rng, int) and not isinstance(rng, bool) else rng


def check_same_tree(expected: PyTree, actual: PyTree, *, what: str, against: str) -> None:
    """Raise a ValueError naming the first leaf where two trees differ in structure, shape or dtype."""
    exp_leaves, exp_def = jax.tree_util.tree_flatten_with_path(expected)
    act_leaves, act_def = jax.tree_util.tree_flatten_with_path(actual)
    if exp_def != act_def:
        exp_paths = {jax.tree_util.keystr(p) for p, _ in exp_leaves}
        act_paths = {jax.tree_util.keystr(p) for p, _ in act_leaves}
        detail = sorted(exp_paths ^ act_paths)[:3] or [f"{exp_def} vs {act_def}"]
        raise ValueError(
            f"{what} does not have the structure of {against}; differing leaves: {detail}. "
            f"Build {what} from the same parameters and optimizer."
        )
    for (path, exp), (_, act) in zip(exp_leaves, act_leaves, strict=True):
        if tuple(np.shape(act)) != tuple(exp.shape) or jnp.result_type(act) != exp.dtype:
            raise ValueError(
                f"{what}{jax.tree_util.keystr(path)} has shape {np.shape(act)} and dtype "
                f"{jnp.result_type(act)}, but {against} gives {exp.shape} {exp.dtype}."
            )


def check_divisible(batch: Batch, replicas: int) -> int:
    """The per-replica batch size; a global batch that does not split evenly is an error.

    >>> check_divisible({"x": np.zeros((32, 3))}, 8)
    4
    """
    size = batch_size(batch)
    if size % replicas:
        lower, upper = size - size % replicas, size - size % replicas + replicas
        raise ValueError(
            f"A global batch of {size} examples does not split evenly over {replicas} replicas. "
            f"Use a batch size divisible by {replicas} (for example {lower or upper} or {upper})."
        )
    return size // replicas


def put_batch(batch: Batch, sharding: jax.sharding.Sharding, replicas: int) -> Batch:
    """``jax.device_put`` of the global batch onto ``sharding``, with a clear error when it does not split.

    The divisibility check runs only when ``device_put`` refuses, keeping the
    per-step path as short as a hand-written one; it raises the clear error.
    """
    try:
        return jax.device_put(batch, sharding)
    except ValueError:
        check_divisible(batch, replicas)
        raise


def explain_input_error(err: LossInputError, strategy: Strategy, params: PyTree, batch: Batch) -> str:
    """``err``'s message with the strategy, the batch's arrays and the weights, and what to check.

    ``params`` and ``batch`` are host (logical) trees: ``strategy.unreplicate(state.params)``
    and the global batch. The weights (parameters of two or more axes) whose input size, the
    second-to-last axis, appears in the original error's message come first.
    """
    if err.missing_key:
        return (
            f"{strategy!r}: {err} Name the batch's arrays as the loss reads them "
            "(pk.models.classifier_loss reads 'x' and 'y'), or change the loss."
        )
    arrays = [
        (path_label(p), np.shape(x), np.result_type(x)) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]
    ]
    weights = [
        (path_label(p), np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0] if np.ndim(x) > 1
    ]
    named = {int(n) for n in re.findall(r"\d+", str(err.__cause__ or err))}
    weights.sort(key=lambda weight: weight[1][-2] not in named)  # first: those whose input size the error names
    held = ", ".join(f"{name} {shape} {dtype}" for name, shape, dtype in arrays)
    shown = ", ".join(f"{name} {shape}" for name, shape in weights[:4]) + (
        f" and {len(weights) - 4} more" if len(weights) > 4 else ""
    )
    return (
        f"{strategy!r}: {err} The batch holds {held}; the weights are {shown or 'none of two or more axes'}. "
        f"{_unfit(arrays, weights)}Where shapes or dtypes do not fit, give each array of the batch the shape the "
        "model was built for (features last), and integer class ids as labels."
    )


def _unfit(arrays: Sequence[tuple], weights: Sequence[tuple]) -> str:
    """A sentence naming a floating batch array whose features no weight takes (its input axis: second to last)."""
    inputs = sorted({shape[-2] for _, shape in weights})
    for name, shape, dtype in arrays:
        if len(shape) < 2 or not jnp.issubdtype(dtype, jnp.floating) or not inputs:
            continue
        sizes = {shape[-1], math.prod(shape[1:]), *([math.prod(shape[2:])] if len(shape) > 2 else [])}
        if not sizes & set(inputs):
            return (
                f"No weight takes {name}'s features: {name} has {shape[-1]} values on its last axis "
                f"({math.prod(shape[1:])} an example), but the weights take {', '.join(map(str, inputs))} inputs "
                "(their second-to-last axis). "
            )
    return ""


def train_step(
    loss_fn: LossFn,
    state: TrainState,
    batch: Batch,
    sync: Callable[[PyTree], PyTree] = lambda tree: tree,
    replica_key: Callable[[jax.Array], jax.Array] = lambda key: key,
) -> tuple[TrainState, Metrics]:
    """The single-device step, shared by every strategy.

    ``sync`` is where gradients meet: the identity on one device or under ``jit``
    with shardings (the compiler inserts the all-reduce), ``lax.pmean`` under ``pmap``.
    It also averages the metrics and the new model state. ``replica_key`` turns the
    step's key into this replica's (the identity where the program sees the global batch).
    """
    batch_size(batch)  # runs while tracing: arrays of one batch must agree on its size
    rng, extras = state.rng, {}
    if rng is not None:
        rng, key = jax.random.split(rng)
        extras["rng"] = replica_key(key)
    if state.model_state is not None:
        extras["model_state"] = state.model_state
    (loss, (aux, model_state)), grads = jax.value_and_grad(_loss_with_aux(loss_fn), has_aux=True)(
        state.params, batch, **extras
    )
    grads, metrics, model_state = sync((grads, {"loss": loss, **aux}, model_state))
    return state.apply_gradients(grads).replace(rng=rng, model_state=model_state), metrics


# At most this many steps queued on simulated CPU devices; XLA's own limit is 32 a device,
# past which a multi-device program can deadlock (see parallelkit.devices).
MAX_STEPS_IN_FLIGHT = 8


@dataclass(frozen=True)
class Placed:
    """A global batch already placed by ``strategy`` (see :func:`parallelkit.prefetch`); ``size``: its examples."""

    batch: Batch
    size: int
    strategy: Strategy


class Step:
    """A compiled training step: ``state, metrics = step(state, batch)``.

    Places the global host batch the way its strategy wants, then calls the jitted
    (or pmapped) function. ``lower(state, batch)`` gives the lowered program, for
    reading its HLO (see :mod:`parallelkit.inspect`).

    Dispatch stays asynchronous: a call returns before the device finishes, so a
    plain ``for batch in batches: state, metrics = step(state, batch)`` keeps the
    devices busy. On several CPU devices the step waits for the one dispatched
    ``MAX_STEPS_IN_FLIGHT`` calls earlier, so the loop can never queue enough work to
    deadlock XLA's CPU runtime; on accelerators nothing waits.

    Passing a state that an earlier call already consumed (its buffers are donated
    to the step) raises a ``ValueError`` that says so.
    """

    def __init__(self, fn: Callable, place_batch: Callable[[Batch], Batch], strategy: Strategy):
        self.fn = fn
        self.place_batch = place_batch
        self.strategy = strategy
        devices = strategy.devices
        paced = len(devices) > 1 and all(d.platform == "cpu" for d in devices)
        self._in_flight: deque | None = deque() if paced else None

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        # A donated state must never reach the program: pmap crashes the process on one.
        # Donation deletes every leaf at once, so the step counter tells (a cheap check).
        if is_deleted(getattr(state, "step", None)):
            raise ValueError(DONATED_STATE)
        try:
            out = self.fn(state, self._placed(batch))
        except LossInputError as err:  # raised while tracing, at the first call: the steps that run pay nothing
            raise self._explained(err, state, batch) from err.__cause__
        except (RuntimeError, ValueError) as err:
            if "deleted" in str(err) and any(is_deleted(x) for x in jax.tree.leaves(state)):
                raise ValueError(DONATED_STATE) from err
            raise
        if self._in_flight is not None:
            self._in_flight.append(out[1])
            if len(self._in_flight) > MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(self._in_flight.popleft())
        return out

    def _placed(self, batch: Batch) -> Batch:
        """The batch as the program takes it: placed now, or already by :func:`parallelkit.prefetch`."""
        if not isinstance(batch, Placed):
            return self.place_batch(batch)
        if batch.strategy is not self.strategy:
            raise ValueError(
                f"This batch was placed by {batch.strategy!r}, not by this step's {self.strategy!r}: "
                "prefetch with the strategy that runs the step, pk.prefetch(batches, strategy)."
            )
        return batch.batch

    def lower(self, state: TrainState, batch: Batch):
        try:
            return self.fn.lower(state, self._placed(batch))
        except LossInputError as err:
            raise self._explained(err, state, batch) from err.__cause__

    def _explained(self, err: LossInputError, state: TrainState, batch: Batch) -> LossInputError:
        """``err`` again, naming this step's strategy, the global batch's arrays and the parameters' weights."""
        host = batch.batch if isinstance(batch, Placed) else batch
        params = self.strategy.unreplicate(state.params)
        return LossInputError(explain_input_error(err, self.strategy, params, host), missing_key=err.missing_key)

    def __repr__(self) -> str:
        return f"Step({self.strategy!r})"


DONATED_STATE = (
    "This state was already consumed by a training step: the step donates its input state's buffers "
    "to the new state, so the old arrays are deleted. Use the state the step (or pk.fit's result) "
    "returned, as in `state, metrics = step(state, batch)`, or keep a copy made before the step "
    "(`jax.tree.map(jnp.copy, state)`)."
)


def is_deleted(leaf: Any) -> bool:
    """Whether ``leaf`` is a JAX array whose buffers were donated or deleted."""
    return isinstance(leaf, jax.Array) and leaf.is_deleted()


@dataclass(frozen=True)
class LeafPlacement:
    """Where one leaf of the state lives."""

    path: str
    shape: tuple[int, ...]  # the logical shape, as the single-device program sees it
    dtype: str
    devices: tuple[int, ...]  # ids of the devices holding some or all of it
    memory_kind: str | None
    spec: str  # the PartitionSpec, or the sharding's name
    copies: int  # how many full copies exist across the devices
    bytes_per_device: int


def total_bytes(rows: Sequence[LeafPlacement]) -> int:
    """Bytes a state takes over all its devices: every device's share of every leaf.

    A replicated leaf counts once per device that holds a copy; a sharded one, its shards.

    >>> rows = [LeafPlacement(".params['w']", (4,), "float32", (0, 1), "device", "P()", 2, 16),
    ...         LeafPlacement(".params['b']", (4,), "float32", (0, 1), "device", "P('data')", 1, 8)]
    >>> total_bytes(rows)
    48
    """
    return sum(row.bytes_per_device * len(row.devices) for row in rows)


def bytes_by_part(rows: Sequence[LeafPlacement]) -> dict[str, int]:
    """Bytes one device holds of each part of a state (``params``, ``opt_state``, ``step``, ...).

    Sums :meth:`Strategy.describe`'s rows by the state's top-level field, the largest
    device's share of each leaf.

    >>> rows = [LeafPlacement(".params['w']", (4,), "float32", (0, 1), "device", "P('data')", 1, 8),
    ...         LeafPlacement(".opt_state[0].mu['w']", (4,), "float32", (0, 1), "device", "P('data')", 1, 8)]
    >>> bytes_by_part(rows)
    {'params': 8, 'opt_state': 8}
    """
    parts: dict[str, int] = {}
    for row in rows:
        part = re.match(r"\.?(\w+)", row.path).group(1)
        parts[part] = parts.get(part, 0) + row.bytes_per_device
    return parts


class Strategy(abc.ABC):
    """Base of every strategy: holds configuration (the devices), never training state.

    It keeps :class:`~parallelkit.strategies.protocol.StrategyProtocol`: a subclass writes
    ``init``, ``step`` and ``place_batch``, and inherits the rest.
    """

    def __init__(self, devices: int | Sequence[jax.Device] | None = None):
        self.devices = resolve_devices(devices)

    @property
    def num_replicas(self) -> int:
        """How many copies of the model compute on separate slices of the batch."""
        return len(self.devices)

    @abc.abstractmethod
    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        """Place parameters and optimizer state (a given ``opt_state`` is checked and placed).

        ``model_state`` (BatchNorm statistics, from :func:`parallelkit.models.from_nnx`)
        and ``rng`` (a seed or key, for dropout) ride in the state when given.
        """

    @abc.abstractmethod
    def step(self, loss_fn: LossFn) -> Step:
        """Compile-once training step for ``loss_fn(params, batch) -> loss or (loss, aux)``."""

    @abc.abstractmethod
    def place_batch(self, batch: Batch) -> Any:
        """The global host batch, placed as this strategy's step takes it (see :func:`parallelkit.prefetch`)."""

    def unreplicate(self, tree: PyTree) -> PyTree:
        """One host (NumPy) copy of ``tree``."""
        return jax.device_get(tree)

    def logical_shape(self, leaf: jax.Array) -> tuple[int, ...]:
        return tuple(leaf.shape)

    def checkpoint_refusal(self) -> str | None:
        """Why a checkpoint of this strategy's state could not resume its run exactly (None: it can)."""
        return None

    # The pattern its traffic follows, as StepTraffic.pattern: TopologyModel times the patterns
    # of parallelkit.traffic.TOPOLOGY ("local", "all-reduce", "central", "sharded"), no others.
    traffic_pattern = "local"

    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic:
        """The bytes one step moves (per replica), measured, beside this strategy's formulas.

        By default: the batch slice, and the collectives read from the compiled step set
        against :meth:`expected_collectives`. Strategies that move state between memories
        outside one program (central storage, parameter servers) measure those copies.
        It compiles (or pulls and computes once) but does not train: ``state`` is left as it is.
        """
        from ..traffic import compiled_traffic  # the traffic module builds on this one

        return compiled_traffic(self, loss_fn, state, batch)

    def expected_collectives(self, sizes: Sizes) -> Sequence[ExpectedCollective] | None:
        """The collectives one step needs by the book (None: no formula for this model).

        The default is none: one device, or devices that never talk to each other.
        """
        return ()

    def describe(self, state: PyTree) -> list[LeafPlacement]:
        """Where every leaf of ``state`` lives: devices, memory kind, partition spec, copies."""
        rows = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            shape = self.logical_shape(leaf)
            logical_bytes = int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize
            per_device = max(s.data.nbytes for s in leaf.addressable_shards)
            on_devices = sum(s.data.nbytes for s in leaf.addressable_shards)
            sharding = leaf.sharding
            rows.append(
                LeafPlacement(
                    path=jax.tree_util.keystr(path),
                    shape=shape,
                    dtype=str(leaf.dtype),
                    devices=tuple(sorted(d.id for d in sharding.device_set)),
                    memory_kind=sharding.memory_kind,
                    spec=str(getattr(sharding, "spec", type(sharding).__name__)),
                    copies=on_devices // logical_bytes if logical_bytes else len(sharding.device_set),
                    bytes_per_device=per_device,
                )
            )
        return rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.num_replicas})"
