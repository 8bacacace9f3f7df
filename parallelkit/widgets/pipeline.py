"""``PipelineExplorer``: sliders for stages and microbatches, each change a real pipeline run, drawn."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import jax
import optax

from ..core.contract import Batch, batch_size
from ..strategies.pipeline import Pipeline, Timeline
from ..strategies.pipeline.stages import HeadLoss, Layer
from .dashboard import in_notebook


def measured_summary(pipe: Pipeline, timeline: Timeline) -> str:
    """One line: the measured bubble beside GPipe's formula, and the most microbatches each stage held."""
    p, m = pipe.stages, pipe.microbatches
    return (
        f"{pipe!r}: measured bubble {timeline.bubble_fraction():.0%}, formula (p-1)/(m+p-1) = "
        f"{(p - 1) / (m + p - 1):.0%}; microbatches held per stage {list(timeline.peak_in_flight().values())}"
    )


class PipelineExplorer:
    """Choose stages, microbatches and schedule; each choice trains one real step and draws its timeline.

    Every redraw builds a :class:`~parallelkit.Pipeline` on the first ``stages`` devices,
    runs one step to compile and a second to measure, and draws the second step's
    timeline with :func:`parallelkit.viz.pipeline_gantt_figure`. Outside a notebook,
    displaying it prints :func:`measured_summary` for the current choice instead.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        params: Sequence[Any],
        head_loss: HeadLoss,
        batch: Batch,
        tx: optax.GradientTransformation | None = None,
        *,
        max_microbatches: int = 8,
    ):
        self.layers, self.params, self.head_loss, self.batch = list(layers), list(params), head_loss, batch
        self.tx = tx or optax.sgd(0.1)
        self.max_stages = min(len(self.layers), len(jax.devices()))
        size = batch_size(batch)
        self.microbatch_choices = [m for m in range(1, max_microbatches + 1) if size % m == 0]
        self._widgets = None

    def run(self, stages: int, microbatches: int, schedule: str) -> tuple[Pipeline, Timeline]:
        """A pipeline of this shape, and the timeline of its second step (the first compiles)."""
        pipe = Pipeline(self.layers, stages, microbatches, schedule, devices=jax.devices()[:stages])
        step, state = pipe.step(self.head_loss), pipe.init(self.params, self.tx)
        for _ in range(2):
            state, _ = step(state, self.batch)
        return pipe, step.timeline

    @property
    def widget(self):
        if self._widgets is None:
            import ipywidgets as w

            from ..viz.pipeline import pipeline_gantt_figure

            stages = w.IntSlider(min(2, self.max_stages), 1, self.max_stages, description="stages")
            micro = w.SelectionSlider(options=self.microbatch_choices, value=self.microbatch_choices[-1])
            micro.description = "microbatches"
            schedule = w.ToggleButtons(options=["gpipe", "1f1b"], value="gpipe", description="schedule")
            label = w.HTML().add_class("pk-pipeline-label")
            image = w.Image(format="png").add_class("pk-pipeline-image")

            def redraw(_=None):
                pipe, timeline = self.run(stages.value, micro.value, schedule.value)
                label.value = measured_summary(pipe, timeline)
                buffer = io.BytesIO()
                pipeline_gantt_figure(timeline.slots, measured=True).savefig(buffer, format="png", dpi=80)
                image.value = buffer.getvalue()

            for control in (stages, micro, schedule):
                control.observe(redraw, "value")
            redraw()
            self._widgets = w.VBox([w.HBox([stages, micro]), schedule, label, image]).add_class("pk-pipeline")
        return self._widgets

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if in_notebook():
            display(self.widget)
        else:
            stages = min(2, self.max_stages)
            print(measured_summary(*self.run(stages, self.microbatch_choices[-1], "gpipe")))
