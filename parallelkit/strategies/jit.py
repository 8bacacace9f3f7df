"""Strategies that are one ``jax.jit`` with shardings (the style once called pjit).

The training step is the single-device step; only the shardings of its inputs and
outputs change. The compiler (XLA's SPMD partitioner) then splits the work and
inserts whatever communication the shardings imply, such as the gradient all-reduce.
"""

from __future__ import annotations

import functools
from functools import cached_property

import jax
import optax
from jax.sharding import Sharding

from .base import Batch, LossFn, PyTree, Step, Strategy, TrainState, create_state, put_batch, train_step


class JitStrategy(Strategy):
    """A strategy defined by two shardings: one for the state, one for the batch.

    Subclasses build them once (``cached_property``): a sharding made anew on every
    step costs measurable time in ``jax.device_put``.
    """

    @cached_property
    def state_sharding(self) -> Sharding:
        """Where parameters, optimizer state and metrics live (a prefix of the state tree)."""
        raise NotImplementedError

    @cached_property
    def batch_sharding(self) -> Sharding:
        """How the global batch is laid over the devices."""
        raise NotImplementedError

    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        return jax.device_put(
            create_state(params, tx, opt_state, model_state=model_state, rng=rng), self.state_sharding
        )

    def place_batch(self, batch: Batch) -> Batch:
        """Send each slice of the global batch to its device (a clear error when it does not split)."""
        return put_batch(batch, self.batch_sharding, self.num_replicas)

    def step(self, loss_fn: LossFn) -> Step:
        state, batch = self.state_sharding, self.batch_sharding
        fn = jax.jit(
            functools.partial(train_step, loss_fn),
            in_shardings=(state, batch),
            out_shardings=(state, state),
            donate_argnums=0,  # the old state's buffers are reused for the new one
        )
        return Step(fn, self.place_batch, self)
