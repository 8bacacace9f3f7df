"""The narrow protocol every strategy keeps, and the contracts of the loss and the batch it trains on.

Tools (``pk.fit``, the traffic report, the bench, the race, checkpoints) call a strategy
only through :class:`StrategyProtocol`; what they need to know beyond it (its name in the
tour, its Rosetta names, which traffic and cost-model pattern it follows) they read from
:mod:`parallelkit.strategies.catalog`. :class:`parallelkit.Strategy` is a base class that
keeps the protocol with defaults; a strategy may also keep it without inheriting.

This module imports nothing else of parallelkit, so both the strategies and the
measuring tools (:mod:`parallelkit.traffic`) can build on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import optax

if TYPE_CHECKING:
    from ..traffic import ExpectedCollective, Sizes, StepTraffic
    from .base import LeafPlacement, Step, TrainState

PyTree = Any
Batch = Mapping[str, Any]
LossFn = Callable[[PyTree, Batch], Any]  # -> loss, or (loss, aux dict)
Metrics = dict[str, jax.Array]


def batch_size(batch: Batch) -> int:
    """The leading dimension shared by every array in ``batch``; raises if they disagree."""
    sizes = [x.shape[0] for x in jax.tree.leaves(batch)]  # on every step: keep it cheap
    if not sizes:
        raise ValueError("The batch holds no arrays.")
    if min(sizes) != max(sizes):
        named = {jax.tree_util.keystr(p): x.shape[0] for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]}
        raise ValueError(f"Every array in a batch needs the same leading (batch) dimension, got {named}.")
    return sizes[0]


class LossInputError(ValueError):
    """The loss could not run on the batch it was given: a key it reads is missing, or an array does not fit.

    Raised at the first call of a step, while it is traced, so the check costs the steps
    that run nothing; what the loss (or JAX) raised is its ``__cause__``. A step names its
    strategy, the batch's arrays and the parameters' weights in the message.
    """

    def __init__(self, message: str, *, missing_key: bool = False):
        super().__init__(message)
        self.missing_key = missing_key


def guard_inputs(fn: Callable) -> Callable:
    """``fn(params, batch, ...)``, raising a :class:`LossInputError` when it cannot read or fit the batch.

    Turns a ``KeyError`` for a key the batch lacks, and a ``TypeError`` or ``ValueError``
    (JAX's for shapes or dtypes that do not fit, or the loss's own), into one; JAX's
    tracer errors (a Python ``if`` on a traced value, ...) pass through unchanged. Under
    ``jit`` it acts only while the step is traced.

    >>> try:
    ...     guard_inputs(lambda params, batch: batch["x"])(None, {"image": 0})
    ... except LossInputError as err:
    ...     print(err)
    The loss reads batch['x'], but the batch has no key 'x' (its keys: 'image').
    """

    @functools.wraps(fn)
    def guarded(params, batch, *args, **kwargs):
        try:
            return fn(params, batch, *args, **kwargs)
        except LossInputError:
            raise
        except KeyError as err:
            key = err.args[0] if len(err.args) == 1 else None
            if not _lacks(batch, key):
                raise
            raise LossInputError(
                f"The loss reads batch[{key!r}], but the batch has no key {key!r} (its keys: {_keys(batch)}).",
                missing_key=True,
            ) from err
        except (TypeError, ValueError) as err:
            if isinstance(err, jax.errors.JAXTypeError):
                raise
            raise LossInputError(f"The loss failed on this batch: {type(err).__name__}: {str(err).strip()}") from err

    return guarded


def _lacks(batch: Any, key: Any) -> bool:
    """Whether ``batch`` is a mapping without ``key``."""
    try:
        return isinstance(batch, Mapping) and key not in batch
    except TypeError:  # an unhashable key
        return False


def _keys(batch: Mapping) -> str:
    return ", ".join(map(repr, batch)) or "none"


def _loss_with_aux(loss_fn: LossFn) -> Callable[..., tuple[jax.Array, tuple[dict, PyTree]]]:
    """``loss_fn`` as ``(params, batch, **extras) -> (loss, (aux, new_model_state))``, whatever it returns.

    Without ``model_state`` among the extras, ``loss_fn`` returns ``loss`` or
    ``(loss, aux)``; with it, ``(loss, aux, new_model_state)``. A batch the loss cannot
    read or fit raises a :class:`LossInputError` (see :func:`guard_inputs`).
    """
    loss_fn = guard_inputs(loss_fn)

    def wrapped(params, batch, **extras):
        out = loss_fn(params, batch, **extras)
        if "model_state" in extras:
            if not (isinstance(out, tuple) and len(out) == 3):
                raise ValueError(
                    "The state carries model state (model_state=...), so the loss must return "
                    "(loss, aux, new_model_state); pk.models.classifier_loss does."
                )
            loss, aux, new_state = out
            return loss, (aux, new_state)
        loss, aux = out if isinstance(out, tuple) else (out, {})
        return loss, (aux, None)

    return wrapped


@runtime_checkable
class StrategyProtocol(Protocol):
    """Every method and attribute the tools call on a strategy.

    - ``devices``, ``num_replicas``: the devices it uses, and how many slices the global batch is cut into;
    - ``init(params, tx, opt_state=None, *, model_state=None, rng=None)``: a placed :class:`TrainState`;
    - ``step(loss_fn)``: a compiled :class:`Step`, ``state, metrics = step(state, batch)``;
    - ``place_batch(batch)``: the global host batch, placed as the step takes it;
    - ``unreplicate(tree)``: one host copy; ``logical_shape(leaf)``: a leaf's single-device shape;
    - ``describe(state)``: where every leaf lives;
    - ``traffic(loss_fn, state, batch)``, ``expected_collectives(sizes)``, ``traffic_pattern``:
      the bytes one step moves, the collectives its formulas expect, and the pattern
      (:class:`parallelkit.traffic.TopologyModel`) its traffic follows;
    - ``checkpoint_refusal()``: why a checkpoint could not resume its run exactly (None: it can).
    """

    devices: Sequence[jax.Device]
    traffic_pattern: str

    @property
    def num_replicas(self) -> int: ...

    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState: ...

    def step(self, loss_fn: LossFn) -> Step: ...

    def place_batch(self, batch: Batch) -> Any: ...

    def unreplicate(self, tree: PyTree) -> PyTree: ...

    def logical_shape(self, leaf: jax.Array) -> tuple[int, ...]: ...

    def describe(self, state: PyTree) -> list[LeafPlacement]: ...

    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic: ...

    def expected_collectives(self, sizes: Sizes) -> Sequence[ExpectedCollective] | None: ...

    def checkpoint_refusal(self) -> str | None: ...
