"""``PipelineStep``: the training step that runs a pipeline's schedule, stage by stage, from the host."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from ...core.contract import LossInputError
from ...core.precision import Precision, next_scale, select
from ...core.state import TrainState
from ...core.step import Step, keep_finite_choice
from ...core.types import Batch, PyTree
from ...measure.inspect import Collective, parse_collectives
from ...measure.traffic import per_replica_bytes
from . import schedules
from . import stages as programs
from .executor import Timeline, execute
from .stages import HeadLoss

if TYPE_CHECKING:
    from .strategy import Pipeline


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
