"""Run a schedule for real: one host thread per stage, each working through its own passes in order.

A stage's thread takes its next pass from the schedule, waits until the pass it depends
on (the forward pass above, the backward pass below) has handed over its output, runs
it, blocks until the device has finished, and hands its own output on. The times around
each pass are recorded as :class:`~parallelkit.schedules.Slot` rows: a measured
timeline in seconds from the start of the step, drawn and checked like a computed one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..schedules import Slot, _depends_on, bubble_fraction, peak_in_flight, stage_orders

# task(kind, stage, microbatch, received) -> what the next pass needs; returns once the device is done.
Task = Callable[[str, int, int, Any], Any]


@dataclass
class Timeline:
    """What one executed step did: every pass's start and end, and the activations each stage held.

    Attributes:
      slots: one measured :class:`~parallelkit.schedules.Slot` per pass, in seconds from
        the step's start (``start``: the pass's inputs were there and its stage was free;
        ``end``: its outputs were computed and sent).
      held: ``(time, stage, bytes)`` after every pass: the bytes of stashed activations the
        stage held then, on each of its devices (the arrays themselves, counted).
    """

    slots: list[Slot] = field(default_factory=list)
    held: list[tuple[float, int, int]] = field(default_factory=list)

    def orders(self) -> list[list[tuple[str, int]]]:
        """Per stage, the passes in the order they ran (compare with :func:`~parallelkit.schedules.stage_orders`)."""
        return stage_orders(self.slots)

    def bubble_fraction(self) -> float:
        """The measured share of stage-time spent idle (see :func:`~parallelkit.schedules.bubble_fraction`)."""
        return bubble_fraction(self.slots)

    def peak_in_flight(self) -> dict[int, int]:
        """Per stage, the most microbatches between their forward and backward pass, from the recorded ends."""
        return peak_in_flight(self.slots)

    def peak_held_bytes(self) -> dict[int, int]:
        """Per stage, the most bytes of stashed activations it held at once (on one device)."""
        peaks: dict[int, int] = {}
        for _, stage, held in self.held:
            peaks[stage] = max(peaks.get(stage, 0), held)
        return dict(sorted(peaks.items()))


def execute(orders: Sequence[Sequence[tuple[str, int]]], task: Task, held_bytes: Callable[[int], int]) -> Timeline:
    """Run every stage's passes in its given order, one thread per stage; return the timeline.

    Args:
      orders: per stage, ``(kind, microbatch)`` in the order to run (from
        :func:`~parallelkit.schedules.stage_orders`).
      task: runs one pass and blocks until it is done; it receives what the pass it depends
        on returned (None for a first-stage forward pass) and returns what to hand on.
      held_bytes: ``held_bytes(stage)``, the bytes the stage holds after a pass, for
        :attr:`Timeline.held`.

    Raises:
      Whatever a pass raised: the other stages stop at their next wait instead of hanging.
    """
    stages = len(orders)
    # Each hand-over is a box emptied by its reader, so no array outlives its use here.
    handed: dict[tuple[str, int, int], Future] = {
        (kind, s, m): Future() for s, order in enumerate(orders) for kind, m in order
    }
    timeline = Timeline()
    start_of_step = time.perf_counter()

    def run_stage(stage: int) -> None:
        try:
            for kind, microbatch in orders[stage]:
                after = _depends_on(kind, stage, microbatch, stages)
                received = None if after is None else handed[after].result().pop()
                start = time.perf_counter() - start_of_step
                out = task(kind, stage, microbatch, received)
                end = time.perf_counter() - start_of_step
                timeline.slots.append(Slot(stage, microbatch, start, end, kind))  # list.append is thread-safe
                timeline.held.append((end, stage, held_bytes(stage)))
                handed[kind, stage, microbatch].set_result([out])
        except BaseException as err:
            for box in list(handed.values()):  # wake every stage waiting on a pass that will never come
                try:
                    box.set_exception(err)
                except InvalidStateError:  # already handed over
                    pass
            raise

    with ThreadPoolExecutor(stages, thread_name_prefix="pipeline-stage") as pool:
        runs = [pool.submit(run_stage, s) for s in range(stages)]
    for run in runs:  # the first failure; the others are the same error, handed to the waiting stages
        if run.exception() is not None:
            raise run.exception()
    timeline.slots.sort(key=lambda s: s.start)
    timeline.held.sort()
    return timeline
