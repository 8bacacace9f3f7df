"""The training state: parameters, optimizer state, step count; optionally a PRNG key, model state and loss scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from .types import PyTree


@struct.dataclass(kw_only=True)
class TrainState:
    """Parameters, optimizer state and step count; the optimizer rides along, static.

    Three optional parts belong to the step as well:

    - ``rng``: a PRNG key, split every step; the loss gets a fresh key as ``rng=``
      (for dropout). Under ``jax.jit`` with shardings the key draws randomness for the
      *global* batch, exactly as on one device; replicas that compute on their own
      (``pmap``) fold their replica index into it, so each draws its own.
    - ``model_state``: mutable model state such as BatchNorm statistics; the loss gets
      it as ``model_state=`` and returns ``(loss, aux, new_model_state)``;
    - ``loss_scale``: a dynamic loss scale (:class:`~parallelkit.core.precision.LossScaleState`),
      added by the first step of ``strategy.step(loss_fn, precision=pk.Precision.fp16())``
      and None otherwise (:mod:`parallelkit.core.precision`).
    """

    # The leaves come in this order (the optimizer state, the parameters, the counter), as in a dict with these
    # keys: measured, a pmap step on simulated CPU devices whose state held the counter or the parameters first
    # took about 20 us longer (benchmarks/README.md, overhead.py). Keyword-only: a positional call is an error.
    opt_state: PyTree
    params: PyTree
    step: jax.Array
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    rng: jax.Array | None = None
    model_state: PyTree = None
    loss_scale: PyTree = None

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
    params, opt_state, model_state, rng = jax.tree.map(  # copies, made without compiling a copy program
        lambda x: jax.device_put(x, may_alias=False), (params, opt_state, model_state, prng_key(rng))
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
