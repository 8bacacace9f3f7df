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
all-gathers and reduce-scatters of fully sharded training). With ``accumulate=K`` the
step scans ``K`` microbatches (several replicas mapped as an explicit ``vmap`` axis), so the
gradients meet once, after the loop (:mod:`parallelkit.core.accumulate`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import partition
from ..core.accumulate import Accumulation, ReplicaCopies
from ..core.axes import axis_names
from ..core.contract import Batch, LossFn, PyTree
from ..core.precision import Precision
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

    def __init__(self, strategy: SPMD, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None):
        self.strategy, self.loss_fn, self.accumulate, self.precision = strategy, loss_fn, accumulate, precision
        self.fn: Callable | None = None

    def compiled(self, state: TrainState, batch: Batch) -> Callable:
        """The jitted step for ``state``'s and ``batch``'s layouts, built the first time."""
        if self.fn is None:
            shardings = self.strategy.state_shardings(
                state.params, state.tx, model_state=state.model_state, rng=state.rng
            )
            mapping = self._replica_mapping(state.params)
            extra = {} if mapping is None else {"accumulate": mapping}
            if self.precision is not None:
                extra["precision"] = self.precision
            if state.loss_scale is not None:  # a dynamic loss scale, replicated as the step counter is
                replicated = jax.tree.map(lambda _: self.strategy.replicated, state.loss_scale)
                shardings = shardings.replace(loss_scale=replicated)
            self.fn = jax.jit(
                functools.partial(
                    self._traced(train_step), self.loss_fn, sync=self._gradient_layout(state.params), **extra
                ),
                in_shardings=(shardings, self.strategy.batch_shardings(batch)),
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
        place = self._place_gradients(params)
        return lambda tree: (place(tree[0]), *tree[1:])

    def _place_gradients(self, params: PyTree) -> Callable[[PyTree], PyTree]:
        """Lays a tree of gradients out by the strategy's gradient specs (as it is, where it has none)."""
        specs = self.strategy.gradient_specs(params)
        if specs is None:
            return lambda grads: grads
        where = partition.shardings(self.strategy.mesh, specs)
        return lambda grads: jax.lax.with_sharding_constraint(grads, where)

    def _replica_mapping(self, params: PyTree) -> Accumulation | ReplicaCopies | None:
        """How the step maps the replicas: each one's gradients a row of its own, a copy of the
        parameters of its own, or not at all (the compiler's partitioning of the global batch).

        With ``accumulate > 1``, rows (:meth:`_accumulation`), so that the microbatches meet once.
        With a precision whose compute dtype is not the parameters', on several replicas, so that
        each replica's gradients are cast back before they meet: left to itself, XLA's partitioner
        reduces the partial sums of the batch's contraction where that contraction happens, inside
        the backward pass, in the compute dtype where the backend multiplies in it (float16 here).
        Replicas that keep whole gradients get rows; where the gradients are sharded over the batch's
        own axes (ZeRO-2 and 3) rows, tried on ZeRO-3, still left a float16 all-reduce to the
        partitioner, so there each replica differentiates its own copy of the parameters
        (:class:`ReplicaCopies`), whose gradient is cast back before the reduction, leaf by leaf. A
        strategy that cannot map its replicas (:attr:`SPMD.maps_replicas`) gets neither: its reduction
        stays where XLA puts it.
        """
        if self.accumulate > 1:
            return self._accumulation(params)
        casts = self.precision is not None and self.precision.compute_dtype != self.precision.param_dtype
        if not casts or self.strategy.num_replicas == 1 or not self.strategy.maps_replicas:
            return None
        specs = self.strategy.gradient_specs(params)
        batch_axes = set(axis_names(self.strategy.batch_sharding.spec[0]))
        leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        if not any(batch_axes.intersection(*map(axis_names, spec)) for spec in leaves):
            return self._accumulation(params)
        return self._copies(params)

    def _copies(self, params: PyTree) -> ReplicaCopies:
        """One pass, the replicas an explicit axis, each with its own copy of the parameters in the compute dtype."""
        strategy = self.strategy
        axes, rows, micro = self._replica_layout(params)
        return ReplicaCopies(
            strategy.num_replicas,
            axes,
            self.precision.compute_dtype,
            place_rows=lambda batch: jax.lax.with_sharding_constraint(batch, micro),
            place_copies=lambda copies: jax.lax.with_sharding_constraint(copies, rows),
            place_grads=self._place_gradients(params),
            within_replica=strategy.replica_tracing,
        )

    def _replica_layout(self, params: PyTree) -> tuple:
        """(the mesh axes of the replicas; a parameter-shaped row on each; a batch's ``(replicas, ...)`` rows)."""
        mesh, axes = self.strategy.mesh, self.strategy.batch_sharding.spec[0]
        group = set(axis_names(axes))
        rows = partition.shardings(
            mesh,
            jax.tree.map(
                lambda spec: P(axes, *_without(spec, group)),
                self.strategy.partition_specs(params),
                is_leaf=lambda x: isinstance(x, P),
            ),
        )
        return axes, rows, NamedSharding(mesh, P(axes))

    def _accumulation(self, params: PyTree) -> Accumulation:
        """``accumulate`` microbatches with the replicas an explicit axis, each replica's gradients its own row.

        Under ``jit`` with shardings the compiler would all-reduce the gradients of every
        microbatch inside the loop; mapped over the replicas (``vmap`` on the batch's mesh
        axes), each device sums its own row of gradients in the carry, and the mean over
        the rows after the loop is the step's one all-reduce (or reduce-scatter).
        """
        strategy, replicas = self.strategy, self.strategy.num_replicas
        if replicas == 1:
            return Accumulation(self.accumulate)
        axes, rows, _ = self._replica_layout(params)
        micro = NamedSharding(strategy.mesh, P(None, axes))
        return Accumulation(
            self.accumulate,
            replicas,
            axes,
            place_microbatches=lambda batch: jax.lax.with_sharding_constraint(batch, micro),
            place_rows=lambda grads: jax.lax.with_sharding_constraint(grads, rows),
            within_replica=strategy.replica_tracing,
        )

    def __call__(self, state: TrainState, batch: Batch):
        return self.compiled(state, batch)(state, batch)

    def lower(self, state: TrainState, batch: Batch):
        return self.compiled(state, batch).lower(state, batch)


def _without(spec: P, axes: set[str]) -> tuple:
    """``spec``'s entries with ``axes`` taken out (a dimension they alone split becomes replicated).

    >>> _without(P("data", ("data", "model"), None), {"data"})
    (None, 'model', None)
    """
    entries = []
    for entry in spec:
        kept = tuple(a for a in axis_names(entry) if a not in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(entries)
