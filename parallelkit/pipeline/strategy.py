"""``pk.Pipeline``: the layers cut into stages on their own devices, the batch into microbatches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import schedules
from ..axes import DATA
from ..devices import DeviceCountError
from ..mesh import is_count, make_mesh
from ..strategies.base import Batch, PyTree, Step, Strategy, TrainState, batch_size, check_same_tree
from . import stages as programs
from .executor import Timeline, execute
from .stages import HeadLoss, Layer, split_layers

SCHEDULES: dict[str, Callable[[int, int], list[schedules.Slot]]] = {
    "gpipe": schedules.gpipe_schedule,
    "1f1b": schedules.one_f_one_b_schedule,
}


class Pipeline(Strategy):
    """Pipeline parallelism: stage ``s`` runs its run of layers on its own devices, microbatch by microbatch.

    Conceptually, one step on a global batch cut into ``m`` microbatches::

        for each (stage, microbatch, forward or backward) in the schedule's order:
            forward:  x = stage's layers(x received from the stage above); send x below
            backward: grads[stage] += d loss / d params; send d loss / d x above
        each stage: params[stage] = optimizer update(grads[stage])    # one update per step

    which equals the single-device step on :func:`~parallelkit.pipeline.sequential_loss`
    (the loss of a step is the mean of its microbatches' losses). Each stage's parameters
    and optimizer state live on its own devices only; activations and their gradients
    are copied between the stages' devices. ``schedule`` decides only the order:
    ``"gpipe"`` runs every forward pass, then every backward pass; ``"1f1b"`` alternates
    them, so a stage holds the inputs of at most ``stages - stage`` microbatches instead
    of all ``m``. With ``data > 1`` each stage is a group of ``data`` devices that split
    every microbatch, their gradients all-reduced inside the stage's backward program.

    The optimizer runs stage by stage on that stage's parameters, which equals one update
    of all of them for element-wise optimizers (SGD, momentum, Adam, AdamW, ...) but not
    for transforms that look at every parameter at once, such as ``optax.clip_by_global_norm``.
    Pipelines here take no dropout key and no mutable model state.

    Args:
      layers: ``[apply_0, ..., apply_{L-1}]``, each ``apply_i(params_i, x) -> y``; the first
        receives the (micro)batch as given, each later one the previous output.
        :func:`parallelkit.models.as_layers` gives the kit's MLP and transformer in this form.
      stages: how many stages (groups of devices) the layers are cut into, at most ``L``.
      microbatches: how many microbatches the global batch is cut into; it must divide the batch.
      schedule: ``"gpipe"``, ``"1f1b"``, or a function ``(stages, microbatches) -> list[Slot]``.
      data: devices per stage that split each microbatch (data parallelism on a second axis).
      layers_per_stage: how many layers each stage runs (as even as possible by default).
      devices: ``stages x data`` devices; the first ``stages x data`` by default. Stage ``s``
        gets the ``stage = s`` column of the ``data x stage`` mesh.

    Raises:
      ValueError: counts below 1, an unknown schedule, more stages than layers.
      DeviceCountError: devices that are not ``stages x data`` in number.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        stages: int,
        microbatches: int = 1,
        schedule: str | Callable[[int, int], list[schedules.Slot]] = "gpipe",
        *,
        data: int = 1,
        layers_per_stage: Sequence[int] | None = None,
        devices: Sequence[jax.Device] | None = None,
    ):
        for name, size in (("stages", stages), ("microbatches", microbatches), ("data", data)):
            if not is_count(size):
                raise ValueError(f"Pipeline({name}={size!r}): it must be a whole number >= 1.")
        if not callable(schedule) and schedule not in SCHEDULES:
            raise ValueError(f"Unknown schedule {schedule!r}: use one of {sorted(SCHEDULES)} or a schedule function.")
        self.layers = tuple(layers)
        self.stage_layers = split_layers(len(self.layers), stages, layers_per_stage)
        wanted = stages * data
        if devices is not None and len(devices) != wanted:
            raise DeviceCountError(
                f"Pipeline(stages={stages}, data={data}) runs on stages x data = {wanted} devices, "
                f"but {len(devices)} were given. Pass {wanted} devices (e.g. jax.devices()[:{wanted}]), "
                "or change stages or data so that they multiply to the device count."
            )
        super().__init__(wanted if devices is None else devices)
        self.mesh = make_mesh(self.devices, data=data, stage=stages)
        self.microbatches, self.data = microbatches, data
        self.schedule_name = schedule if isinstance(schedule, str) else getattr(schedule, "__name__", "custom")
        self.schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule

    @property
    def stages(self) -> int:
        return len(self.stage_layers)

    @property
    def num_replicas(self) -> int:
        return self.data

    @cached_property
    def stage_meshes(self) -> list[Mesh]:
        """Stage ``s``'s devices as a one-axis (``data``) mesh."""
        return [Mesh(self.mesh.devices[:, s], (DATA,)) for s in range(self.stages)]

    def replicated(self, stage: int) -> NamedSharding:
        """Where stage ``stage``'s parameters and optimizer state live: a full copy on each of its devices."""
        return NamedSharding(self.stage_meshes[stage], P())

    def split(self, stage: int) -> NamedSharding:
        """Where stage ``stage``'s microbatches and activations live: split over its devices along the batch."""
        return NamedSharding(self.stage_meshes[stage], P(DATA))

    def planned(self) -> list[schedules.Slot]:
        """The computed schedule this pipeline runs (in units of one forward pass), checked."""
        plan = self.schedule(self.stages, self.microbatches)
        schedules.check_schedule(plan)
        return plan

    def stage_params(self, params: Sequence[PyTree]) -> list[list[PyTree]]:
        """The per-layer parameter list cut into per-stage lists."""
        return [list(params[i] for i in layers) for layers in self.stage_layers]

    @staticmethod
    def layer_params(per_stage: Sequence[Sequence[PyTree]]) -> list[PyTree]:
        """The per-stage lists joined back into the per-layer list (stages hold neighbouring layers, in order)."""
        return [p for stage in per_stage for p in stage]

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
            fit, or ``model_state`` / ``rng`` (which pipelines do not take).
        """
        if model_state is not None or rng is not None:
            raise ValueError(
                "Pipeline takes no model_state or rng: its layers are apply(params, x) -> y, without "
                "BatchNorm statistics or dropout keys. Leave them out (the kit's as_layers models have neither)."
            )
        if not isinstance(params, Sequence) or len(params) != len(self.layers):
            got = f"{len(params)} entries" if isinstance(params, Sequence) else type(params).__name__
            raise ValueError(
                f"Pipeline.init needs a list of per-layer parameters, one for each of the {len(self.layers)} "
                f"layers, got {got}. pk.models.as_layers returns the layers and this list together."
            )
        per_stage = self.stage_params(params)
        if opt_state is not None:
            expected = [jax.eval_shape(tx.init, p) for p in per_stage]
            check_same_tree(expected, list(opt_state), what="opt_state", against="[tx.init(stage params), ...]")
        placed, opt_states = [], []
        for s in range(self.stages):
            where = self.replicated(s)
            stage = _placed_copy(per_stage[s], where)
            placed.append(stage)
            if opt_state is None:
                opt_states.append(jax.jit(tx.init, out_shardings=where)(stage))
            else:
                opt_states.append(_placed_copy(opt_state[s], where))
        step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated(0))
        return TrainState(step=step, params=self.layer_params(placed), opt_state=opt_states, tx=tx)

    def place_batch(self, batch: Batch) -> list[Batch]:
        """The global batch as ``microbatches`` host slices (each stage places its own); a clear error if not."""
        pipe, size = self, batch_size(batch)
        if size % pipe.microbatches:
            raise ValueError(
                f"A batch of {size} examples does not split into {pipe.microbatches} equal microbatches. "
                f"Use a batch size divisible by {pipe.microbatches}, or another microbatch count."
            )
        micro = size // pipe.microbatches
        if micro % pipe.data:
            raise ValueError(
                f"A microbatch of {micro} examples does not split over the {pipe.data} devices of a stage. "
                f"Use a batch size divisible by microbatches x data = {pipe.microbatches * pipe.data}."
            )
        return [jax.tree.map(lambda x, m=m: x[m * micro : (m + 1) * micro], batch) for m in range(pipe.microbatches)]

    def step(self, head_loss: HeadLoss) -> PipelineStep:
        """The training step for ``head_loss(output, batch) -> loss or (loss, aux)`` on the last layer's output."""
        return PipelineStep(self, head_loss)

    def traffic(self, loss_fn, state, batch):
        raise NotImplementedError(
            "Pipeline moves activations between stages from the host, outside any one compiled program, "
            "so there is no compiled traffic to read; its step's timeline records every pass instead."
        )

    traffic_pattern = "pipeline"

    def expected_collectives(self, sizes) -> None:
        return None

    def __repr__(self) -> str:
        data = f", data={self.data}" if self.data > 1 else ""
        schedule = f"schedule={self.schedule_name!r}"
        return f"Pipeline(stages={self.stages}, microbatches={self.microbatches}, {schedule}{data})"


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
    ``timeline`` then holds what that call measured (:class:`~parallelkit.pipeline.Timeline`).
    The first call's timeline includes compiling the stages' programs.
    """

    def __init__(self, pipeline: Pipeline, head_loss: HeadLoss):
        super().__init__(self._run, pipeline.place_batch, pipeline)
        self.pipeline, self.head_loss = pipeline, head_loss
        self.orders = schedules.stage_orders(pipeline.planned())
        last = pipeline.stages - 1
        # The static arguments of each stage's programs: its layers, and whether it is first or last.
        self.statics = [
            dict(layers=tuple(pipeline.layers[i] for i in layers), head_loss=head_loss, first=s == 0, last=s == last)
            for s, layers in enumerate(pipeline.stage_layers)
        ]
        self.timeline: Timeline | None = None

    def _run(self, state: TrainState, microbatches: list[Batch]) -> tuple[TrainState, dict[str, jax.Array]]:
        pipe, statics = self.pipeline, self.statics
        last = pipe.stages - 1
        params = pipe.stage_params(state.params)
        grads = [jax.tree.map(jnp.zeros_like, p) for p in params]
        stash: list[dict[int, Any]] = [{} for _ in range(pipe.stages)]  # each stage's inputs kept for its backward
        outputs: dict[int, tuple] = {}  # microbatch -> (loss, aux) on the last stage
        seed = jax.device_put(jnp.float32(1 / pipe.microbatches), pipe.replicated(last))

        def task(kind: str, stage: int, m: int, received: Any) -> Any:
            ends = stage in (0, last)  # the first stage reads the batch, the last its labels
            if kind == "forward":
                batch = jax.device_put(microbatches[m], pipe.split(stage)) if ends else None
                stash[stage][m] = (received, batch)
                out = programs.forward(params[stage], received, batch, **statics[stage])
                if stage == last:
                    outputs[m] = out
                else:
                    out = jax.device_put(out, pipe.split(stage + 1))  # activations move to the next stage
            else:
                x, batch = stash[stage].pop(m)
                cotangent = seed if stage == last else received
                grads[stage], out = programs.backward(
                    params[stage], x, batch, cotangent, grads[stage], **statics[stage]
                )
                if stage > 0:
                    out = jax.device_put(out, pipe.split(stage - 1))  # gradients move back up
            jax.block_until_ready((out, grads[stage]))
            return out

        def held_bytes(stage: int) -> int:
            arrays = jax.tree.leaves(list(stash[stage].values()))
            return sum(max(shard.data.nbytes for shard in x.addressable_shards) for x in arrays)

        self.timeline = execute(self.orders, task, held_bytes)
        new_params, opt_states = zip(
            *(programs.update(params[s], state.opt_state[s], grads[s], tx=state.tx) for s in range(pipe.stages)),
            strict=True,
        )
        losses, auxes = zip(*(outputs[m] for m in range(pipe.microbatches)), strict=True)
        metrics = {"loss": jnp.mean(jnp.stack(losses)), **jax.tree.map(lambda *v: jnp.mean(jnp.stack(v)), *auxes)}
        # Donating the old step counter marks the old state as consumed, which Step checks on every call.
        step = programs.next_step(state.step)
        return state.replace(step=step, params=pipe.layer_params(new_params), opt_state=list(opt_states)), metrics

    def lower(self, state: TrainState, batch: Batch):
        raise NotImplementedError(
            "A pipeline step is several compiled programs per stage, called from the host in the schedule's "
            "order, not one program to lower: see parallelkit.pipeline.stages for them, and step.timeline."
        )

    def __repr__(self) -> str:
        return f"PipelineStep({self.pipeline!r})"
