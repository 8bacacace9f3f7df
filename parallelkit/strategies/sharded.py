"""Strategies whose state is split leaf by leaf over a mesh: how :class:`~parallelkit.strategies.spmd.SPMD` works.

Each such strategy (SPMD and its presets: tensor, fully sharded, hybrid) owns one mesh
(:func:`parallelkit.core.mesh.make_mesh`) and a rule for every parameter (:mod:`parallelkit.core.partition`).
From them it derives a sharding for every leaf of the state: the parameters by their specs, the optimizer state
like the parameters it belongs to, the step counter replicated. ``init`` builds
the state inside one ``jax.jit`` whose outputs carry those shardings, so each
device only ever receives its own slices (no device holds the whole state first).

The training step is still the single-device step under ``jax.jit``; the shardings
of its inputs and outputs are the per-leaf ones, and XLA's SPMD partitioner inserts
the communication they imply (the all-reduces of tensor parallelism, the
all-gathers and reduce-scatters of fully sharded training).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from ..core import partition
from ..core.contract import Batch, LossFn, PyTree
from ..core.state import TrainState
from ..core.step import train_step

if TYPE_CHECKING:
    from .spmd import SPMD


class _CompiledOnFirstCall:
    """The jitted step, built on the first call with the strategy's shardings for the state it is given.

    The shardings are per leaf, so they depend on the model and the optimizer
    (:meth:`SPMD.state_shardings`); a step is built for one state's structure and
    reused for every later call (the same shapes and shardings: nothing recompiles).
    """

    def __init__(self, strategy: SPMD, loss_fn: LossFn):
        self.strategy, self.loss_fn = strategy, loss_fn
        self.fn: Callable | None = None

    def compiled(self, state: TrainState) -> Callable:
        """The jitted step for ``state``'s layout, built the first time."""
        if self.fn is None:
            shardings = self.strategy.state_shardings(
                state.params, state.tx, model_state=state.model_state, rng=state.rng
            )
            self.fn = jax.jit(
                functools.partial(self._traced(train_step), self.loss_fn, sync=self._gradient_layout(state.params)),
                in_shardings=(shardings, self.strategy.batch_sharding),
                out_shardings=(shardings, self.strategy.replicated),
                donate_argnums=0,
            )
        return self.fn

    def _traced(self, fn: Callable) -> Callable:
        """``fn`` traced inside the strategy's :meth:`SPMD.tracing` context (it runs only while tracing)."""

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with self.strategy.tracing():
                return fn(*args, **kwargs)

        return traced

    def _gradient_layout(self, params: PyTree) -> Callable:
        """The step's ``sync``: constrain the gradients to the strategy's gradient specs, if it has any."""
        specs = self.strategy.gradient_specs(params)
        if specs is None:
            return lambda tree: tree
        where = partition.shardings(self.strategy.mesh, specs)

        def constrain(tree):
            grads, *rest = tree
            return (jax.lax.with_sharding_constraint(grads, where), *rest)

        return constrain

    def __call__(self, state: TrainState, batch: Batch):
        return self.compiled(state)(state, batch)

    def lower(self, state: TrainState, batch: Batch):
        return self.compiled(state).lower(state, batch)
