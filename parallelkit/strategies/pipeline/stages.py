"""A model as a list of layers, cut into stages, and the compiled programs of one stage.

References:
  Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism", 2019:
  re-materialisation, each stage keeping only its input between the passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.contract import loss_with_aux
from ...core.precision import Precision, all_finite, cast_floating, select, unscale
from ...core.step import unless_not_finite
from ...core.types import DATA, Batch, PyTree

Layer = Callable[[PyTree, Any], Any]
HeadLoss = Callable[[Any, Batch], Any]  # -> loss, or (loss, aux dict)


def sequential_loss(layers: Sequence[Layer], head_loss: HeadLoss) -> Callable[[list, Batch], Any]:
    """The single-device ``loss_fn(params, batch)`` of a layer list: every layer in turn, then ``head_loss``.

    ``params`` is the list of per-layer parameters. This is what :class:`~parallelkit.Pipeline`
    computes, spread over stages; give it to :class:`~parallelkit.SingleDevice` (or any
    other strategy) to train the same model without a pipeline.

    >>> loss_fn = sequential_loss([lambda p, b: b["x"] * p, lambda p, x: x + p], lambda y, b: (y - b["y"]) ** 2)
    >>> float(loss_fn([2.0, 1.0], {"x": 3.0, "y": 4.0}))
    9.0
    """
    layers = tuple(layers)

    def loss_fn(params: list, batch: Batch):
        return head_loss(run_layers(layers, params, batch), batch)

    return loss_fn


def run_layers(layers: Sequence[Layer], params: Sequence[PyTree], x: Any) -> Any:
    """``x`` through each layer in turn."""
    for apply, layer_params in zip(layers, params, strict=True):
        x = apply(layer_params, x)
    return x


def split_layers(num_layers: int, stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """Which layers each stage runs: ``layers_per_stage`` if given, else as even as possible (earlier stages first).

    >>> split_layers(5, 2)
    [range(0, 3), range(3, 5)]

    Raises:
      ValueError: more stages than layers, or ``layers_per_stage`` that does not cover every
        layer with ``stages`` counts of at least 1.
    """
    if stages > num_layers:
        raise ValueError(
            f"A pipeline of {stages} stages needs at least {stages} layers, but the model has {num_layers}. "
            f"Use at most {num_layers} stages, or split the model into more layers."
        )
    if layers_per_stage is None:
        layers_per_stage = [num_layers // stages + (s < num_layers % stages) for s in range(stages)]
    counts = list(layers_per_stage)
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(
            f"layers_per_stage={counts} must give each of the {stages} stages at least one layer "
            f"and add up to the model's {num_layers} layers."
        )
    bounds = [sum(counts[:s]) for s in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def _stage_output(layers, head_loss, first, last, params, x, batch, precision=None, within=None):
    """The stage's layers on its input (the batch on the first stage); on the last stage, ``(loss, (aux, _))``.

    With ``precision`` the parameters, the input and the batch's floating arrays are cast to its
    compute dtype (inside the differentiated function, so the parameter gradients come back in
    the parameters' dtype), and the loss and metrics to float32.
    """
    if precision is not None:
        params, x, batch = cast_floating((params, x, batch), precision.compute_dtype)
    with contextlib.nullcontext() if within is None else within.tracing():  # a stage SPMD over its own devices
        y = run_layers(layers, params, batch if first else x)
    if not last:
        return y
    out = loss_with_aux(head_loss)(y, batch)
    return out if precision is None else cast_floating(out, jnp.float32)


_STATIC = ("layers", "head_loss", "first", "last", "precision", "within")


@partial(jax.jit, static_argnames=_STATIC)
def forward(params, x, batch, *, layers, head_loss, first, last, precision=None, within=None):
    """One microbatch through the stage: its output for the next stage, or ``(loss, aux)`` on the last.

    ``within``: the stage's :class:`~parallelkit.Parallel` when the stage is SPMD over its own devices (its
    rules are active while the stage's layers trace); None otherwise. Every program here takes it.
    """
    out = _stage_output(layers, head_loss, first, last, params, x, batch, precision, within)
    return (out[0], out[1][0]) if last else out


def _pullback(params, x, batch, cotangent, *, wrt, layers, head_loss, first, last, precision, within=None):
    """The stage's forward pass recomputed under :func:`jax.vjp`: ``(parameter gradients, input gradient)``.

    ``wrt`` says which: ``"both"``, ``"params"`` (the input's gradient None) or ``"input"``
    (the parameters' None). The first stage's input is the batch: it has no input gradient.
    """

    def output(p, inputs):
        out = _stage_output(layers, head_loss, first, last, p, inputs, batch, precision, within)
        return out[0] if last else out

    if wrt == "input":
        if first:
            return None, None
        _, pullback = jax.vjp(lambda inputs: output(params, inputs), x)
        return None, pullback(cotangent)[0]
    if first or wrt == "params":
        _, pullback = jax.vjp(lambda p: output(p, x), params)
        return pullback(cotangent)[0], None
    _, pullback = jax.vjp(output, params, x)
    return pullback(cotangent)


_BACKWARD = (*_STATIC, "wrt")


@partial(jax.jit, static_argnames=_BACKWARD, donate_argnames=("grads",))
def backward(
    params, x, batch, cotangent, grads, *, layers, head_loss, first, last, precision=None, wrt="both", within=None
):
    """Recompute the stage's forward pass under ``jax.vjp``; return ``(grads + this microbatch's, input gradient)``.

    ``cotangent`` is the gradient of the step's loss with respect to the stage's output:
    from the stage below, or on the last stage ``1 / microbatches`` (the step's loss is the
    mean of the microbatches' losses), times the loss scale where there is one. The first
    stage returns no input gradient (its input is the batch). With ``wrt="params"`` it is a
    zero-bubble schedule's weight pass: the parameters' gradients only (no input gradient);
    :func:`backward_input` is the other half.
    """
    statics = dict(layers=layers, head_loss=head_loss, first=first, last=last, precision=precision, within=within)
    param_grads, input_grad = _pullback(params, x, batch, cotangent, wrt=wrt, **statics)
    return jax.tree.map(jnp.add, grads, param_grads), input_grad


@partial(jax.jit, static_argnames=_STATIC)
def backward_input(params, x, batch, cotangent, *, layers, head_loss, first, last, precision=None, within=None):
    """A zero-bubble schedule's backward pass: the gradient of the stage's input alone (None on the first
    stage), which the stage above waits for; the parameters' gradients wait for the weight pass."""
    statics = dict(layers=layers, head_loss=head_loss, first=first, last=last, precision=precision, within=within)
    return _pullback(params, x, batch, cotangent, wrt="input", **statics)[1]


@partial(jax.jit, static_argnames=(*_BACKWARD, "mesh"), donate_argnames=("grads",))
def backward_unreduced(
    params, x, batch, cotangent, grads, *, mesh, layers, head_loss, first, last, precision=None, wrt="both", within=None
):
    """:func:`backward` on each of the stage's ``data`` devices alone, with no collective.

    Each device takes its slice of the microbatch and adds its slice's parameter gradients
    to its own running sum: ``grads`` has a leading axis of ``data``, one row per device, split
    over the stage's ``mesh``. The rows add up to the microbatches' gradients;
    :func:`reduce_unreduced` all-reduces them once a step. On the last stage each device's
    loss is the mean over its slice, so its seed is ``cotangent / data``.
    """
    statics = dict(layers=layers, head_loss=head_loss, first=first, last=last, precision=precision)

    def local(params, x, batch, cotangent, grads):
        # Per-device ("varying") parameters: else autodiff would transpose their broadcast into a psum.
        params = jax.tree.map(lambda p: jax.lax.pcast(p, DATA, to="varying"), params)
        if last:
            cotangent = jax.lax.pcast(cotangent / jax.lax.axis_size(DATA), DATA, to="varying")
        param_grads, input_grad = _pullback(params, x, batch, cotangent, wrt=wrt, **statics)
        return jax.tree.map(lambda g, new: g + new[None], grads, param_grads), input_grad

    split, whole = P(DATA), P()
    specs = (whole, split, split, whole if last else split, split)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(split, split))(params, x, batch, cotangent, grads)


@partial(jax.jit, static_argnames=("where",))
def reduce_unreduced(grads, *, where: NamedSharding):
    """The rows of :func:`backward_unreduced`'s running sums added up, a copy on each of the stage's devices
    (``where``): one all-reduce of the stage's gradients."""
    return jax.tree.map(lambda g: jax.lax.with_sharding_constraint(g.sum(axis=0), where), grads)


@partial(jax.jit, donate_argnums=0)
def next_step(step: jax.Array, loss: jax.Array | None = None) -> jax.Array:
    """The step counter plus one (unless a ``loss`` is given and not finite); the old counter is donated, which
    marks the old state as consumed."""
    return step + 1 if loss is None else jnp.where(jnp.isfinite(loss), step + 1, step)


@partial(jax.jit, static_argnames=("tx", "keep"), donate_argnames=("params", "opt_state"))
def update(params, opt_state, grads, finite=None, loss=None, *, tx: optax.GradientTransformation, keep=None):
    """One optimizer update of a stage's parameters from its summed gradients; with ``finite`` (every stage's
    gradients finite, under a loss scale), applied only where it is True, else the stage as it was. With ``keep``
    (:func:`~parallelkit.core.step.keep_finite_choice`'s answer), the stage as it was when ``loss`` is not finite.
    """

    def updated():
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt_state)
        return new if finite is None else select(finite, new, (params, opt_state))

    return unless_not_finite(keep, loss, updated, lambda: (params, opt_state))


@partial(jax.jit, static_argnames=("precision",))
def unscaled(grads, scale, *, precision: Precision):
    """A stage's summed gradients divided by the loss scale (float32), and whether they are all finite."""
    grads = unscale(grads, precision, scale)
    return grads, all_finite(grads)
