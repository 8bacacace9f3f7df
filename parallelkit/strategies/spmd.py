"""One SPMD strategy: a mesh with any named axes, and logical axis rules for the batch, activations and parameters.

``jax.jit`` of the single-device step with a ``NamedSharding`` for every leaf
(:mod:`parallelkit.strategies.sharded` explains how): the batch split as the rules
place the logical axis ``batch`` (every array's leading axis; ``batch_axes`` names the other
axes of an array, such as a token axis ``length``, to lay them out too), the parameters by
``param_rules``, and the activations where the model calls
:func:`parallelkit.core.axes.constrain`, which becomes ``with_sharding_constraint`` while
this strategy traces its step. XLA's SPMD partitioner inserts the communication
the shardings imply. :class:`~parallelkit.TensorParallel`,
:class:`~parallelkit.FullySharded`, :class:`~parallelkit.Hybrid`, :class:`~parallelkit.ExpertParallel`
and :class:`~parallelkit.ContextParallel` are presets of it.

>>> import parallelkit as pk
>>> mesh = pk.mesh.make_mesh(jax.devices()[:1], data=1, seq=1)
>>> SPMD(mesh, rules=(("batch", "data"), ("length", "seq")))
SPMD(mesh={'data': 1, 'seq': 1}, rules=(('batch', 'data'), ('length', 'seq')))
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from functools import cached_property

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import partition
from ..core.accumulate import accumulated_placement, check_accumulate
from ..core.axes import DATA, AxisRules, MeshAxes, active_rules, axis_names
from ..core.contract import Batch, LossFn, PyTree, put_batch
from ..core.precision import Precision, check_precision
from ..core.state import TrainState, create_state, prng_key
from ..core.step import Step
from .base import Strategy
from .sharded import _CompiledOnFirstCall

BATCH = "batch"  # the logical name of every batch leaf's leading axis
BATCH_ON_DATA = ((BATCH, DATA),)  # the presets' rules: the batch split over `data`


class SPMD(Strategy):
    """Train over ``mesh`` as ``rules`` say: the batch on the mesh axes of ``batch``, activations as constrained.

    Args:
      mesh: the devices on named axes (:func:`parallelkit.core.mesh.make_mesh`).
      rules: logical axis rules, an :class:`~parallelkit.core.axes.AxisRules` or its
        ``(logical name, mesh axis or axes or None)`` pairs; a name no rule mentions is replicated.
      param_rules: the parameters' layout: ``(regex, spec)`` pairs over parameter paths, where a
        spec is a ``PartitionSpec`` or a tuple of logical names (resolved by ``rules``), or a tree of
        specs (as :func:`parallelkit.core.partition.nnx_specs` gives); every parameter replicated by default.
      batch_axes: the logical names of a batch array's axes, by its key, ``batch`` first:
        ``{"x": ("batch", "length", None)}`` lays the tokens of ``x`` over the mesh axes of
        ``length`` as it is placed; an array not named is split on its leading axis only.

    Raises:
      ValueError: a rule that names a mesh axis ``mesh`` lacks; batch axes that do not start
        with ``batch``; at ``init``, a parameter no rule matches or a spec that does not fit its shape.
    """

    # Whether the step may map the loss over the replicas (``jax.vmap`` with ``spmd_axis_name``), as
    # accumulation does and 16-bit compute does to cast each replica's gradients before they meet. A
    # model whose layers split the batch's own mesh axes in ``jax.shard_map`` (expert parallelism) cannot.
    maps_replicas = True

    def __init__(
        self,
        mesh: Mesh,
        rules: AxisRules | Sequence[tuple[str, MeshAxes]] = (),
        param_rules: partition.Rules | PyTree | None = None,
        *,
        batch_axes: Mapping[str, Sequence[str | None]] | None = None,
    ):
        super().__init__(list(mesh.devices.flat))
        self.mesh = mesh
        self.axis_rules = rules if isinstance(rules, AxisRules) else AxisRules(tuple(rules))
        self.axis_rules.check(mesh)
        self.param_rules = param_rules
        self.batch_axes = {key: tuple(names) for key, names in (batch_axes or {}).items()}
        for key, names in self.batch_axes.items():
            if not names or names[0] != BATCH:
                raise ValueError(
                    f"SPMD(batch_axes={{{key!r}: {names!r}}}): every batch array's first axis is the logical axis "
                    f"{BATCH!r}; name its other axes after it, for example ('batch', 'length')."
                )
        self._batch_layouts: dict[tuple[str, ...], dict[str, NamedSharding]] = {}

    @cached_property
    def num_replicas(self) -> int:
        """How many slices the global batch is cut into: the product of the mesh axes ``batch`` maps to."""
        return math.prod(self.mesh.shape[axis] for axis in axis_names(self.batch_sharding.spec[0]))

    @property
    def fed_replicas(self) -> int:
        """How many slices the batch a caller passes is cut into: all the replicas (it is the global batch)."""
        return self.num_replicas

    @cached_property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @cached_property
    def state_sharding(self) -> NamedSharding:
        """What is not a parameter or its optimizer state (the step counter, the metrics): replicated."""
        return self.replicated

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        """Every batch leaf's leading axis split over the mesh axes the rules give ``batch``."""
        return NamedSharding(self.mesh, self.axis_rules.spec((BATCH,)))

    # The logical axes of a batch array that batch_axes does not name (a preset may name more, as
    # ContextParallel does the tokens' axis).
    unnamed_batch_axes: tuple[str, ...] = (BATCH,)

    @cached_property
    def unnamed_batch_sharding(self) -> NamedSharding:
        """How a batch array that ``batch_axes`` does not name is laid out, by :attr:`unnamed_batch_axes`."""
        return NamedSharding(self.mesh, self.axis_rules.spec(self.unnamed_batch_axes))

    def batch_shardings(self, batch: Batch) -> NamedSharding | dict[str, NamedSharding]:
        """How ``batch`` is laid out: :attr:`unnamed_batch_sharding` for every array, or one sharding per key
        by ``batch_axes`` (made once for each set of keys: a sharding made every step costs time).

        Raises:
          ValueError: ``batch_axes`` given, but ``batch`` is not a mapping of named arrays.
        """
        if not self.batch_axes:
            return self.unnamed_batch_sharding
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"{self!r} lays out batch arrays by name (batch_axes), but the batch is a {type(batch).__name__}: "
                "pass a dict of arrays, as pk.data.batches gives."
            )
        keys = tuple(batch)
        if keys not in self._batch_layouts:
            self._batch_layouts[keys] = {
                key: NamedSharding(self.mesh, self.axis_rules.spec(self.batch_axes.get(key, self.unnamed_batch_axes)))
                for key in keys
            }
        return self._batch_layouts[keys]

    def place_batch(self, batch: Batch) -> Batch:
        """Send each slice of the global batch to its devices (a clear error when it does not split)."""
        return put_batch(batch, self.batch_shardings(batch), self.num_replicas)

    def partition_specs(self, params: PyTree) -> PyTree:
        """The ``PartitionSpec`` of every parameter, checked against the mesh and the shapes."""
        if self.param_rules is None:
            return jax.tree.map(lambda _: P(), params)
        return self.specs_by(params, self.param_rules)

    def specs_by(self, params: PyTree, rules: partition.Rules | PyTree) -> PyTree:
        """The ``PartitionSpec`` ``rules`` give every parameter (logical names resolved), checked against the mesh."""
        specs = partition.param_specs(params, partition.logical_rules(rules, self.axis_rules.spec))
        partition.check_specs(params, specs, self.mesh)
        return specs

    def optimizer_specs(self, params: PyTree) -> PyTree:
        """The spec the optimizer state of each parameter gets: the parameter's own by default
        (ZeRO stages 1 and 2 shard it where the parameters stay replicated)."""
        return self.partition_specs(params)

    def gradient_specs(self, params: PyTree) -> PyTree | None:
        """Where the gradients must be laid out before the update (None: wherever XLA chooses)."""
        return None

    def tracing(self) -> contextlib.AbstractContextManager:
        """While the step traces, :func:`parallelkit.core.axes.constrain` lays activations out by these rules."""
        return active_rules(self.mesh, self.axis_rules)

    def replica_tracing(self) -> contextlib.AbstractContextManager:
        """:meth:`tracing` for one replica's loss, mapped over the replicas (``accumulate > 1``): ``batch`` unsplit."""
        return active_rules(self.mesh, AxisRules(((BATCH, None), *self.axis_rules.rules)))

    def state_shardings(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        *,
        model_state: PyTree = None,
        rng: jax.Array | None = None,
    ) -> TrainState:
        """A :class:`TrainState` of shardings: the step replicated, parameters by their specs,
        optimizer state by :meth:`optimizer_specs`, a PRNG key and model state (where given) replicated."""
        specs = self.partition_specs(params)
        opt_specs = partition.state_specs(self.optimizer_specs(params), tx, params)
        return TrainState(
            step=self.replicated,
            params=partition.shardings(self.mesh, specs),
            opt_state=partition.shardings(self.mesh, opt_specs),
            tx=tx,
            rng=None if rng is None else self.replicated,
            model_state=None if model_state is None else jax.tree.map(lambda _: self.replicated, model_state),
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
        """Place every leaf directly in its sharding: built in one ``jit``, each device gets only its slices
        (a state replicated on every device is simply put there)."""
        rng = prng_key(rng)  # a seed would become a traced integer inside jit
        target = self.state_shardings(params, tx, model_state=model_state, rng=rng)
        if all(sharding.spec == P() for sharding in jax.tree.leaves(target)):  # a full copy everywhere: no program
            return jax.device_put(create_state(params, tx, opt_state, model_state=model_state, rng=rng), target)

        def build(params, opt_state, model_state, rng):
            return create_state(params, tx, opt_state, model_state=model_state, rng=rng)

        return jax.jit(build, out_shardings=target)(params, opt_state, model_state, rng)

    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step:
        """The compiled step; ``accumulate=K`` runs each replica's slice as ``K`` microbatches, synchronised once
        (:mod:`parallelkit.core.accumulate`); ``precision`` casts and scales (:mod:`parallelkit.core.precision`).

        Raises:
          ValueError: ``accumulate > 1`` on a strategy that cannot map its replicas (:attr:`maps_replicas`).
        """
        if check_accumulate(accumulate) > 1 and not self.maps_replicas:
            raise ValueError(
                f"{self!r} does not accumulate gradients (accumulate={accumulate}): use accumulate=1, with a "
                "smaller global batch if one step's activations do not fit."
            )
        check_precision(precision)
        place = accumulated_placement(self.place_batch, accumulate, self.fed_replicas)
        return Step(_CompiledOnFirstCall(self, loss_fn, accumulate, precision), place, self, precision)

    traffic_pattern = "spmd"

    def expected_collectives(self, sizes) -> None:
        """No formula: what moves depends on the rules; the measured payloads are reported as they are."""
        return None

    def __repr__(self) -> str:
        axes = f", batch_axes={self.batch_axes}" if self.batch_axes else ""
        return f"SPMD(mesh={dict(self.mesh.shape)}, rules={self.axis_rules.rules}{axes})"
