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


def _check_counts(stages: int, microbatches: int, forward: float, backward: float) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"A pipeline needs stages >= 1 and microbatches >= 1, got {stages} and {microbatches}.")
    if forward <= 0 or backward <= 0:
        raise ValueError(f"Pass durations above 0, got forward={forward} and backward={backward}.")


def depends_on(kind: str, stage: int, microbatch: int, stages: int) -> tuple[str, int, int] | None:
    """The ``(kind, stage, microbatch)`` pass that must end before this one starts (None: the first forward).

    Activations flow down (forward ``s`` after forward ``s - 1``), gradients flow up
    (backward ``s`` after backward ``s + 1``), and the last stage's backward follows its
    own forward.
    """
    if kind == "forward":
        return None if stage == 0 else ("forward", stage - 1, microbatch)
    return ("forward", stage, microbatch) if stage == stages - 1 else ("backward", stage + 1, microbatch)


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
    _check_counts(stages, microbatches, forward, backward)
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


def one_f_one_b_schedule(stages: int, microbatches: int, forward: float = 1, backward: float = 2) -> list[Slot]:
    """1F1B (PipeDream-Flush; Narayanan et al., 2021): each stage alternates forward and backward passes.

    Stage ``s`` first runs ``min(stages - 1 - s, microbatches)`` forward passes (the
    warm-up), then alternates one forward and one backward pass, then runs the remaining
    backward passes (the cool-down). Each pass starts as soon as its stage is free and the
    pass it depends on has ended (the forward on the stage above, the backward on the stage
    below). The bubble is GPipe's, but a stage never holds the activations of more than
    ``stages - s`` microbatches at once, where GPipe's hold all of them
    (:func:`peak_in_flight`).

    Args and Raises: as :func:`gpipe_schedule`.

    Returns:
      The slots, forwards first (by stage, then microbatch), then backwards likewise.
    """
    _check_counts(stages, microbatches, forward, backward)
    orders = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        order = [("forward", m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            order += [("forward", warmup + m), ("backward", m)]
        orders.append(order + [("backward", m) for m in range(microbatches - warmup, microbatches)])
    ends: dict[tuple[str, int, int], float] = {}
    free, position, slots = [0.0] * stages, [0] * stages, []
    while len(slots) < 2 * stages * microbatches:
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            kind, m = orders[s][position[s]]
            after = depends_on(kind, s, m, stages)
            if after is not None and after not in ends:
                continue  # waits for another stage
            ready = 0.0 if after is None else ends[after]
            start = max(free[s], ready)
            end = start + (forward if kind == "forward" else backward)
            slots.append(Slot(s, m, start, end, kind))
            ends[kind, s, m], free[s], position[s], progressed = end, end, position[s] + 1, True
        assert progressed, "1F1B order deadlocked"  # cannot happen: each wait is on an earlier pass
    return sorted(slots, key=lambda x: (KINDS.index(x.kind), x.stage, x.microbatch))


def peak_in_flight(schedule: Sequence[Slot]) -> dict[int, int]:
    """Per stage, the most microbatches whose forward pass has ended and backward pass has not.

    Each such microbatch's activations are held for its backward pass, so this counts the
    activation memory a stage needs, in microbatches: ``microbatches`` for GPipe, at most
    ``stages - stage`` for 1F1B.

    >>> peak_in_flight(gpipe_schedule(2, 4)), peak_in_flight(one_f_one_b_schedule(2, 4))
    ({0: 4, 1: 4}, {0: 2, 1: 1})
    """
    peaks = {}
    for stage in sorted({s.stage for s in schedule}):
        events = sorted(
            (slot.end, 1) if slot.kind == "forward" else (slot.end, -1) for slot in schedule if slot.stage == stage
        )
        held = peak = 0
        for _, change in events:
            held += change
            peak = max(peak, held)
        peaks[stage] = peak
    return peaks


def stage_orders(schedule: Sequence[Slot]) -> list[list[tuple[str, int]]]:
    """Per stage, its passes in the order they run: ``[[(kind, microbatch), ...], ...]``.

    What an executor needs from a schedule (:class:`parallelkit.Pipeline` runs each
    stage's list in turn); also how an executed timeline is compared with the plan.

    >>> stage_orders(one_f_one_b_schedule(2, 2))[0]
    [('forward', 0), ('forward', 1), ('backward', 0), ('backward', 1)]
    """
    stages = 1 + max(s.stage for s in schedule)
    return [
        [(s.kind, s.microbatch) for s in sorted((x for x in schedule if x.stage == stage), key=lambda x: x.start)]
        for stage in range(stages)
    ]


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
        after = depends_on(kind, s, m, stages)
        before = None if after is None else slots[after]
        if before is not None and slot.start < before.end:
            raise ValueError(f"{slot} starts before {before} ends, which it depends on.")
