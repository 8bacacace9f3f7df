"""``pk.Pipeline``: the layers cut into stages on their own devices, the batch into microbatches."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property, lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.accumulate import refuse_accumulation
from ...core.contract import batch_size, guard_inputs
from ...core.devices import DeviceCountError, first_devices
from ...core.mesh import make_mesh, outside_callers_mesh
from ...core.precision import Precision, check_precision
from ...core.reports import StepTraffic
from ...core.state import TrainState, check_same_tree
from ...core.types import DATA, Batch, PyTree, is_count
from ..base import Strategy, refuse_explicit
from ..parallel import MESH_AXES, Parallel
from ..split_update import check_update_splits
from . import schedules
from .stages import HeadLoss, Layer, split_layers
from .step import PipelineStep
from .traffic import pipeline_traffic

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
      (:func:`~parallelkit.strategies.split_update.check_update_splits`);
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
        inside = {MESH_AXES[axis]: self.stage_axes[axis] for axis in MESH_AXES if self.stage_axes.get(axis, 1) > 1}
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
            over, axes = ("devices", "data") if self.stage_strategies is None else ("replicas", "replicas")
            raise ValueError(
                f"A microbatch of {micro} examples does not split over the {replicas} {over} of a stage. "
                f"Use a batch size divisible by microbatches x {axes} = {self.microbatches * replicas}."
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
        return pipeline_traffic(self, loss_fn, state, batch)

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


_STAGE_KEYWORDS = ("tensor", "sequence_parallel", "context", "context_method", "expert", "zero", "recompute")


def _checked_stage_axes(stage_axes: Mapping[str, Any] | None) -> dict[str, Any]:
    """``stage_axes`` as a dict without its defaults; a clear error for a keyword a stage does not take."""
    given = dict(stage_axes or {})
    if unknown := sorted(set(given) - set(_STAGE_KEYWORDS)):
        what = "'data' is Pipeline's own data=" if "data" in unknown else f"{unknown[0]!r} is not one of them"
        raise ValueError(
            f"Pipeline(stage_axes={given}): a stage takes pk.Parallel's keywords {_STAGE_KEYWORDS}; {what}."
        )
    splits = any(given.get(key, 1) > 1 for key in MESH_AXES) or given.get("zero", 0) or given.get("sequence_parallel")
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


def _placed_copy(tree: PyTree, sharding: NamedSharding) -> PyTree:
    """A copy of ``tree`` on ``sharding``, never sharing a buffer with the caller's arrays (the step donates it).

    ``jax.device_put(..., may_alias=False)`` is not enough: replicating an array onto
    several devices, its own among them, reuses its buffer there (JAX 0.10.2).
    """
    return jax.device_put(jax.tree.map(lambda x: jnp.array(x, copy=True), tree), sharding)
