"""Pipeline schedules as plain data: which stage works on which microbatch, when.

A pipeline cuts the model into ``stages`` (one per device) and the batch into
``microbatches``. A schedule is a list of :class:`Slot` rows, ``(stage, microbatch,
start, end, kind)``, in time units of one stage's forward pass; nothing here needs
JAX, so schedules can be drawn (:func:`parallelkit.viz.pipeline_gantt_figure`) and
checked (:func:`check_schedule`) before any pipeline runs.

>>> slots = gpipe_schedule(stages=2, microbatches=2)
>>> [(s.stage, s.microbatch, s.start, s.end, s.kind) for s in slots[:3]]
[(0, 0, 0, 1, 'forward'), (0, 1, 1, 2, 'forward'), (1, 0, 1, 2, 'forward')]
>>> round(bubble_fraction(slots), 6)  # (stages - 1) / (microbatches + stages - 1)
0.333333
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

KINDS = ("forward", "backward")


class Slot(NamedTuple):
    """One stage busy with one microbatch's forward or backward pass, from ``start`` to ``end``."""

    stage: int
    microbatch: int
    start: float
    end: float
    kind: str  # "forward" or "backward"


def gpipe_schedule(stages: int, microbatches: int, forward: float = 1, backward: float = 2) -> list[Slot]:
    """GPipe (Huang et al., 2019): every microbatch's forward pass, then every backward pass.

    Forward of microbatch ``m`` on stage ``s`` starts at ``(m + s) x forward``: each stage
    passes its activations to the next as soon as it is done. Once the last stage has
    finished the last forward (at ``F = (microbatches + stages - 1) x forward``), the
    backward passes run in reverse, from the last stage and the last microbatch:
    backward ``(s, m)`` starts at ``F + ((microbatches - 1 - m) + (stages - 1 - s)) x backward``.
    Gradients of all microbatches are summed before one optimizer update.

    Args:
      stages: pipeline stages (devices), >= 1.
      microbatches: microbatches per global batch, >= 1.
      forward, backward: time of one stage's forward and backward pass on one microbatch
        (a backward pass costs about twice a forward one).

    Returns:
      The slots, forwards first (by stage, then microbatch), then backwards likewise.

    Raises:
      ValueError: a count below 1 or a duration that is not positive.
    """
    if stages < 1 or microbatches < 1:
        raise ValueError(f"gpipe_schedule needs stages >= 1 and microbatches >= 1, got {stages} and {microbatches}.")
    if forward <= 0 or backward <= 0:
        raise ValueError(f"Pass durations above 0, got forward={forward} and backward={backward}.")
    fwd = [
        Slot(s, m, (m + s) * forward, (m + s + 1) * forward, "forward")
        for s in range(stages)
        for m in range(microbatches)
    ]
    flush = (microbatches + stages - 1) * forward
    bwd = []
    for s in range(stages):
        for m in range(microbatches):
            start = flush + ((microbatches - 1 - m) + (stages - 1 - s)) * backward
            bwd.append(Slot(s, m, start, start + backward, "backward"))
    return fwd + bwd


def makespan(schedule: Sequence[Slot]) -> float:
    """Time from the first slot's start to the last slot's end."""
    return max(s.end for s in schedule) - min(s.start for s in schedule)


def bubble_fraction(schedule: Sequence[Slot]) -> float:
    """The share of stage-time spent idle: ``1 - busy / (stages x makespan)``.

    For GPipe this is ``(stages - 1) / (microbatches + stages - 1)``: more microbatches,
    smaller bubble.
    """
    stages = len({s.stage for s in schedule})
    busy = sum(s.end - s.start for s in schedule)
    return 1 - busy / (stages * makespan(schedule))


def check_schedule(schedule: Sequence[Slot]) -> None:
    """Raise a ValueError if the schedule could not run.

    A valid schedule has one forward and one backward slot per (stage, microbatch), no
    two slots overlapping on a stage, forward ``(s, m)`` after forward ``(s - 1, m)``
    (activations flow down), backward ``(s, m)`` after backward ``(s + 1, m)`` (gradients
    flow up), and the last stage's backward after its own forward.
    """
    slots = {}
    for slot in schedule:
        if slot.kind not in KINDS:
            raise ValueError(f"{slot}: kind must be one of {KINDS}.")
        key = (slot.kind, slot.stage, slot.microbatch)
        if key in slots:
            raise ValueError(f"{slot}: a second {slot.kind} pass of microbatch {slot.microbatch} on stage {slot.stage}")
        slots[key] = slot
    stages = 1 + max(s.stage for s in schedule)
    micro = 1 + max(s.microbatch for s in schedule)
    missing = [(k, s, m) for k in KINDS for s in range(stages) for m in range(micro) if (k, s, m) not in slots]
    if missing:
        raise ValueError(f"Missing (kind, stage, microbatch) slots: {missing[:4]}.")
    for s in range(stages):
        mine = sorted((x for x in schedule if x.stage == s), key=lambda x: x.start)
        for a, b in zip(mine, mine[1:], strict=False):
            if b.start < a.end:
                raise ValueError(f"Stage {s} runs {a} and {b} at once.")
    for (kind, s, m), slot in slots.items():
        before = (
            slots.get(("forward", s - 1, m))
            if kind == "forward"
            else slots[("forward", s, m)]
            if s == stages - 1
            else slots[("backward", s + 1, m)]
        )
        if before is not None and slot.start < before.end:
            raise ValueError(f"{slot} starts before {before} ends, which it depends on.")
