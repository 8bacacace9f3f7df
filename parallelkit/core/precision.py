"""Mixed precision and loss scaling: ``strategy.step(loss_fn, precision=pk.Precision.bf16())``.

Holds the policy (:class:`Precision`), the loss scale's state (:class:`LossScaleState`) and the pure functions a
step uses: casts, the scaled loss, unscaling, the finite check and the next scale."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .types import PyTree, is_number

_DEFAULT_PERIOD = 2000  # finite steps in a row before a dynamic scale doubles (jmp, Keras)
_INITIAL_SCALE = 2.0**15  # where a dynamic scale starts (Keras's default)
_FACTOR = 2.0  # a dynamic scale doubles or halves
MIN_SCALE = 1.0  # a dynamic scale never halves below this (jmp's min_loss_scale)

_FLOATING = ("float16", "bfloat16", "float32", "float64")
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # a scale is float32: larger is infinite


class PrecisionWarning(UserWarning):
    """A precision policy that runs, but is unlikely to train as meant (float16 without a loss scale)."""


def _floating_dtype(name: Any, what: str) -> jnp.dtype:
    """``name`` as one of the floating dtypes a policy can train in; a clear error for any other.

    ``None`` is refused (``jnp.dtype(None)`` is float64), and so are the float8 formats (no
    update can be kept in them) and float64 while JAX's 64-bit mode is off (JAX would compute
    in float32 without a word).

    >>> _floating_dtype("bfloat16", "compute")
    dtype(bfloat16)
    """
    try:
        dtype = None if name is None else jnp.dtype(name)
    except TypeError as err:
        raise ValueError(f"Precision({what}={name!r}): unknown dtype; use one of {_FLOATING}.") from err
    if dtype is None or dtype.name not in _FLOATING:
        kind = "not a dtype" if dtype is None else f"{dtype} is not a floating dtype a step can train in"
        raise ValueError(f"Precision({what}={name!r}): {kind}; use one of {_FLOATING}.")
    if dtype.name == "float64" and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"Precision({what}='float64'): JAX's 64-bit mode is off, so it would compute in float32. Turn it on "
            "first (jax.config.update('jax_enable_x64', True)) or use 'float32'."
        )
    return dtype


@struct.dataclass
class LossScaleState:
    """A dynamic loss scale: the scale (float32) and how many finite steps in a row ended with it (int32)."""

    scale: jax.Array
    good_steps: jax.Array


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy for a training step: master copy in ``params``, the passes in ``compute``.

    Args:
      params: the dtype of parameters and optimizer state (and of the gradients, before they meet).
      compute: the dtype of the forward and backward pass (parameters and floating batch arrays cast to it).
      loss_scale: None (no scaling), ``"dynamic"``, or a fixed positive number; with one, a step whose
        gradients are not all finite is skipped.
      period: a dynamic scale doubles after this many finite steps in a row.
      initial_scale: where a dynamic scale starts.

    >>> Precision.bf16()
    Precision(params='float32', compute='bfloat16', loss_scale=None, period=2000, initial_scale=32768.0)
    >>> Precision.fp16(period=100).dynamic
    True

    Raises:
      ValueError: a dtype other than float16, bfloat16, float32 (and float64 in JAX's 64-bit mode), a
        loss scale that is neither ``"dynamic"`` nor a number > 0 that float32 holds, a ``period`` or
        ``initial_scale`` out of range, or float16 parameters with a loss scale (keep them in float32).

    Warns:
      PrecisionWarning: float16 compute without a loss scale (gradients underflow to zero).
    """

    params: str = "float32"
    compute: str = "bfloat16"
    loss_scale: float | str | None = None
    period: int = _DEFAULT_PERIOD
    initial_scale: float = _INITIAL_SCALE

    def __post_init__(self) -> None:
        params, compute = _floating_dtype(self.params, "params"), _floating_dtype(self.compute, "compute")
        object.__setattr__(self, "params", params.name)
        object.__setattr__(self, "compute", compute.name)
        scale = self.loss_scale
        if not (scale is None or (isinstance(scale, str) and scale == "dynamic") or _positive(scale)):
            raise ValueError(
                f"Precision(loss_scale={scale!r}): use 'dynamic', a fixed number > 0 that float32 holds (such as "
                "1024.0), or None."
            )
        if _positive(scale):
            object.__setattr__(self, "loss_scale", float(scale))  # a NumPy scalar is a number too
        if isinstance(self.period, bool) or not isinstance(self.period, int | np.integer) or self.period < 1:
            raise ValueError(f"Precision(period={self.period!r}): the finite steps before doubling, an integer >= 1.")
        object.__setattr__(self, "period", int(self.period))
        if not _positive(self.initial_scale):
            raise ValueError(
                f"Precision(initial_scale={self.initial_scale!r}): use a finite number > 0 that float32 holds "
                f"(at most {_FLOAT32_MAX:.4g}; the default is {_INITIAL_SCALE:g})."
            )
        object.__setattr__(self, "initial_scale", float(self.initial_scale))
        if params.name == "float16" and scale is not None:
            raise ValueError(
                "Precision(params='float16', loss_scale=...): a loss scale protects float16 gradients, but float16 "
                "master weights and optimizer state still overflow or underflow in the update (Adam's second "
                "moment, eps=1e-8, is 0 in float16), and a step whose update is not finite would be applied. "
                "Keep the parameters in float32 with pk.Precision.fp16(), as PyTorch's GradScaler asks too."
            )
        if compute.name == "float16" and scale is None:
            warnings.warn(
                "Precision(compute='float16') without a loss scale: small gradients underflow to 0 in float16 "
                "(below about 6e-8), and the step trains on zeros without a word. Use pk.Precision.fp16() "
                "(a dynamic loss scale), or bfloat16, which needs none.",
                PrecisionWarning,
                stacklevel=3,
            )

    @classmethod
    def bf16(cls) -> Precision:
        """float32 master copy, bfloat16 passes, no loss scale (bfloat16 has float32's exponent range)."""
        return cls("float32", "bfloat16")

    @classmethod
    def fp16(cls, period: int = _DEFAULT_PERIOD, initial_scale: float = _INITIAL_SCALE) -> Precision:
        """float32 master copy, float16 passes, dynamic loss scaling (float16 overflows past 65504)."""
        return cls("float32", "float16", "dynamic", period, initial_scale)

    @property
    def param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.params)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute)

    @property
    def dynamic(self) -> bool:
        """Whether the scale changes from step to step (and so lives in the state)."""
        return self.loss_scale == "dynamic"

    def initial_state(self) -> LossScaleState | None:
        """A fresh dynamic scale (host arrays), or None when the scale is fixed or absent."""
        if not self.dynamic:
            return None
        return LossScaleState(np.float32(self.initial_scale), np.int32(0))

    def scale(self, state: LossScaleState | None) -> jax.Array | None:
        """The scale this step multiplies the loss by: fixed, or the dynamic ``state``'s (None: no scaling,
        or a dynamic scale without its state, as on the parameter-server shards that do not keep it)."""
        if self.loss_scale is None or (self.dynamic and state is None):
            return None
        return state.scale if self.dynamic else jnp.float32(self.loss_scale)


def _positive(x: Any) -> bool:
    """A number (NumPy scalars too) > 0 that float32 holds."""
    return is_number(x) and math.isfinite(x) and 0 < x <= _FLOAT32_MAX


def cast_floating(tree: PyTree, dtype: jnp.dtype) -> PyTree:
    """Every floating array of ``tree`` cast to ``dtype``; integers (labels, tokens) as they are.

    >>> cast_floating({"x": jnp.ones(2), "y": jnp.arange(2)}, jnp.bfloat16)["x"].dtype
    dtype(bfloat16)
    """

    return jax.tree.map(lambda x: x.astype(dtype) if is_floating(x) else x, tree)


def is_floating(x: Any) -> bool:
    """Whether ``x`` (an array, a scalar or a dtype) is floating point."""
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def check_param_dtypes(params: PyTree, precision: Precision) -> None:
    """Raise unless every floating parameter is in ``precision.params`` dtype (it runs while tracing)."""
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = jnp.result_type(x)
        if is_floating(dtype) and dtype != precision.param_dtype:
            raise ValueError(
                f"The parameter {jax.tree_util.keystr(path)} is {dtype}, but the precision policy keeps parameters "
                f"in {precision.params}: initialise the state with {precision.params} parameters, or pass "
                f"pk.Precision(params={str(dtype)!r}, ...)."
            )


def mixed_loss(loss: Callable, precision: Precision, scale: jax.Array | None) -> Callable:
    """``loss(params, batch, **extras) -> (loss, (aux, model_state))`` under ``precision``.

    The result is ``(float32 loss x scale, ((float32 loss, float32 aux), model_state))``:
    differentiated, its gradients are in the parameters' own dtype and scaled by ``scale``.
    The model state comes back in the dtypes it went in with.
    """

    def wrapped(params, batch, **extras):
        compute = precision.compute_dtype
        value, (aux, new_model_state) = loss(cast_floating(params, compute), cast_floating(batch, compute), **extras)
        value, aux = cast_floating((value, aux), jnp.float32)
        if new_model_state is not None and extras.get("model_state") is not None:
            new_model_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_model_state, extras["model_state"])
        scaled = value if scale is None else value * scale
        return scaled, ((value, aux), new_model_state)

    return wrapped


def unscale(grads: PyTree, precision: Precision, scale: jax.Array | None) -> PyTree:
    """The gradients in ``params`` dtype, divided by the scale (in float32)."""
    grads = cast_floating(grads, precision.param_dtype)
    if scale is None:
        return grads
    return jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)


def all_finite(tree: PyTree) -> jax.Array:
    """One boolean: whether every element of every array of ``tree`` is finite.

    >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def next_scale(precision: Precision, state: LossScaleState | None, finite: jax.Array) -> LossScaleState | None:
    """The dynamic scale after a step: halved (not below ``MIN_SCALE``) when ``finite`` is False,
    doubled after ``period`` finite steps in a row (while the doubled scale is finite)."""
    if state is None:
        return None
    good = state.good_steps + 1
    grow = good >= precision.period
    doubled = state.scale * _FACTOR
    grown = jnp.where(grow & jnp.isfinite(doubled), doubled, state.scale)
    scale = jnp.where(finite, grown, jnp.maximum(state.scale / _FACTOR, MIN_SCALE))
    good_steps = jnp.where(finite & ~grow, good, 0).astype(state.good_steps.dtype)
    return LossScaleState(scale.astype(state.scale.dtype), good_steps)


def select(finite: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """``new`` where ``finite``, else ``old``, leaf by leaf (a skipped update)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def guarded(precision: Precision | None, old: Any, new: Any, finite: jax.Array | None) -> tuple[Any, dict]:
    """The state after an update (``new``; ``old``: the one before it), skipped unless ``finite``
    (docs/memory.md), and the metrics the loss scale adds; without a loss scale, ``new`` as it is and no metrics."""
    if precision is None or precision.loss_scale is None:
        return new, {}
    params, opt_state, model_state, rng = select(finite, (new.params, new.opt_state, new.model_state, new.rng),
                                                 (old.params, old.opt_state, old.model_state, old.rng))  # fmt: skip
    state = new.replace(params=params, opt_state=opt_state, model_state=model_state, rng=rng,
                        loss_scale=next_scale(precision, old.loss_scale, finite))  # fmt: skip
    return state, {"loss_scale": precision.scale(old.loss_scale), "grads_finite": finite}


def with_loss_scale(state: Any, precision: Precision | None) -> Any:
    """``state`` with a fresh dynamic scale where ``precision`` has one and the state does not yet.

    The scale is placed where the step counter lives, in its shape (one copy a device where
    the strategy stacks its state, as ``pmap`` does), so that every strategy's step takes it
    as it takes the counter. A state that already holds one passes through unchanged.
    """
    if precision is None or not precision.dynamic or state.loss_scale is not None:
        return state
    step = state.step
    fresh = jax.tree.map(
        lambda x: jax.device_put(np.broadcast_to(x, (*step.shape, *np.shape(x))), step.sharding),
        precision.initial_state(),
    )
    return state.replace(loss_scale=fresh)


def check_precision(precision: Any) -> Precision | None:
    """``precision`` if it is a :class:`Precision` or None; a clear error otherwise."""
    if precision is not None and not isinstance(precision, Precision):
        raise TypeError(
            f"precision={precision!r}: pass a pk.Precision (for example pk.Precision.bf16() or "
            "pk.Precision.fp16()), or None for the parameters' own dtype."
        )
    return precision
