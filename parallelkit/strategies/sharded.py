"""Strategies whose state is split leaf by leaf over a mesh: the base of tensor, fully sharded and hybrid.

Each such strategy owns one mesh (:func:`parallelkit.mesh.make_mesh`) and a rule for
every parameter (:mod:`parallelkit.partition`). From them it derives a sharding
for every leaf of the state: the parameters by their specs, the optimizer state
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
from functools import cached_property

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import partition
from ..axes import DATA
from .base import Batch, LossFn, PyTree, Step, TrainState, create_state, prng_key, train_step
from .jit import JitStrategy


class ShardedStrategy(JitStrategy):
    """A ``jax.jit`` strategy with one sharding per leaf of the state.

    Subclasses set ``self.mesh`` and implement :meth:`partition_specs`.
    """

    mesh: Mesh

    @property
    def num_replicas(self) -> int:
        """The size of the ``data`` axis: how many slices the global batch is cut into."""
        return self.mesh.shape.get(DATA, 1)

    @cached_property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @cached_property
    def state_sharding(self) -> NamedSharding:
        """What is not a parameter or its optimizer state (the step counter, the metrics): replicated."""
        return self.replicated

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA) if DATA in self.mesh.shape else P())

    def partition_specs(self, params: PyTree) -> PyTree:
        """The ``PartitionSpec`` of every parameter, checked against the mesh and the shapes."""
        raise NotImplementedError

    def optimizer_specs(self, params: PyTree) -> PyTree:
        """The spec the optimizer state of each parameter gets: the parameter's own by default
        (ZeRO stages 1 and 2 shard it where the parameters stay replicated)."""
        return self.partition_specs(params)

    def gradient_specs(self, params: PyTree) -> PyTree | None:
        """Where the gradients must be laid out before the update (None: wherever XLA chooses)."""
        return None

    def state_shardings(self, params: PyTree, tx: optax.GradientTransformation) -> TrainState:
        """A :class:`TrainState` of shardings: the step replicated, parameters by their specs,
        optimizer state by :meth:`optimizer_specs` (a PRNG key and model state, when present, replicated)."""
        specs = self.partition_specs(params)
        opt_specs = partition.state_specs(self.optimizer_specs(params), tx, params)
        return TrainState(
            step=self.replicated,
            params=partition.shardings(self.mesh, specs),
            opt_state=partition.shardings(self.mesh, opt_specs),
            tx=tx,
        )

    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        """Place every leaf directly in its sharding: built in one ``jit``, each device gets only its slices."""
        rng = prng_key(rng)  # a seed would become a traced integer inside jit
        target = self.state_shardings(params, tx).replace(
            rng=None if rng is None else self.replicated,
            model_state=None if model_state is None else jax.tree.map(lambda _: self.replicated, model_state),
        )

        def build(params, opt_state, model_state, rng):
            return create_state(params, tx, opt_state, model_state=model_state, rng=rng)

        return jax.jit(build, out_shardings=target)(params, opt_state, model_state, rng)

    def step(self, loss_fn: LossFn) -> Step:
        return Step(_CompiledOnFirstCall(self, loss_fn), self.place_batch, self)


class _CompiledOnFirstCall:
    """The jitted step, built on the first call from the shardings of the state it is given.

    The shardings are per leaf, so they depend on the model and the optimizer; a
    step is built for one state layout and reused for every later call (the same
    shapes and shardings: nothing recompiles).
    """

    def __init__(self, strategy: ShardedStrategy, loss_fn: LossFn):
        self.strategy, self.loss_fn = strategy, loss_fn
        self.fn: Callable | None = None

    def compiled(self, state: TrainState) -> Callable:
        """The jitted step for ``state``'s layout, built the first time."""
        if self.fn is None:
            shardings = jax.tree.map(lambda x: x.sharding, state)
            self.fn = jax.jit(
                functools.partial(train_step, self.loss_fn, sync=self._gradient_layout(state.params)),
                in_shardings=(shardings, self.strategy.batch_sharding),
                out_shardings=(shardings, self.strategy.replicated),
                donate_argnums=0,
            )
        return self.fn

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
