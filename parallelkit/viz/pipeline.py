"""A pipeline schedule as a Gantt chart, and the live :class:`PipelineExplorer`.

>>> from parallelkit.strategies.pipeline.schedules import gpipe_schedule
>>> fig = pipeline_gantt_figure(gpipe_schedule(stages=2, microbatches=2))
>>> [(float(p.get_x()), float(p.get_width())) for p in fig.axes[0].patches[:2]]
[(0.0, 1.0), (1.0, 1.0)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..core.contract import batch_size
from ..core.types import Batch
from ..strategies.pipeline import Pipeline, Timeline
from ..strategies.pipeline.schedules import Slot, bubble_fraction, makespan
from ..strategies.pipeline.stages import HeadLoss, Layer
from .dashboard import Explorer
from .placement import png

COLORS = {"forward": "tab:blue", "backward": "tab:orange", "weight": "tab:green"}
_HATCHES = ("", "//", "..", "xx")  # a stage's chunks of layers (an interleaved schedule's), told apart


def pipeline_gantt_figure(schedule: Sequence[Slot], title: str = "", *, measured: bool = False) -> Figure:
    """Stages down, time across: who computes what when, and the idle bubble between.

    Args:
      schedule: :class:`~parallelkit.strategies.pipeline.schedules.Slot` rows, ``(stage, microbatch, start,
        end, kind, chunk)``, e.g. from :func:`parallelkit.strategies.pipeline.schedules.gpipe_schedule`, or a
        pipeline step's measured ``step.timeline.slots``; a weight pass (zero bubble) is drawn green and a
        stage's later chunks of layers (an interleaved schedule's) hatched.
      title: drawn above the chart (by default the bubble fraction).
      measured: the times are seconds measured from a real run, drawn in milliseconds
        (by default they are in units of one forward pass).

    Returns:
      The figure; ``fig.axes[0].patches[k]`` is slot ``k``'s bar: from ``start``, as wide
      as ``end - start``, centred on its stage's row; ``fig.axes[0].texts[k]`` is its
      microbatch number.
    """
    scale = 1000 if measured else 1
    schedule = [s._replace(start=s.start * scale, end=s.end * scale) for s in map(Slot._make, schedule)]
    stages = 1 + max(s.stage for s in schedule)
    width = 10 if measured else min(3 + 0.35 * makespan(schedule), 14)
    fig = Figure(figsize=(width, 1.2 + 0.45 * stages), layout="constrained")
    ax = fig.add_subplot()
    for s in schedule:
        ax.barh(s.stage, s.end - s.start, left=s.start, height=0.8, color=COLORS[s.kind], edgecolor="white",
                hatch=_HATCHES[s.chunk % len(_HATCHES)])  # fmt: skip
        ax.text((s.start + s.end) / 2, s.stage, str(s.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)], fontsize=8)
    ax.invert_yaxis()  # stage 0 on top, as the data flows down
    ax.set_xlabel(
        "measured time (ms)" if measured else "time (one forward pass of one microbatch on one stage = 1)", fontsize=8
    )
    ax.set_xlim(min(s.start for s in schedule), max(s.end for s in schedule))
    kinds = [k for k in COLORS if any(s.kind == k for s in schedule)]
    fig.legend([Patch(color=COLORS[k]) for k in kinds], kinds, fontsize=7, loc="outside right upper")
    micro = 1 + max(s.microbatch for s in schedule)
    ax.set_title(
        title
        or f"{stages} stages, {micro} microbatches: {'measured ' if measured else ''}idle bubble "
        f"{bubble_fraction(schedule):.0%} of stage-time",
        fontsize=9,
    )
    return fig


def _measured_summary(pipe: Pipeline, timeline: Timeline) -> str:
    """One line: the measured bubble beside GPipe's formula, and the most microbatches each stage held."""
    p, m = pipe.stages, pipe.microbatches
    return (
        f"{pipe!r}: measured bubble {timeline.bubble_fraction():.0%}, formula (p-1)/(m+p-1) = "
        f"{(p - 1) / (m + p - 1):.0%}; microbatches held per stage {list(timeline.peak_in_flight().values())}"
    )


class PipelineExplorer(Explorer):
    """Choose stages, microbatches and schedule; each choice trains one real step and draws its timeline.

    Every redraw builds a :class:`~parallelkit.Pipeline` on the first ``stages`` devices,
    runs one step to compile and a second to measure, and draws the second step's
    timeline with :func:`parallelkit.viz.pipeline_gantt_figure`. Outside a notebook,
    displaying it prints :func:`_measured_summary` for the current choice instead.
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

    def run(self, stages: int, microbatches: int, schedule: str, virtual: int = 1) -> tuple[Pipeline, Timeline]:
        """A pipeline of this shape, and the timeline of its second step (the first compiles)."""
        pipe = Pipeline(self.layers, stages, microbatches, schedule, virtual=virtual, devices=jax.devices()[:stages])
        step, state = pipe.step(self.head_loss), pipe.init(self.params, self.tx)
        for _ in range(2):
            state, _ = step(state, self.batch)
        return pipe, step.timeline

    def _build(self):
        import ipywidgets as w

        stages = w.IntSlider(min(2, self.max_stages), 1, self.max_stages, description="stages")
        micro = w.SelectionSlider(options=self.microbatch_choices, value=self.microbatch_choices[-1])
        micro.description = "microbatches"
        schedule = w.ToggleButtons(options=["gpipe", "1f1b", "zb-h1"], value="gpipe", description="schedule")
        label = w.HTML().add_class("pk-pipeline-label")
        image = w.Image(format="png").add_class("pk-pipeline-image")

        def redraw(_=None):
            pipe, timeline = self.run(stages.value, micro.value, schedule.value)
            label.value = _measured_summary(pipe, timeline)
            image.value = png(pipeline_gantt_figure(timeline.slots, measured=True))

        for control in (stages, micro, schedule):
            control.observe(redraw, "value")
        redraw()
        return w.VBox([w.HBox([stages, micro]), schedule, label, image]).add_class("pk-pipeline")

    def _text(self) -> str:
        return _measured_summary(*self.run(min(2, self.max_stages), self.microbatch_choices[-1], "gpipe"))
