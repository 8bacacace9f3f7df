"""``pk.Parallel``: data (with ZeRO), tensor (with sequence parallelism), context and expert axes in one SPMD step.

One mesh holds every axis the layout names (``data``, ``seq``, ``expert``, ``model``, outer to
inner), and one set of logical axis rules says what each splits: the batch over ``data`` and
``expert``, the tokens over ``seq``, attention's heads and the MLP's hidden units over ``model``,
the experts over ``expert``. The parameters take the specs their declared logical axes give
under those rules; ZeRO then shards the state over the axes that hold the same parameters.
:class:`~parallelkit.TensorParallel`, :class:`~parallelkit.Hybrid`,
:class:`~parallelkit.ContextParallel`, :class:`~parallelkit.ExpertParallel` and
:class:`~parallelkit.FullySharded` are its one-axis spellings.

>>> Parallel(data=1, devices=jax.devices()[:1])
Parallel(data=1)
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ..core import partition
from ..core.axes import AxisRules, axis_names, context_method
from ..core.devices import resolve_devices
from ..core.mesh import make_mesh
from ..core.state import TrainState
from ..core.types import DATA, EXPERT, MODEL, SEQ, Batch, PyTree, is_count
from ..measure.groups import axis_traffic
from ..models import declared_axes
from ..models.layers import attention
from ..models.recompute import check_recomputation, recomputation
from .spmd import BATCH, SPMD

LENGTH = "length"  # the logical name of the tokens' axis, a batch array's second
NORM_LENGTH = "norm_length"  # the residual stream's length (pk.models.GPT): split as the tokens are
TOKENS = (BATCH, LENGTH)  # a batch array's axes under context parallelism, unless batch_axes names them

# The logical names a model's parameters declare that tensor parallelism splits over `model`: attention's
# heads, the MLP's hidden width, the CNN's channels between its first two convolutions, and `model` itself
# (a model annotated with the mesh axis name). Every other name stays replicated.
TENSOR_AXES = AxisRules((("heads", MODEL), ("mlp", MODEL), ("hidden_channels", MODEL), (MODEL, MODEL)))

# Megatron's sequence parallelism, as activation rules: the residual stream (``norm_length``: layer norms,
# dropout, residual adds) split along the sequence over `model`; inside attention and the MLP whole sequences
# (``length`` replicated) with the heads and hidden units split. Between the two XLA all-gathers the sequence
# before each column-split layer and reduce-scatters the row-split layer's partial sums after it, where plain
# tensor parallelism all-reduces them.
SEQUENCE_PARALLEL = AxisRules((("norm_length", MODEL), ("length", None), ("heads", MODEL), ("mlp", MODEL)))

# The expert weights (experts on their leading axis) split over `expert`, by path, for parameters that declare
# no `expert` axis; the rest replicated.
EXPERT_RULES = ((r"(^|/)(w_in|w_out|b_in|b_out)$", (EXPERT,)), (".*", ()))

# The model axes by Parallel's keyword, and the mesh axis each splits (the order a repr names them in).
MESH_AXES = {"tensor": MODEL, "context": SEQ, "expert": EXPERT}

# The context axis's collectives by attention's method (a zig-zag ring sends as the ring does).
_CONTEXT_COLLECTIVES = {
    "ring": {"collective-permute": "context: keys round the ring"},
    "allgather": {"all-gather": "context: keys gathered", "reduce-scatter": "context: keys' gradients"},
    "ulysses": {"all-to-all": "context: heads for tokens"},
}

ZERO_STAGES = (0, 1, 2, 3)
# The mesh axes ZeRO may shard a leaf over: every axis whose devices hold the same copy of it (the batch's and
# the tokens' axes; an expert weight is split over `expert` already, so only the others remain for it).
ZERO_AXES = (DATA, SEQ, EXPERT)


class Parallel(SPMD):
    """``data x context x expert x tensor`` devices, each axis split as a layout says, in one compiled step.

    Conceptually, on the device at ``(i, c, e, t)`` of the mesh::

        my sequences = slice (i, e) of the batch;   my tokens = slice c of each of them
        my weights = slice t of every split weight (heads, hidden units), slice e of the experts
        forward and backward: the single-device step; XLA adds the collectives the splits imply
          (tensor: activations' all-reduces; context: attention's keys by `context_method`;
           expert: the tokens' all-to-alls; data: the gradients' all-reduce or, with ZeRO, reduce-scatter)
        update: my shard of the state (ZeRO 1-3 over the axes that hold the same parameters)

    which equals the single-device step (with ``groups`` of an MoE model equal to the device count).

    Args:
      data: replicas that split the batch; ``None``: the devices the other axes leave.
      zero: ZeRO stage 0-3 over the axes that hold the same parameters (``data``, ``context`` and, for
        every weight but the experts', ``expert``): 1 shards the optimizer state, 2 the gradients too,
        3 the parameters too.
      tensor: devices each weight is split over (Megatron's column and row splits, by the logical axes
        the model declares: ``heads``, ``mlp``).
      sequence_parallel: Megatron's sequence parallelism over the ``tensor`` devices (needs ``tensor > 1``).
      context: devices each sequence is split over; attention by ``context_method``.
      context_method: one of :data:`parallelkit.models.layers.attention.METHODS`.
      expert: devices the experts are split over; they split the batch too.
      recompute: what the kit's models recompute in the backward pass, one of
        :data:`parallelkit.models.RECOMPUTE`: ``"none"``, ``"selective"`` (attention's scores and softmax,
        Korthikanti et al. 2022) or ``"full"`` (each block from its input).
      rules: ``(regex, spec)`` partition rules for the parameters (a spec may be a tuple of logical
        names); by default the logical axes the model declares (``pk.models.with_axes``).
      batch_axes: the logical names of a batch array's axes, by its key, ``batch`` first.
      min_size: with ZeRO, leaves with fewer elements stay whole.
      devices: which devices, as many as the axes multiply to; all by default.
      explicit: a mesh of Explicit axes (each slice its array's type).

    Raises:
      ValueError: an axis size that is not a whole number >= 1, a ZeRO stage outside 0-3, an unknown
        context method, ``sequence_parallel`` without a tensor axis; at ``init``, the rule errors.
      DeviceCountError: devices that do not split into the axes.
    """

    # Mesh axes kept at size 1 (a one-axis preset keeps its own axis there, as it always had).
    shown_axes: tuple[str, ...] = ()

    def __init__(
        self,
        data: int | None = None,
        *,
        zero: int = 0,
        tensor: int = 1,
        sequence_parallel: bool = False,
        context: int = 1,
        context_method: str = "ring",
        expert: int = 1,
        recompute: str = "none",
        rules: partition.Rules | PyTree | None = None,
        batch_axes: Mapping[str, Sequence[str | None]] | None = None,
        min_size: int = partition.MIN_SHARD_SIZE,
        devices: int | Sequence[jax.Device] | None = None,
        explicit: bool = False,
    ):
        sizes = {DATA: data, SEQ: context, EXPERT: expert, MODEL: tensor}
        for name, size in (("data", data), ("context", context), ("expert", expert), ("tensor", tensor)):
            if size is not None and not is_count(size):
                raise ValueError(f"{type(self).__name__}({name}={size!r}): an axis size must be a whole number >= 1.")
        if zero not in ZERO_STAGES or isinstance(zero, bool):
            raise ValueError(
                f"Parallel(zero={zero!r}): ZeRO stages are 0 (none), 1 (optimizer state sharded), 2 (and gradients) "
                "and 3 (and parameters)."
            )
        if not is_count(min_size):
            raise ValueError(f"{type(self).__name__}(min_size={min_size!r}): use a whole number of elements >= 1.")
        attention.check_method(context_method)
        check_recomputation(recompute)
        axes = {name: size for name, size in sizes.items() if name == DATA or name in self.shown_axes or size != 1}
        if sequence_parallel and MODEL not in axes:
            raise ValueError(
                "Parallel(sequence_parallel=True, tensor=1): sequence parallelism splits the residual stream over "
                "the tensor axis. Pass tensor=2 or more, or sequence_parallel=False."
            )
        mesh = make_mesh(resolve_devices(devices), explicit=explicit, **axes)
        super().__init__(mesh, rules=_activation_rules(mesh, sequence_parallel), param_rules=rules,
                         batch_axes=batch_axes)  # fmt: skip
        self.zero, self.min_size = zero, min_size
        self.sequence_parallel, self.context_method, self.recompute = sequence_parallel, context_method, recompute

    def size(self, axis: str) -> int:
        """The size of mesh axis ``axis`` (1 where the mesh does not have it)."""
        return self.mesh.shape.get(axis, 1)

    @property
    def maps_replicas(self) -> bool:  # type: ignore[override]
        """Whether the step may map the replicas: not where the experts' layers split the batch's own axes."""
        return EXPERT not in self.mesh.shape

    @property
    def unnamed_batch_axes(self) -> tuple[str, ...]:  # type: ignore[override]
        """A batch array ``batch_axes`` does not name: split on its tokens too where a context axis exists."""
        return TOKENS if SEQ in self.mesh.shape else (BATCH,)

    # -- where the parameters and the state live ------------------------------------------------------------

    def model_specs(self, params: PyTree) -> PyTree:
        """Each parameter's spec before ZeRO: by ``rules``, or by the logical axes the model declares
        (heads and hidden units over ``model``, experts over ``expert``; :data:`EXPERT_RULES` for expert
        weights that declare no axis); checked against the mesh and the shapes."""
        if self.param_rules is not None:
            return super().partition_specs(params)
        declared = declared_axes(params)
        named = [] if declared is None else jax.tree.leaves(declared, is_leaf=lambda x: isinstance(x, tuple))
        if EXPERT in self.mesh.shape and not any(EXPERT in names for names in named):
            return self.specs_by(params, EXPERT_RULES)
        if declared is None:
            if MODEL in self.mesh.shape:
                raise undeclared_axes_error(params)
            return jax.tree.map(lambda _: P(), params)
        kept = [(name, axis) for name, axis in (*TENSOR_AXES.rules, (EXPERT, EXPERT)) if axis in self.mesh.shape]
        specs = partition.logical_specs(declared, AxisRules(tuple(kept)).spec)
        partition.check_specs(params, specs, self.mesh)
        return specs

    def zero_specs(self, params: PyTree) -> PyTree:
        """Each leaf's spec with ZeRO's sharding added (:func:`parallelkit.core.partition.fully_sharded_specs`
        over the mesh axes of :data:`ZERO_AXES` that do not split it already)."""

        def shard(leaf, spec: P) -> P:
            taken = {axis for entry in spec for axis in axis_names(entry)}
            free = tuple(a for a in ZERO_AXES if a in self.mesh.shape and a not in taken)
            if not free:
                return spec
            axis = free[0] if len(free) == 1 else free
            return partition.fully_sharded_specs(leaf, axis, math.prod(map(self.size, free)), min_size=self.min_size,
                                                 base=spec)  # fmt: skip

        specs = jax.tree.map(shard, params, self.model_specs(params), is_leaf=lambda x: isinstance(x, P))
        partition.check_specs(params, specs, self.mesh)
        return specs

    def partition_specs(self, params: PyTree) -> PyTree:
        return self.zero_specs(params) if self.zero == 3 else self.model_specs(params)

    def optimizer_specs(self, params: PyTree) -> PyTree:
        return self.zero_specs(params) if self.zero else self.partition_specs(params)

    def gradient_specs(self, params: PyTree) -> PyTree | None:
        """None without ZeRO (where XLA chooses); stage 1 whole gradients; stages 2 and 3 each device's shard."""
        if not self.zero:
            return None
        return self.zero_specs(params) if self.zero >= 2 else self.partition_specs(params)

    def compute_specs(self, params: PyTree) -> PyTree:
        """Where each parameter is while the loss uses it: its spec before ZeRO (ZeRO shards only dimensions the
        model's spec leaves whole, so gathering them gives that spec back; the experts are used where they live:
        the all-to-all brings the tokens to them)."""
        return self.model_specs(params)

    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        """:meth:`SPMD.init`, with a warning where an expert axis splits no parameter."""
        if EXPERT in self.mesh.shape:
            specs = jax.tree.leaves(self.model_specs(params), is_leaf=lambda x: isinstance(x, P))
            if not any(EXPERT in axis_names(entry) for spec in specs for entry in spec):
                warnings.warn(self._no_experts(), stacklevel=2)
        return super().init(params, tx, opt_state, model_state=model_state, rng=rng)

    def _no_experts(self) -> str:
        """What a model with no parameter split over ``expert`` becomes, and how to split its expert weights."""
        matched = (
            "no rule in rules= splits a parameter over 'expert'"
            if self.param_rules is not None
            else "no parameter matched the expert rules (none declares the logical axis 'expert', and no path "
            "ends in w_in, w_out, b_in or b_out)"
        )
        over = (
            f"all {self.mesh.size} devices"
            if self.num_replicas == self.mesh.size
            else f"its {self.num_replicas} replicas"
        )
        return (
            f"{self!r}: {matched}, so every parameter is replicated over 'expert' and the step is data parallelism "
            f"over {over}. Name each expert weight w_in, w_out, b_in or b_out "
            "with the experts on its leading axis (as pk.experts.moe_layer's are), declare that axis 'expert' "
            "(pk.models.with_axes), or pass rules= that split it over 'expert'."
        )

    # -- the batch and the step's tracing -----------------------------------------------------------------------

    def place_batch(self, batch: Batch) -> Batch:
        """Send each block of every sequence to its device; clear errors for arrays that do not split.

        The checks run only when placing fails, in either mode: on an Auto mesh JAX refuses an array too short
        for its spec with a ``ValueError``, on an Explicit one with a bare ``AssertionError``.
        """
        try:
            return super().place_batch(batch)
        except (ValueError, AssertionError):
            if SEQ in self.mesh.shape:
                self._check_tokens(batch)
            raise

    def _check_tokens(self, batch: Batch) -> None:
        """Raise a clear error for an array whose token axis is missing or does not divide by the context axis."""
        seq = self.mesh.shape[SEQ]
        named = batch.items() if isinstance(batch, Mapping) else enumerate(jax.tree.leaves(batch))
        for key, leaf in named:
            unnamed = self.unnamed_batch_axes
            names = self.batch_axes.get(key, unnamed) if isinstance(batch, Mapping) else unnamed
            if LENGTH not in names:
                continue
            axis = names.index(LENGTH)
            shape = getattr(leaf, "shape", ())
            if len(shape) <= axis:
                raise ValueError(
                    f"{self!r} splits axis 0 of every batch array over data and axis {axis} over seq, but batch "
                    f"array {key!r} has shape {tuple(shape)}. If it is one sequence without a batch axis, give it "
                    f"one (batch[{key!r}][None], shape (1, {', '.join(map(str, shape))})); if it holds one value "
                    f"per example and no tokens, name it in batch_axes={{{key!r}: ('batch',)}}."
                )
            if shape[axis] % seq:
                raise ValueError(
                    f"The sequence length {shape[axis]} of batch array {key!r} does not split over seq={seq} "
                    f"devices: use a length divisible by {seq}, or a seq that divides {shape[axis]}."
                )

    def tracing(self) -> contextlib.AbstractContextManager:
        """The rules (:meth:`SPMD.tracing`), the recomputation and, on a context axis, attention's method, while
        the step traces."""
        return self._with_method(super().tracing())

    def replica_tracing(self) -> contextlib.AbstractContextManager:
        return self._with_method(super().replica_tracing())

    @contextlib.contextmanager
    def _with_method(self, rules: contextlib.AbstractContextManager) -> Iterator[None]:
        method = context_method(self.context_method) if SEQ in self.mesh.shape else contextlib.nullcontext()
        with rules, method, recomputation(self.recompute):
            yield

    pattern = "spmd"  # several axes' collectives in one program: reported per mesh axis (axis_collectives)

    def axis_collectives(self) -> dict[tuple[str, ...], dict[str, str]]:
        """What each set of mesh axes carries by the book, by collective kind: the role it plays.

        The collectives the layout needs by the book, on the axes whose bytes the planner's step-time model
        (:func:`parallelkit.planner.step_time`) charges them to: the tensor axis's activations (gathered and
        scattered under sequence parallelism), the context axis's keys by method, the experts' tokens, and the
        gradients over the axes where the same parameters repeat (dense: ``data x seq x expert``; experts:
        ``data x seq``): all-reduced; under ZeRO-1, which keeps whole gradients, all-reduced and the updated
        parameter shards all-gathered (as :class:`~parallelkit.FullySharded` ``(1)`` does); under ZeRO-2 and 3
        reduce-scattered and the parameters all-gathered (Rajbhandari et al. 2020: the same bytes as the
        all-reduce). :meth:`traffic` sets the compiled program's collectives beside it.
        """
        roles: dict[tuple[str, ...], dict[str, str]] = {}
        if self.size(MODEL) > 1:
            split = {"all-gather": "sequence parallel: gather", "reduce-scatter": "sequence parallel: scatter"}
            roles[(MODEL,)] = split if self.sequence_parallel else {"all-reduce": "tensor: activations"}
        if self.size(SEQ) > 1:
            roles[(SEQ,)] = _CONTEXT_COLLECTIVES[self.context_method.removesuffix("_zigzag")]
        if self.size(EXPERT) > 1:
            roles[(EXPERT,)] = {"all-to-all": "experts: tokens"}
        reduce = {"reduce-scatter" if self.zero >= 2 else "all-reduce": "gradients"}
        if self.zero:
            reduce["all-gather"] = "parameters"
        for axes in ((DATA, SEQ, EXPERT), (DATA, SEQ)):
            repeat = tuple(a for a in axes if self.size(a) > 1)
            if repeat:
                roles.setdefault(repeat, {}).update(reduce)
        return roles

    def traffic(self, loss_fn, state, batch):
        """The batch slice and the compiled program's collectives per set of mesh axes, each beside the role
        :meth:`axis_collectives` gives it (a preset reports its own formulas instead)."""
        if self.pattern != Parallel.pattern:
            return super().traffic(loss_fn, state, batch)
        return axis_traffic(self, loss_fn, state, batch, self.axis_collectives())

    def __repr__(self) -> str:
        shown = [f"data={self.size(DATA)}"]
        if self.zero:
            shown.append(f"zero={self.zero}")
        for name, axis in MESH_AXES.items():
            if axis in self.mesh.shape:
                shown.append(f"{name}={self.size(axis)}")
        if self.sequence_parallel:
            shown.append("sequence_parallel=True")
        if SEQ in self.mesh.shape:
            shown.append(f"context_method={self.context_method!r}")
        if self.recompute != "none":
            shown.append(f"recompute={self.recompute!r}")
        return f"Parallel({', '.join(shown)}{', explicit=True' if self.explicit else ''})"


def _activation_rules(mesh: Mesh, sequence_parallel: bool) -> AxisRules:
    """The logical axis rules of a mesh: the batch over ``data`` (and ``expert``), the tokens over ``seq``,
    Megatron's sequence parallelism's over ``model``, the experts over ``expert`` (their hidden units over
    ``model``, as the dense MLP's)."""
    has = set(mesh.shape)
    rules: list[tuple[str, object]] = [(BATCH, (DATA, EXPERT) if EXPERT in has else DATA)]
    if SEQ in has:
        rules += [(LENGTH, SEQ), (NORM_LENGTH, (SEQ, MODEL) if sequence_parallel else SEQ)]
        if MODEL in has:  # attention's heads stay split where its keys travel over seq
            rules.append(("heads", MODEL))
    if sequence_parallel:
        rules += [rule for rule in SEQUENCE_PARALLEL.rules if rule[0] not in {name for name, _ in rules}]
    if EXPERT in has:
        rules.append((EXPERT, EXPERT))
        if MODEL in has and not sequence_parallel:  # each expert's hidden units, as the weights hold them
            rules.append(("mlp", MODEL))
    return AxisRules(tuple(rules))


def undeclared_axes_error(params: PyTree) -> ValueError:
    """The error for a model that declares no logical axes, so has no tensor-parallel split: what to pass."""
    labels = [partition.path_label(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    return ValueError(
        "TensorParallel has default rules only for models whose parameters declare logical axes "
        "(pk.models.MLP, CNN and Transformer do; an NNX module of your own can, with "
        "kernel_init=pk.models.with_axes(init, names), turned into parameters by pk.models.from_nnx); "
        "give rules=[(regex, PartitionSpec), ...] "
        f"for this model (its parameters: {', '.join(labels[:6])}{', ...' if len(labels) > 6 else ''}), "
        'for example [(".*kernel", P(None, "model")), (".*", P())].'
    )
