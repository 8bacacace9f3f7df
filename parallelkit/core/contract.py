"""The contracts of the loss and the batch: what a step trains on, and the clear errors when it cannot.

A loss is ``loss_fn(params, batch) -> loss`` or ``(loss, aux)`` (with model state:
``(loss, aux, new_model_state)``); a batch is a mapping of arrays sharing their leading
(batch) axis, the *global* batch as host arrays, its loss the mean over its examples.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .partition import path_label
from .types import Batch as Batch
from .types import LossFn as LossFn
from .types import Metrics as Metrics
from .types import PyTree as PyTree

if TYPE_CHECKING:
    from .protocol import StrategyProtocol as Strategy


def batch_size(batch: Batch) -> int:
    """The leading dimension shared by every array in ``batch``; raises if they disagree or one is a scalar."""
    try:
        sizes = [x.shape[0] for x in jax.tree.leaves(batch)]  # on every step: keep it cheap
    except (IndexError, AttributeError):
        raise ValueError(_no_batch_axis(batch)) from None
    if not sizes:
        raise ValueError("The batch holds no arrays.")
    if min(sizes) != max(sizes):
        named = {jax.tree_util.keystr(p): x.shape[0] for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]}
        raise ValueError(f"Every array in a batch needs the same leading (batch) dimension, got {named}.")
    return sizes[0]


def tree_bytes(tree: PyTree) -> int:
    """Total bytes of ``tree``'s leaves: arrays, ``jax.ShapeDtypeStruct`` shapes, Python numbers (as NumPy reads them).

    For a parameter tree, what one full gradient all-reduce carries.

    >>> tree_bytes({"w": np.zeros((2, 3), np.float32), "b": jax.ShapeDtypeStruct((3,), jnp.bfloat16), "n": 1})
    38
    """
    leaves = jax.tree.leaves(tree)
    return sum(x.size * x.dtype.itemsize if hasattr(x, "dtype") else np.asarray(x).nbytes for x in leaves)


def _no_batch_axis(batch: Batch) -> str:
    """The message for a batch holding a leaf with no leading axis: the first such leaf, by its path."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    found = next((f"batch{jax.tree_util.keystr(p)} = {x!r}" for p, x in leaves if np.ndim(x) == 0), "an array")
    return (
        f"The batch holds {found}, which has no leading (batch) axis: every array of a batch holds one row per "
        "example, so the strategy can split it. Give it one value per example (np.full((batch_size,), value)), or "
        "keep a constant out of the batch and close over it in the loss."
    )


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
            if not _read_from_batch(fn, key, params, batch, *args, **kwargs):
                err.add_note(
                    f"The loss raised this KeyError itself: it did not come from reading the batch (whose keys are "
                    f"{_keys(batch)}). Check the dictionary the loss reads {key!r} from."
                )
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


class _Reads(dict):
    """A copy of a batch that remembers the keys read from it and missing."""

    def __init__(self, batch: Mapping):
        super().__init__(batch)
        self.missed: list = []

    def __getitem__(self, key):
        if key not in self:
            self.missed.append(key)
        return super().__getitem__(key)


def _read_from_batch(fn: Callable, key: Any, params: Any, batch: Mapping, *args, **kwargs) -> bool:
    """Whether ``fn``'s ``KeyError`` for ``key`` came from reading the batch: run it again on a batch that
    remembers the missing keys read from it (only on this error's path, while the step is traced)."""
    reads = _Reads(batch)
    try:
        fn(params, reads, *args, **kwargs)
    except Exception:  # the same KeyError, or an error a dict subclass causes: judged by what was read
        pass
    return key in reads.missed


def _lacks(batch: Any, key: Any) -> bool:
    """Whether ``batch`` is a mapping without ``key``."""
    try:
        return isinstance(batch, Mapping) and key not in batch
    except TypeError:  # an unhashable key
        return False


def _keys(batch: Mapping) -> str:
    return ", ".join(map(repr, batch)) or "none"


def loss_with_aux(loss_fn: LossFn) -> Callable[..., tuple[jax.Array, tuple[dict, PyTree]]]:
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
            return _check_loss_value(loss), (aux, new_state)
        loss, aux = out if isinstance(out, tuple) else (out, {})
        return _check_loss_value(loss), (aux, None)

    return wrapped


def _check_loss_value(loss: Any) -> Any:
    """``loss`` if it is one floating number; a clear error for a vector of losses or an integer (while tracing)."""
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape != ():
        raise ValueError(
            f"The loss returned an array of shape {shape}, but a step differentiates one number: return the mean "
            "over the batch (for example per_example.mean()), with any other values as metrics in (loss, aux)."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"The loss returned an integer ({dtype}), which has no gradient: compute it in floating point "
            "(for example loss.astype(jnp.float32), from float predictions)."
        )
    return loss


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
    per-step path as short as a hand-written one; it raises the clear error. On an
    Explicit mesh JAX refuses a batch with no leading axis with a bare ``AssertionError``
    instead of a ``ValueError``: both get the same check.
    """
    try:
        return jax.device_put(batch, sharding)
    except (ValueError, AssertionError):
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
