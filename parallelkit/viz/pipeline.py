"""A pipeline schedule as a Gantt chart: one row per stage, one bar per forward or backward pass.

>>> from parallelkit.strategies.pipeline.schedules import gpipe_schedule
>>> fig = pipeline_gantt_figure(gpipe_schedule(stages=2, microbatches=2))
>>> [(float(p.get_x()), float(p.get_width())) for p in fig.axes[0].patches[:2]]
[(0.0, 1.0), (1.0, 1.0)]
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..strategies.pipeline.schedules import Slot, bubble_fraction, makespan

COLORS = {"forward": "tab:blue", "backward": "tab:orange"}


def pipeline_gantt_figure(schedule: Sequence[Slot], title: str = "", *, measured: bool = False) -> Figure:
    """Stages down, time across: who computes what when, and the idle bubble between.

    Args:
      schedule: :class:`~parallelkit.strategies.pipeline.schedules.Slot` rows, ``(stage, microbatch, start,
        end, kind)``, e.g. from :func:`parallelkit.strategies.pipeline.schedules.gpipe_schedule`, or a pipeline
        step's measured ``step.timeline.slots``.
      title: drawn above the chart (by default the bubble fraction).
      measured: the times are seconds measured from a real run, drawn in milliseconds
        (by default they are in units of one forward pass).

    Returns:
      The figure; ``fig.axes[0].patches[k]`` is slot ``k``'s bar: from ``start``, as wide
      as ``end - start``, centred on its stage's row; ``fig.axes[0].texts[k]`` is its
      microbatch number.
    """
    scale = 1000 if measured else 1
    schedule = [Slot(s[0], s[1], s[2] * scale, s[3] * scale, s[4]) for s in schedule]
    stages = 1 + max(s.stage for s in schedule)
    width = 10 if measured else min(3 + 0.35 * makespan(schedule), 14)
    fig = Figure(figsize=(width, 1.2 + 0.45 * stages), layout="constrained")
    ax = fig.add_subplot()
    for s in schedule:
        ax.barh(s.stage, s.end - s.start, left=s.start, height=0.8, color=COLORS[s.kind], edgecolor="white")
        ax.text((s.start + s.end) / 2, s.stage, str(s.microbatch), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)], fontsize=8)
    ax.invert_yaxis()  # stage 0 on top, as the data flows down
    ax.set_xlabel(
        "measured time (ms)" if measured else "time (one forward pass of one microbatch on one stage = 1)", fontsize=8
    )
    ax.set_xlim(min(s.start for s in schedule), max(s.end for s in schedule))
    fig.legend([Patch(color=c) for c in COLORS.values()], list(COLORS), fontsize=7, loc="outside right upper")
    micro = 1 + max(s.microbatch for s in schedule)
    ax.set_title(
        title
        or f"{stages} stages, {micro} microbatches: {'measured ' if measured else ''}idle bubble "
        f"{bubble_fraction(schedule):.0%} of stage-time",
        fontsize=9,
    )
    return fig
