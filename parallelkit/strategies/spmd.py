"""One SPMD strategy (:class:`SPMD`): a mesh with any named axes, and logical axis rules for the batch, activations
and parameters.

>>> import parallelkit as pk
>>> mesh = pk.mesh.make_mesh(jax.devices()[:1], data=1, seq=1)
>>> SPMD(mesh, rules=(("batch", "data"), ("length", "seq")))
SPMD(mesh={'data': 1, 'seq': 1}, rules=(('batch', 'data'), ('length', 'seq')))
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cached_property

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..core import partition
from ..core.accumulate import Accumulation, ReplicaCopies, accumulated_placement, check_accumulate
from ..core.axes import AxisRules, active_rules, axis_names
from ..core.contract import put_batch
from ..core.mesh import is_explicit, outside_callers_mesh
from ..core.precision import Precision, check_precision
from ..core.state import TrainState, create_state, prng_key
from ..core.step import Step, train_step
from ..core.types import DATA, Batch, LossFn, MeshAxes, PyTree
from .base import Strategy

BATCH = "batch"  # the logical name of every batch leaf's leading axis
BATCH_ON_DATA = ((BATCH, DATA),)  # the presets' rules: the batch split over `data`
EXPLICIT = ", explicit=True"  # how a preset on an Explicit mesh says so in its repr


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
        self.explicit = is_explicit(mesh)
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

    def compute_specs(self, params: PyTree) -> PyTree:
        """Where each parameter is while the loss uses it: its spec without the batch's mesh axes (a
        parameter sharded over them, as ZeRO-3's are, is gathered whole on each replica first)."""
        batch_axes = set(axis_names(self.batch_sharding.spec[0]))
        specs = self.partition_specs(params)
        return jax.tree.map(lambda spec: P(*_without_axes(spec, batch_axes)), specs, is_leaf=lambda x: isinstance(x, P))

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

    @outside_callers_mesh
    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        """Place every leaf directly in its sharding, inside one ``jax.jit`` (a state replicated on every device
        is simply put there)."""
        rng = prng_key(rng)  # a seed would become a traced integer inside jit
        target = self.state_shardings(params, tx, model_state=model_state, rng=rng)
        build = functools.partial(create_state, tx=tx)  # the optimizer bound: not an argument of the jit
        state = dict(opt_state=opt_state, model_state=model_state, rng=rng)
        if all(sharding.spec == P() for sharding in jax.tree.leaves(target)):  # a full copy everywhere: no program
            return jax.device_put(build(params, **state), target)
        return jax.jit(build, out_shardings=target)(params, **state)

    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step:
        """The compiled step, ``accumulate`` and ``precision`` as :meth:`Strategy.step` says."""
        check_accumulate(accumulate)
        check_precision(precision)
        if self.explicit:
            self._check_explicit(accumulate, precision)
        place = accumulated_placement(self.place_batch, accumulate, self.fed_replicas)
        return Step(_CompiledOnFirstCall(self, loss_fn, accumulate, precision), place, self, precision)

    def _check_explicit(self, accumulate: int, precision: Precision | None) -> None:
        """Refuse, with the reason, a step an Explicit mesh does not run yet."""
        casts = precision is not None and precision.compute_dtype != precision.param_dtype
        if accumulate > 1 or (casts and self.num_replicas > 1):
            what = f"accumulate={accumulate}" if accumulate > 1 else "a 16-bit compute dtype over several replicas"
            raise ValueError(
                f"{self!r} on an Explicit mesh: {what} needs each replica's gradients kept apart until they meet "
                "once. On an Explicit mesh that is JAX's reduced and unreduced types, and JAX 0.10 refuses them in "
                "a layer with a bias (a reduced parameter added to a batch-split activation: tests/test_explicit.py "
                "shows it). The kit does it on an Auto mesh: run it with explicit=False."
            )

    pattern = "spmd"  # rules of the user's own: no one pattern of the cost model (its presets name theirs)

    def expected_collectives(self, sizes) -> None:
        """No formula: what moves depends on the rules; the measured payloads are reported as they are."""
        return None

    def __repr__(self) -> str:
        axes = f", batch_axes={self.batch_axes}" if self.batch_axes else ""
        return f"SPMD(mesh={dict(self.mesh.shape)}, rules={self.axis_rules.rules}{axes})"


class _CompiledOnFirstCall:
    """The jitted step (the single-device step under ``jax.jit`` with the strategy's shardings;
    :meth:`_accumulation` says how ``accumulate=K`` microbatches meet once), built on the first call with the
    strategy's shardings for the state it is given.

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
            mapping, place = self._replica_mapping(state.params), self._place_gradients(state.params)
            extra = {} if mapping is None else {"accumulate": mapping}
            if self.precision is not None:
                extra["precision"] = self.precision
            if state.loss_scale is not None:  # a dynamic loss scale, replicated as the step counter is
                replicated = jax.tree.map(lambda _: self.strategy.replicated, state.loss_scale)
                shardings = shardings.replace(loss_scale=replicated)

            @functools.wraps(train_step)
            def traced(*args, **kwargs):  # inside the strategy's SPMD.tracing context (it runs only while tracing)
                with self.strategy.tracing():
                    return train_step(*args, **kwargs)

            self.fn = jax.jit(
                functools.partial(
                    traced,
                    self._loss(state.params),
                    sync=lambda tree: (place(tree[0]), *tree[1:]),  # the gradients by the gradient specs
                    update=self._update(state.params),
                    **extra,
                ),
                in_shardings=(shardings, self.strategy.batch_shardings(batch)),
                out_shardings=(shardings, self.strategy.replicated),
                donate_argnums=0,
            )
        return self.fn

    def _loss(self, params: PyTree) -> LossFn:
        """The loss the step differentiates: the user's, on an Explicit mesh with every parameter first moved
        to where it is used (:meth:`SPMD.compute_specs`; ``jax.sharding.reshard`` is the all-gather, and its
        transpose in the backward pass the reduce-scatter)."""
        specs = self.strategy.compute_specs(params)
        if not self.strategy.explicit or specs == self.strategy.partition_specs(params):
            return self.loss_fn

        @functools.wraps(self.loss_fn)
        def gathered(params, *args, **kwargs):
            return self.loss_fn(jax.tree.map(jax.sharding.reshard, params, specs), *args, **kwargs)

        return gathered

    def _update(self, params: PyTree) -> Callable[[TrainState, PyTree], TrainState]:
        """How the step applies the met gradients: as :meth:`TrainState.apply_gradients` does, but on an Explicit
        mesh whose optimizer state is laid out unlike the parameters (ZeRO 1 and 2) in the optimizer's layout:
        the gradients and parameters resharded to it (each device keeps its slice), the update there, the new
        parameters resharded back (the all-gather). Explicit types refuse to mix the two layouts."""
        param_specs, opt_specs = self.strategy.partition_specs(params), self.strategy.optimizer_specs(params)
        if not self.strategy.explicit or param_specs == opt_specs:
            return TrainState.apply_gradients

        def to(specs: PyTree, tree: PyTree) -> PyTree:
            return jax.tree.map(jax.sharding.reshard, tree, specs)

        def update(state: TrainState, grads: PyTree) -> TrainState:
            sliced = to(opt_specs, state.params)
            updates, opt_state = state.tx.update(to(opt_specs, grads), state.opt_state, sliced)
            params = to(param_specs, optax.apply_updates(sliced, updates))
            return state.replace(step=state.step + 1, params=params, opt_state=opt_state)

        return update

    def _place_gradients(self, params: PyTree) -> Callable[[PyTree], PyTree]:
        """Lays a tree of gradients out by the strategy's gradient specs (as it is, where it has none)."""
        specs = self.strategy.gradient_specs(params)
        if specs is None:
            return lambda grads: grads
        if self.strategy.explicit:
            return lambda grads: jax.tree.map(jax.sharding.reshard, grads, specs)
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
                lambda spec: P(axes, *_without_axes(spec, group)),
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
        the rows after the loop is the step's one all-reduce (or reduce-scatter). A strategy that cannot
        map its replicas (:attr:`SPMD.maps_replicas`: expert parallelism, whose layers split the batch's own
        axes in ``jax.shard_map``) sums its microbatches' gradients as they are, reduced where XLA puts them.
        """
        strategy, replicas = self.strategy, self.strategy.num_replicas
        if replicas == 1 or not strategy.maps_replicas:
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
        if not self.strategy.explicit:  # every step of an Auto mesh: no context to enter
            return self.compiled(state, batch)(state, batch)
        with self._on_mesh():
            return self.compiled(state, batch)(state, batch)

    def lower(self, state: TrainState, batch: Batch):
        with self._on_mesh():
            return self.compiled(state, batch).lower(state, batch)

    @contextlib.contextmanager
    def _on_mesh(self) -> Iterator[None]:
        """On an Explicit mesh: the mesh set (``jax.set_mesh``, which ``reshard`` reads while the step traces),
        and JAX's ``ShardingTypeError`` (a contraction whose result has no one place) with the kit's advice."""
        if not self.strategy.explicit:
            yield
            return
        try:
            with jax.set_mesh(self.strategy.mesh):
                yield
        except Exception as err:
            if type(err).__name__ == "ShardingTypeError":
                err.add_note(
                    f"parallelkit: {self.strategy!r} runs on an Explicit mesh, where every array's sharding is its "
                    "type and a layer whose result could live in two places must say which: pass out_sharding= to "
                    "that matmul or convolution (jnp.matmul(x, w, out_sharding=P(...))) or reshard its inputs "
                    "(jax.sharding.reshard, or pk.axes.constrain under the strategy's rules); or run the strategy "
                    "on an Auto mesh (explicit=False), where XLA's partitioner chooses."
                )
            raise


def _without_axes(spec: P, axes: set[str]) -> tuple:
    """``spec``'s entries with ``axes`` taken out (a dimension they alone split becomes replicated).

    >>> _without_axes(P("data", ("data", "model"), None), {"data"})
    (None, 'model', None)
    """
    entries = []
    for entry in spec:
        kept = tuple(a for a in axis_names(entry) if a not in axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return tuple(entries)
