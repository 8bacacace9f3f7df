"""``pk.Pipeline``: the layers cut into stages on their own devices, the batch into microbatches."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property, lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.accumulate import refuse_accumulation
from ...core.axes import DATA, EXPERT, MODEL, SEQ
from ...core.contract import Batch, LossInputError, PyTree, batch_size, guard_inputs, tree_bytes
from ...core.devices import DeviceCountError, first_devices
from ...core.mesh import is_count, make_mesh, outside_callers_mesh
from ...core.precision import Precision, check_precision, next_scale, select
from ...core.reports import D2D, H2D, Flow, StepTraffic
from ...core.state import TrainState, check_same_tree
from ...core.step import Step, keep_finite_choice
from ...measure.inspect import Collective, parse_collectives
from ...measure.traffic import bus_bytes, per_replica_bytes
from ..base import Strategy, refuse_explicit
from ..offdevice.split_update import check_update_splits
from ..parallel import Parallel
from . import schedules
from . import stages as programs
from .executor import Timeline, execute
from .stages import HeadLoss, Layer, split_layers

SCHEDULES: dict[str, Callable[..., list[schedules.Slot]]] = {
    "gpipe": schedules.gpipe_schedule,
    "1f1b": schedules.one_f_one_b_schedule,
    "interleaved": schedules.interleaved_schedule,
    "zb-h1": schedules.zero_bubble_schedule,
}


class Pipeline(Strategy):
    """Pipeline parallelism: stage ``s`` runs its run of layers on its own devices, microbatch by microbatch.

    Conceptually, one step on a global batch cut into ``m`` microbatches::

        for each (stage, microbatch, forward or backward) in the schedule's order:
            forward:  x = stage's layers(x received from the stage above); send x below
            backward: grads[stage] += d loss / d params; send d loss / d x above
        each stage: params[stage] = optimizer update(grads[stage])    # one update per step

    which equals the single-device step on :func:`~parallelkit.strategies.pipeline.sequential_loss`
    (the loss of a step is the mean of its microbatches' losses). Each stage's parameters
    and optimizer state live on its own devices only; activations and their gradients
    are copied between the stages' devices. ``schedule`` decides only the order (each is described,
    with what it costs and saves, in :mod:`~parallelkit.strategies.pipeline.schedules`).
    With ``data > 1`` each stage is a group of ``data`` devices that split every microbatch;
    each device adds up its own slices' gradients, and the stage all-reduces them once a
    step, after its last backward pass (as DDP's ``no_sync`` does for accumulated
    microbatches), not once per microbatch.

    What a pipeline here does not do, each refused with an error that says so:

    - the optimizer runs stage by stage on that stage's parameters, which equals one update
      of all of them for optimizers whose update of a parameter needs nothing from another
      stage (SGD, momentum, Adam, AdamW; LAMB and LARS too, their norms being per parameter),
      but not for ``optax.clip_by_global_norm``, which would clip each stage by its own norm:
      :meth:`init` probes the optimizer and refuses it
      (:func:`~parallelkit.strategies.offdevice.split_update.check_update_splits`);
    - no dropout key and no mutable model state (BatchNorm statistics): a layer is
      ``apply(params, x) -> y``, so :meth:`init` refuses ``rng`` and ``model_state``, and
      :func:`~parallelkit.models.as_layers` gives the kit's transformer without dropout;
    - no single compiled program: :meth:`PipelineStep.lower` and the compiler's memory
      analysis have nothing to read, while :meth:`traffic` measures the arrays one step
      hands between stages.

    Args:
      layers: ``[apply_0, ..., apply_{L-1}]``, each ``apply_i(params_i, x) -> y``; the first
        receives the (micro)batch as given, each later one the previous output.
        :func:`parallelkit.models.as_layers` gives the kit's MLP and transformer in this form.
      stages: how many stages (groups of devices) the layers are cut into, at most ``L``.
      microbatches: how many microbatches the global batch is cut into; it must divide the batch.
      schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``, or a function
        ``(stages, microbatches) -> list[Slot]`` (with ``virtual > 1``, ``(stages, microbatches, virtual)``).
      virtual: chunks of layers per stage (the model is cut into ``stages x virtual`` runs),
        for an interleaved schedule; 1 otherwise.
      data: devices per stage that split each microbatch (data parallelism on a second axis).
      stage_axes: each stage itself SPMD over its own devices: :class:`~parallelkit.Parallel`'s keywords
        (``tensor``, ``sequence_parallel``, ``context``, ``context_method``, ``expert``, ``zero``,
        ``recompute``), so that
        ``stage_axes=dict(tensor=2)`` splits every stage's weights over 2 of its devices. Each stage then
        runs on ``data x tensor x context x expert`` devices and its programs are that ``Parallel``'s
        (gradients meet over ``data`` inside each backward pass, as XLA places them).
      layers_per_stage: how many layers each of the model's ``stages x virtual`` runs holds (as
        even as possible by default).
      devices: ``stages x data`` devices; the first ``stages x data`` by default. Stage ``s``
        gets the ``stage = s`` column of the ``data x stage`` mesh.
      explicit: False (Auto mode); True is refused, as every strategy takes ``explicit=`` alike.

    Raises:
      ValueError: counts below 1, ``layers`` that are not functions, an unknown schedule, more
        runs of layers than layers, ``virtual > 1`` with a schedule that does not interleave,
        ``schedule="interleaved"`` with ``virtual=1``, or ``explicit=True``.
      DeviceCountError: devices that are not ``stages x data`` in number.

    Warns:
      DeviceSubsetWarning: without ``devices``, when ``stages x data`` is fewer than all the devices.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        stages: int,
        microbatches: int = 1,
        schedule: str | Callable[..., list[schedules.Slot]] = "gpipe",
        *,
        virtual: int = 1,
        data: int = 1,
        stage_axes: Mapping[str, Any] | None = None,
        layers_per_stage: Sequence[int] | None = None,
        devices: Sequence[jax.Device] | None = None,
        explicit: bool = False,
    ):
        refuse_explicit(
            "Pipeline",
            explicit,
            "Its stages run programs of their own, driven from the host one thread "
            "per stage, not one program over a mesh whose types could carry the shardings.",
        )
        for name, size in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual), ("data", data)):
            if not is_count(size):
                raise ValueError(f"Pipeline({name}={size!r}): it must be a whole number >= 1.")
        if not callable(schedule) and schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}: use one of {sorted(SCHEDULES)} or a schedule function.")
        if virtual > 1 and isinstance(schedule, str) and schedule != "interleaved":
            raise ValueError(
                f"Pipeline(schedule={schedule!r}, virtual={virtual}): only an interleaved schedule runs several "
                "chunks of layers per stage. Use schedule='interleaved', or virtual=1."
            )
        if schedule == "interleaved" and virtual == 1:
            raise ValueError(
                "Pipeline(schedule='interleaved', virtual=1): an interleaved schedule runs several chunks of layers "
                "per stage. Pass virtual=2 or more, or schedule='1f1b' (interleaving one chunk is 1F1B)."
            )
        self.layers, self.virtual = _layer_functions(layers), virtual
        if virtual > 1 and stages * virtual > len(self.layers):
            raise ValueError(
                f"Pipeline(stages={stages}, virtual={virtual}) cuts the model into {stages * virtual} runs of layers "
                f"and needs at least {stages * virtual} layers, but the model has {len(self.layers)}. Use fewer "
                "stages or chunks, or split the model into more layers."
            )
        self.stage_axes = _checked_stage_axes(stage_axes)
        inner = math.prod(self.stage_axes.get(axis, 1) for axis in ("tensor", "context", "expert"))
        self.stage_layers = split_layers(len(self.layers), stages * virtual, layers_per_stage)
        # The first layer reads the batch: a batch it cannot read or fit raises a clear error.
        self.layers = (_guarded(self.layers[0]), *self.layers[1:])
        wanted = stages * data * inner
        sizes = "stages x data" + (" x the stage axes" if inner > 1 else "")
        if devices is not None and len(devices) != wanted:
            raise DeviceCountError(
                f"Pipeline(stages={stages}, data={data}) runs on {sizes} = {wanted} devices, "
                f"but {len(devices)} were given. Pass {wanted} devices (e.g. jax.devices()[:{wanted}]), "
                "or change stages or data so that they multiply to the device count."
            )
        if devices is None:  # the first stages x data devices, with a warning if that leaves some idle
            devices = first_devices(
                stages * inner, data, lambda d: f"data={d}", sizes, f"Pipeline(stages={stages}, data={data})"
            )
        super().__init__(devices)
        inside = {_MESH_AXES[axis]: self.stage_axes[axis] for axis in _MESH_AXES if self.stage_axes.get(axis, 1) > 1}
        self.mesh = make_mesh(self.devices, data=data, stage=stages, **inside)
        # Each stage SPMD over its own devices (stage s: the mesh's `stage = s` slice, in order), where it has axes
        self.stage_strategies = (
            [Parallel(data, devices=list(self.mesh.devices[:, s].flat), **self.stage_axes) for s in range(stages)]
            if self.stage_axes
            else None
        )
        self.microbatches, self.data = microbatches, data
        self.schedule_name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "custom")
        self.schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
        self.planned()  # a schedule that cannot run these counts says so now, not at the first step

    @property
    def stages(self) -> int:
        """How many stages (groups of ``data`` devices) the pipeline has."""
        return len(self.stage_layers) // self.virtual

    @property
    def model_stages(self) -> int:
        """How many runs of layers the model is cut into: ``stages x virtual``. Run ``k`` lives on stage
        ``k % stages``; every method that takes a ``stage`` takes such a run (with ``virtual=1`` the same)."""
        return len(self.stage_layers)

    @property
    def num_replicas(self) -> int:
        return self.data if self.stage_strategies is None else self.stage_strategies[0].num_replicas

    @cached_property
    def stage_meshes(self) -> list[Mesh]:
        """Stage ``s``'s devices as a mesh: one ``data`` axis, or its :class:`~parallelkit.Parallel`'s axes."""
        if self.stage_strategies is not None:
            return [strategy.mesh for strategy in self.stage_strategies]
        return [Mesh(self.mesh.devices[:, s], (DATA,)) for s in range(self.stages)]

    def stage_devices(self, stage: int) -> list[jax.Device]:
        """Run ``stage``'s devices: its stage's slice of the ``data x stage (x the stage axes)`` mesh."""
        return list(self.mesh.devices[:, stage % self.stages].flat)

    def replicated(self, stage: int) -> NamedSharding:
        """Where run ``stage``'s parameters and optimizer state live: a full copy on each of its devices."""
        return NamedSharding(self.stage_meshes[stage % self.stages], P())

    def split(self, stage: int) -> NamedSharding:
        """Where run ``stage``'s microbatches and activations live: split over its devices along the batch."""
        if self.stage_strategies is not None:
            return self.stage_strategies[stage % self.stages].batch_sharding
        return NamedSharding(self.stage_meshes[stage % self.stages], P(DATA))

    def batch_placement(self, stage: int, batch: Batch) -> Any:
        """Where run ``stage``'s microbatch of the batch lives: :meth:`split`, or by its stage's rules (the
        tokens over ``context`` too)."""
        if self.stage_strategies is not None:
            return self.stage_strategies[stage % self.stages].batch_shardings(batch)
        return self.split(stage)

    def state_placement(self, stage: int, params: PyTree, tx: optax.GradientTransformation) -> tuple[Any, Any]:
        """Where run ``stage``'s parameters and optimizer state live: a copy on each of its devices, or as its
        stage's :class:`~parallelkit.Parallel` lays them out (split weights, ZeRO)."""
        if self.stage_strategies is None:
            return self.replicated(stage), self.replicated(stage)
        target = self.stage_strategies[stage % self.stages].state_shardings(params, tx)
        return target.params, target.opt_state

    def planned(self) -> list[schedules.Slot]:
        """The computed schedule this pipeline runs (in units of one forward pass), checked."""
        chunked = () if self.virtual == 1 else (self.virtual,)
        plan = self.schedule(self.stages, self.microbatches, *chunked)
        if not plan:
            raise ValueError(
                f"{self!r}: its schedule function returned no slots ({plan!r}) for {self.stages} stages and "
                f"{self.microbatches} microbatches. Return every stage's passes as Slot rows (see "
                "pk.schedules.one_f_one_b_schedule), or use a named schedule such as '1f1b'."
            )
        schedules.check_schedule(plan)
        if 1 + max(slot.chunk for slot in plan) != self.virtual:
            raise ValueError(f"{self!r}: its schedule runs {1 + max(s.chunk for s in plan)} chunks per stage, not "
                             f"virtual={self.virtual}.")  # fmt: skip
        return plan

    def stage_params(self, params: Sequence[PyTree]) -> list[list[PyTree]]:
        """The per-layer parameter list cut into per-run lists (one per model stage)."""
        return [list(params[i] for i in layers) for layers in self.stage_layers]

    @staticmethod
    def layer_params(per_stage: Sequence[Sequence[PyTree]]) -> list[PyTree]:
        """The per-stage lists joined back into the per-layer list (stages hold neighbouring layers, in order)."""
        return [p for stage in per_stage for p in stage]

    @outside_callers_mesh
    def init(
        self,
        params: Sequence[PyTree],
        tx: optax.GradientTransformation,
        opt_state: Sequence[PyTree] | None = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        """Place each stage's parameters and optimizer state on that stage's devices only.

        Args:
          params: the list of per-layer parameters, one entry per layer.
          tx: the optimizer; each stage gets ``tx.init`` of its own parameters.
          opt_state: a list of per-stage optimizer states (as this method builds, e.g. from
            a checkpoint), checked and placed; built from ``tx`` when None.

        Raises:
          ValueError: ``params`` that is not one entry per layer, an ``opt_state`` that does not
            fit, ``model_state`` / ``rng`` (which pipelines do not take), or an optimizer whose
            update differs when run stage by stage (such as ``optax.clip_by_global_norm``).
        """
        if model_state is not None or rng is not None:
            raise ValueError(
                "Pipeline takes no model_state or rng: its layers are apply(params, x) -> y, without "
                "BatchNorm statistics or dropout keys. Leave them out (pk.models.as_layers gives the kit's MLP, and "
                "its transformer without dropout), or train a model that needs them with another strategy."
            )
        if not isinstance(params, Sequence) or len(params) != len(self.layers):
            got = f"{len(params)} entries" if isinstance(params, Sequence) else type(params).__name__
            raise ValueError(
                f"Pipeline.init needs a list of per-layer parameters, one for each of the {len(self.layers)} "
                f"layers, got {got}. pk.models.as_layers returns the layers and this list together."
            )
        check_update_splits(
            tx, params, self.stage_params, self.layer_params, strategy=repr(self),
            how=f"runs the optimizer on each of its {self.model_stages} "
            f"{'stages' if self.virtual == 1 else 'runs of layers'} separately",
            layout=("pipeline", tuple((r.start, r.stop) for r in self.stage_layers)),
            what_to_do="Use an optimizer that updates each parameter from its own gradient (optax.sgd, momentum, "
            "adam, adamw), or train pk.pipeline.sequential_loss(layers, head_loss) with SingleDevice, Mirrored "
            "or FullySharded, which update every parameter at once.",
        )  # fmt: skip
        per_stage = self.stage_params(params)
        where = [self.state_placement(s, p, tx) for s, p in enumerate(per_stage)]
        placed = [_placed_copy(p, where[s][0]) for s, p in enumerate(per_stage)]
        if opt_state is None:
            opt_states = [jax.jit(tx.init, out_shardings=where[s][1])(p) for s, p in enumerate(placed)]
        else:
            expected = [jax.eval_shape(tx.init, p) for p in per_stage]
            check_same_tree(expected, list(opt_state), what="opt_state", against="[tx.init(stage params), ...]")
            opt_states = [_placed_copy(o, where[s][1]) for s, o in enumerate(opt_state)]
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated(0))
        return TrainState(step=step, params=self.layer_params(placed), opt_state=opt_states, tx=tx)

    def place_batch(self, batch: Batch) -> list[Batch]:
        """The global batch as ``microbatches`` host slices (each stage places its own); a clear error if not."""
        size = batch_size(batch)
        if size % self.microbatches:
            raise ValueError(
                f"A batch of {size} examples does not split into {self.microbatches} equal microbatches. "
                f"Use a batch size divisible by {self.microbatches}, or another microbatch count."
            )
        micro, replicas = size // self.microbatches, self.num_replicas
        if micro % replicas:
            raise ValueError(
                f"A microbatch of {micro} examples does not split over the {replicas} replicas of a stage. "
                f"Use a batch size divisible by microbatches x replicas = {self.microbatches * replicas}."
            )
        return [jax.tree.map(lambda x, m=m: x[m * micro : (m + 1) * micro], batch) for m in range(self.microbatches)]

    def step(self, head_loss: HeadLoss, accumulate: int = 1, precision: Precision | None = None) -> PipelineStep:
        """The training step for ``head_loss(output, batch) -> loss or (loss, aux)`` on the last layer's output.

        ``accumulate > 1`` raises NotImplementedError: the pipeline already cuts the batch into
        microbatches and applies one update a step (``Pipeline(..., microbatches=K)``).
        ``precision`` applies its casts in every stage's programs (activations travel between
        stages in its compute dtype) and its loss scale to the last stage's seed gradient; the
        stages skip their updates together unless every stage's gradients are finite.
        """
        refuse_accumulation(
            repr(self),
            accumulate,
            "The pipeline already cuts each batch into microbatches and applies one update a step: "
            "use Pipeline(..., microbatches=...).",
        )
        return PipelineStep(self, head_loss, check_precision(precision))

    def traffic(self, loss_fn: HeadLoss, state: TrainState, batch: Batch) -> StepTraffic:
        """The bytes one step moves, per replica: one device of each stage (a row of the ``data x stage`` mesh).

        ``loss_fn`` is the ``head_loss`` the step takes. This runs every forward and backward
        pass of one step, as :meth:`step` does, and measures the arrays handed to each stage's
        devices; it neither updates nor changes ``state``. The formulas, for ``m``
        microbatches, ``d`` devices per stage, a global batch of ``B`` bytes and ``A_s`` the
        bytes of one microbatch's output of stage ``s`` (from :func:`jax.eval_shape` of its
        layers, not from the run):

        - host->device: the microbatches to the first stage (``B/d``) and again to the last,
          which reads the labels (``B/d``);
        - device<->device, at each boundary between stages ``s`` and ``s + 1``: the activations
          down and their gradients up, ``m x A_s / d`` each, so ``2 x m x A_s / d`` in all;
        - with ``d > 1``, the collectives each stage's programs run, read from their compiled
          HLO and counted once per call: each device adds its slices' gradients up over the
          microbatches, and the stage all-reduces them once a step (``P_s``, the stage's
          parameter bytes; not once per microbatch, ``m x P_s``, as an all-reduce inside each
          backward pass would), and the last stage's forward program all-reduces its loss and
          metrics once per microbatch (``m x M``).

        Returns:
          A :class:`~parallelkit.measure.traffic.StepTraffic`; ``print(traffic.table())`` shows it.
        """
        step, params = PipelineStep(self, loss_fn), self.stage_params(state.params)
        microbatches = self.place_batch(batch)
        moved: Counter[tuple[str, int]] = Counter()
        for what, stage, _, nbytes in step.passes(params, microbatches)[2].moved:
            moved[what, stage] += nbytes
        m, d, last = self.microbatches, self.data, self.model_stages - 1
        outputs = step.output_shapes(params, microbatches[0])
        metric_bytes = tree_bytes(outputs[last])
        total = tree_bytes(batch)
        ends = [(0, "batch, to stage 0")] + ([(last, f"batch, to stage {last} (labels)")] if last else [])
        flows = [Flow(H2D, what, moved["batch", s], total / d, "B/d", "placed microbatches") for s, what in ends]
        for s in range(last):
            boundary = tree_bytes(outputs[s]) / d
            for what, to, arrow in (("activations", s + 1, f"{s} -> {s + 1}"), ("gradients", s, f"{s + 1} -> {s}")):
                flows.append(Flow(D2D, f"{what}, stage {arrow}", moved[what, to], m * boundary, f"m x A_{s}/d",
                                  "arrays handed over"))  # fmt: skip
        found = step.stage_collectives(state, microbatches[0]) if d > 1 else []
        flows += _collective_flows(found, m, metric_bytes, state, self)
        every_call = [c for _, kind, c in found for _ in range(_calls(kind, m))]
        return StepTraffic(repr(self), self.pattern, d, tree_bytes(state.params), metric_bytes, tuple(flows),
                           bus_bytes=bus_bytes(every_call))  # fmt: skip

    pattern = "pipeline"

    def expected_collectives(self, sizes) -> None:
        return None

    def __repr__(self) -> str:
        data = f", data={self.data}" if self.data > 1 else ""
        if self.stage_axes:
            data += f", stage_axes={self.stage_axes}"
        data = f", virtual={self.virtual}{data}" if self.virtual > 1 else data
        schedule = f"schedule={self.schedule_name!r}"
        return f"Pipeline(stages={self.stages}, microbatches={self.microbatches}, {schedule}{data})"


# A stage axis, by Parallel's keyword, and its mesh axis in the pipeline's mesh.
_MESH_AXES = {"context": SEQ, "expert": EXPERT, "tensor": MODEL}
_STAGE_KEYWORDS = ("tensor", "sequence_parallel", "context", "context_method", "expert", "zero", "recompute")


def _checked_stage_axes(stage_axes: Mapping[str, Any] | None) -> dict[str, Any]:
    """``stage_axes`` as a dict without its defaults; a clear error for a keyword a stage does not take."""
    given = dict(stage_axes or {})
    if unknown := sorted(set(given) - set(_STAGE_KEYWORDS)):
        what = "'data' is Pipeline's own data=" if "data" in unknown else f"{unknown[0]!r} is not one of them"
        raise ValueError(
            f"Pipeline(stage_axes={given}): a stage takes pk.Parallel's keywords {_STAGE_KEYWORDS}; {what}."
        )
    splits = any(given.get(key, 1) > 1 for key in _MESH_AXES) or given.get("zero", 0) or given.get("sequence_parallel")
    recomputes = given.get("recompute", "none") != "none"
    return given if splits or recomputes else {}  # a stage over nothing but data, recomputing nothing: plain


def _layer_functions(layers: Iterable[Layer]) -> tuple[Layer, ...]:
    """``layers`` as a tuple of functions; a clear error for anything else (a list of parameters, most often)."""
    if callable(layers) or not isinstance(layers, Iterable):
        raise ValueError(
            f"Pipeline(layers=<{type(layers).__name__}>): layers is a list of layer functions, [apply_0, apply_1, "
            "...], each apply(params, x) -> y. pk.models.as_layers returns them for the kit's models."
        )
    layers = tuple(layers)
    for i, layer in enumerate(layers):
        if not callable(layer):
            raise ValueError(
                f"Pipeline(layers=...): layers[{i}] is a {type(layer).__name__}, not a function. layers is the list "
                "of layer functions, each apply(params, x) -> y; their parameters go to Pipeline.init "
                "(pk.models.as_layers returns both lists)."
            )
    return layers


# One guarded function per layer function, so that pipelines of the same layers share compiled programs.
_guarded = lru_cache(maxsize=256)(guard_inputs)


def _calls(program: str, m: int) -> int:
    """How often a step calls a stage's program: the gradients' reduce once, every other once per microbatch."""
    return 1 if program == "reduce" else m


def _collective_flows(
    found: Sequence[tuple[int, str, Collective]], m: int, metric_bytes: int, state: TrainState, pipe: Pipeline
) -> list[Flow]:
    """The stages' collectives as flows, each counted as often as its program runs a step (:func:`_calls`):
    each stage's one gradient all-reduce, the last stage's metrics', and any other."""
    stage_params, last = pipe.stage_params(state.params), pipe.model_stages - 1
    totals: dict[tuple[int, str, str], int] = {}
    for s, kind, c in found:
        totals[s, kind, c.op] = totals.get((s, kind, c.op), 0) + _calls(kind, m) * c.bytes
    flows = []
    for s in range(pipe.model_stages if found else 0):
        measured = totals.pop((s, "reduce", "all-reduce"), 0)
        flows.append(Flow(D2D, f"gradients of stage {s} (all-reduce)", measured, tree_bytes(stage_params[s]),
                          f"P_{s}", "compiled HLO, once a step"))  # fmt: skip
    if found:
        measured = totals.pop((last, "forward", "all-reduce"), 0)
        flows.append(Flow(D2D, f"loss and metrics, stage {last} (all-reduce)", measured, m * metric_bytes, "m x M",
                          "compiled HLO, x m calls"))  # fmt: skip
    for (s, kind, op), measured in totals.items():
        flows.append(Flow(D2D, f"other collectives, stage {s} {kind} ({op})", measured, 0, "0", "compiled HLO"))
    return flows


def _placed_copy(tree: PyTree, sharding: NamedSharding) -> PyTree:
    """A copy of ``tree`` on ``sharding``, never sharing a buffer with the caller's arrays (the step donates it).

    ``jax.device_put(..., may_alias=False)`` is not enough: replicating an array onto
    several devices, its own among them, reuses its buffer there (JAX 0.10.2).
    """
    return jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), tree), sharding)


class PipelineStep(Step):
    """A pipeline's training step: ``state, metrics = step(state, batch)``, and the timeline it ran.

    Each call runs the pipeline's schedule on the global batch (see :class:`Pipeline`),
    one host thread per stage, and returns when every stage has updated its parameters;
    ``timeline`` then holds what that call recorded (:class:`~parallelkit.strategies.pipeline.Timeline`).
    The first call's timeline includes compiling the stages' programs.
    """

    def __init__(self, pipeline: Pipeline, head_loss: HeadLoss, precision: Precision | None = None):
        super().__init__(self._run, pipeline.place_batch, pipeline, precision)
        self.pipeline, self.head_loss = pipeline, head_loss
        plan = pipeline.planned()
        self.orders = schedules.stage_orders(plan)
        self.split_backward = any(slot.kind == "weight" for slot in plan)  # zb-h1: backward and weight passes
        last = pipeline.model_stages - 1
        # The static arguments of each stage's programs: the shared ones, its layers, and whether it is first or last.
        shared = dict(head_loss=head_loss, precision=precision)
        within = pipeline.stage_strategies or [None] * pipeline.stages  # a stage's rules while its programs trace
        self.statics = [
            dict(
                layers=tuple(pipeline.layers[i] for i in layers),
                first=s == 0,
                last=s == last,
                within=within[s % pipeline.stages],
                **shared,
            )  # fmt: skip
            for s, layers in enumerate(pipeline.stage_layers)
        ]
        self.timeline: Timeline | None = None

    def _run(self, state: TrainState, microbatches: list[Batch]) -> tuple[TrainState, dict[str, jax.Array]]:
        pipe, precision = self.pipeline, self.precision
        params = pipe.stage_params(state.params)
        scale = None if precision is None else precision.scale(state.loss_scale)
        grads, outputs, self.timeline = self.passes(params, microbatches, scale)
        losses, auxes = zip(*outputs, strict=True)
        metrics = {"loss": jnp.mean(jnp.stack(losses)), **jax.tree.map(lambda *v: jnp.mean(jnp.stack(v)), *auxes)}
        keep = keep_finite_choice()  # set: a step whose loss is not finite changes nothing (Step.keep_finite)
        loss = None if keep is None else jax.device_put(metrics["loss"], pipe.replicated(0))  # where the counter is
        new_params, opt_states, finite = self._updates(state, params, grads, scale, keep, loss)
        if scale is not None:
            metrics |= {"loss_scale": scale, "grads_finite": finite}
            new_scale = next_scale(precision, state.loss_scale, finite)
            if loss is not None:  # a step whose loss is not finite keeps its scale too
                new_scale = select(jnp.isfinite(loss), new_scale, state.loss_scale)
            state = state.replace(loss_scale=new_scale)
        # Donating the old step counter marks the old state as consumed, which Step checks on every call.
        step = programs.next_step(state.step, loss)
        return state.replace(step=step, params=pipe.layer_params(new_params), opt_state=list(opt_states)), metrics

    def _updates(
        self,
        state: TrainState,
        params: list,
        grads: list,
        scale: jax.Array | None,
        keep: Callable | None = None,
        loss: jax.Array | None = None,
    ) -> tuple:
        """Each stage's update. With a loss ``scale``, each stage's gradients unscaled, and the stages' updates
        all skipped unless every stage's are finite. With ``keep`` (:func:`~parallelkit.core.step.keep_finite_choice`),
        every stage kept as it was when the step's ``loss`` (on stage 0's devices) is not finite.

        Returns ``(params, opt_states, finite)``, ``finite`` on stage 0's devices (where the scale lives), or
        None without a scale.
        """
        pipe = self.pipeline
        stages = range(pipe.model_stages)
        finite, everywhere = None, [None for _ in stages]
        if scale is not None:
            unscaled = [
                programs.unscaled(grads[s], jax.device_put(scale, pipe.replicated(s)), precision=self.precision)
                for s in stages
            ]
            grads = [g for g, _ in unscaled]
            finite = jnp.all(jnp.stack([jax.device_put(f, pipe.replicated(0)) for _, f in unscaled]))
            everywhere = [jax.device_put(finite, pipe.replicated(s)) for s in stages]
        losses = [None if loss is None else jax.device_put(loss, pipe.replicated(s)) for s in stages]
        updated = [
            programs.update(params[s], state.opt_state[s], grads[s], everywhere[s], losses[s], tx=state.tx, keep=keep)
            for s in stages
        ]
        return (*zip(*updated, strict=True), finite)

    def passes(
        self, params: list[list[PyTree]], microbatches: list[Batch], scale: jax.Array | None = None
    ) -> tuple[list, list[tuple], Timeline]:
        """Every forward and backward pass of one step, in the schedule's order, without the update.

        Args:
          params: per stage, its parameters as placed (``pipeline.stage_params(state.params)``);
            read, never donated.
          microbatches: the host slices of :meth:`Pipeline.place_batch`.
          scale: the loss scale the last stage's seed gradient is multiplied by (None: none);
            the gradients returned are then scaled by it.

        Returns:
          ``(grads, outputs, timeline)``: per stage, its gradients summed over the microbatches;
          per microbatch, ``(loss, aux)`` from the last stage; and what the passes recorded.
        """
        pipe, statics = self.pipeline, self.statics
        last = pipe.model_stages - 1
        grads = [self._zero_grads(s, p) for s, p in enumerate(params)]
        stash: list[dict[int, Any]] = [{} for _ in range(pipe.model_stages)]  # each run's inputs, kept for its backward
        held: list[dict[int, Any]] = [{} for _ in range(pipe.model_stages)]  # zb-h1: kept from backward to weight
        outputs: dict[int, tuple] = {}  # microbatch -> (loss, aux) on the last stage
        moved: list[tuple[str, int, int, int]] = []
        seed = jnp.float32(1 / pipe.microbatches)
        seed = jax.device_put(seed if scale is None else seed * scale, pipe.replicated(last))

        def send(what: str, tree: Any, stage: int, m: int, where: Any = None) -> Any:
            """``tree`` placed on ``stage``'s devices (split along the batch unless ``where`` says otherwise), and
            its bytes there recorded."""
            placed = jax.device_put(tree, pipe.split(stage) if where is None else where)
            moved.append((what, stage, m, per_replica_bytes(placed, pipe.stage_devices(stage))))
            return placed

        def task(kind: str, stage: int, m: int, received: Any) -> Any:
            if kind == "forward":  # the first stage reads the batch, the last its labels
                batch = send("batch", microbatches[m], stage, m, where=pipe.batch_placement(stage, microbatches[m]))
                batch = batch if stage in (0, last) else None
                stash[stage][m] = (received, batch)
                out = programs.forward(params[stage], received, batch, **statics[stage])
                if stage == last:
                    outputs[m] = out
                else:
                    out = send("activations", out, stage + 1, m)  # activations move to the next stage
            elif kind == "weight":  # zb-h1: the parameters' gradients, from what the backward pass kept
                kept = held[stage].pop(m)  # the input, batch and cotangent of the backward pass
                grads[stage], out = self._backward(stage, params[stage], *kept, grads[stage], wrt="params")
            else:
                x, batch = stash[stage].pop(m)
                cotangent = seed if stage == last else received
                if self.split_backward:  # the input's gradient now; keep what the weight pass needs
                    held[stage][m] = (x, batch, cotangent)
                    out = programs.backward_input(params[stage], x, batch, cotangent, **statics[stage])
                else:
                    grads[stage], out = self._backward(stage, params[stage], x, batch, cotangent, grads[stage])
                if stage > 0:
                    out = send("gradients", out, stage - 1, m)  # gradients move back up
            jax.block_until_ready((out, grads[stage]))
            return out

        def stashed_bytes(device_stage: int) -> int:
            """What the executor keeps for the runs of layers on one stage's devices: the inputs kept for the
            backward passes, and (zb-h1) what a backward pass keeps for its weight pass."""
            mine = range(device_stage, pipe.model_stages, pipe.stages)
            kept = [v for k in mine for v in (*stash[k].values(), *held[k].values())]
            return per_replica_bytes(kept, pipe.stage_devices(device_stage))

        watched = [pipe.stage_devices(s)[0] for s in range(pipe.stages)]  # whose own memory reading is kept
        timeline = execute(self.orders, task, stashed_bytes, watched, virtual=pipe.virtual)
        timeline.moved = sorted(moved)
        if pipe.data > 1 and pipe.stage_strategies is None:  # each device's own sums, all-reduced once a step
            grads = [programs.reduce_unreduced(g, where=pipe.replicated(s)) for s, g in enumerate(grads)]
        return grads, [outputs[m] for m in range(pipe.microbatches)], timeline

    def _zero_grads(self, stage: int, params: PyTree) -> PyTree:
        """A stage's running sum of gradients at zero: like its parameters, or with ``data > 1`` one row per device."""
        pipe = self.pipeline
        if pipe.data == 1 or pipe.stage_strategies is not None:  # laid out like the parameters
            return jax.tree.map(jnp.zeros_like, params)
        rows = jax.tree.map(lambda p: jnp.zeros((pipe.data, *p.shape), p.dtype), params)
        return jax.device_put(rows, pipe.split(stage))

    def _backward(self, stage: int, *args: Any, wrt: str = "both", lower: bool = False) -> Any:
        """Run ``stage``'s backward program (``wrt="params"``: its weight pass) on ``args``, or with ``lower`` lower it
        for them: with ``data > 1``, :func:`~parallelkit.strategies.pipeline.stages.backward_unreduced`."""
        pipe = self.pipeline
        program, arguments = programs.backward, dict(self.statics[stage], wrt=wrt)
        if pipe.data > 1 and pipe.stage_strategies is None:
            program, arguments["mesh"] = programs.backward_unreduced, pipe.stage_meshes[stage % pipe.stages]
        return (program.lower if lower else program)(*args, **arguments)

    def output_shapes(self, params: list[list[PyTree]], microbatch: Batch) -> list[Any]:
        """Per stage, the shapes of its forward pass's output for one microbatch (``(loss, aux)`` on the last).

        From :func:`jax.eval_shape`: nothing runs.
        """
        shapes, x = [], None
        for s, statics in enumerate(self.statics):
            batch = microbatch if s in (0, self.pipeline.model_stages - 1) else None
            x = jax.eval_shape(partial(programs.forward, **statics), params[s], x, batch)
            shapes.append(x)
        return shapes

    def stage_collectives(self, state: TrainState, microbatch: Batch) -> list[tuple[int, str, Collective]]:
        """``(stage, program, collective)`` for each collective in each stage's compiled programs.

        The programs are ``"forward"``, ``"backward"`` and, under zb-h1, ``"weight"``, lowered for
        one microbatch as the step places it and called ``microbatches`` times a step, and with
        ``data > 1`` ``"reduce"``, the gradients' one all-reduce, called once a step.
        """
        pipe = self.pipeline
        params, last = pipe.stage_params(state.params), pipe.model_stages - 1
        shapes = self.output_shapes(params, microbatch)

        def on(tree: Any, sharding: NamedSharding) -> Any:
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding), tree)

        found = []
        for s, statics in enumerate(self.statics):
            x = None if s == 0 else on(shapes[s - 1], pipe.split(s))
            batch = on(jax.eval_shape(lambda b: b, microbatch), pipe.split(s)) if s in (0, last) else None
            cotangent = on(jnp.float32(0), pipe.replicated(s)) if s == last else on(shapes[s], pipe.split(s))
            grads = self._zero_grads(s, params[s])
            lowered = {"forward": programs.forward.lower(params[s], x, batch, **statics)}
            if self.split_backward:  # zb-h1 runs the input's gradient and the weight pass, not the fused backward
                lowered["backward"] = programs.backward_input.lower(params[s], x, batch, cotangent, **statics)
                lowered["weight"] = self._backward(s, params[s], x, batch, cotangent, grads, wrt="params", lower=True)
            else:
                lowered["backward"] = self._backward(s, params[s], x, batch, cotangent, grads, lower=True)
            if pipe.data > 1 and pipe.stage_strategies is None:
                lowered["reduce"] = programs.reduce_unreduced.lower(grads, where=pipe.replicated(s))
            for kind, program in lowered.items():
                found += [(s, kind, c) for c in parse_collectives(program.compile().as_text())]
        return found

    def _explained(self, err: LossInputError, state: TrainState, batch: Batch) -> LossInputError:
        """The step's explanation, and what a pipeline's loss is: a whole-model loss is the usual mistake."""
        explained = super()._explained(err, state, batch)
        return LossInputError(
            f"{explained} A pipeline's loss is a head loss, head_loss(output, batch) -> loss, called on the last "
            "stage's output (pk.models.cross_entropy is one): the pipeline runs the layers itself, so a whole-model "
            "loss_fn(params, batch), such as pk.models.classifier_loss(apply), does not fit.",
            missing_key=err.missing_key,
        )

    def lower(self, state: TrainState, batch: Batch):
        raise NotImplementedError(
            "A pipeline step is several compiled programs per stage, called from the host in the schedule's "
            "order, not one program to lower: see parallelkit.strategies.pipeline.stages for them, and step.timeline."
        )

    def __repr__(self) -> str:
        return f"PipelineStep({self.pipeline!r})"
