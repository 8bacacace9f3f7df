"""Run a schedule for real: one host thread per stage, its passes in order, timed into a :class:`Timeline`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax

from .schedules import Slot, bubble_fraction, depends_on, model_stage, peak_in_flight, stage_orders

# task(kind, stage, microbatch, received) -> what the next pass needs; returns once the device is done.
Task = Callable[[str, int, int, Any], Any]


@dataclass
class Timeline:
    """What one executed step did: every pass's start and end, and the activations each stage held.

    Attributes:
      slots: one measured :class:`~parallelkit.strategies.pipeline.schedules.Slot` per pass, in seconds from
        the step's start (``start``: the pass's inputs were there and its stage was free;
        ``end``: its outputs were computed and sent).
      stashed: ``(time, stage, bytes)`` after every pass: the bytes of the activations the
        executor keeps for the stage's backward passes, on each of the stage's devices. This
        is bookkeeping (the sizes of the arrays in its stash, added up), not a reading of
        device memory.
      in_use: ``(time, stage, bytes)`` after every pass: the bytes in use on the stage's
        first device, as the device reports them (``memory_stats()["bytes_in_use"]``: all of
        its arrays, parameters and gradients included; GPUs and TPUs report it). Empty where the
        backend reports no memory statistics, as the CPU backend does (so on simulated devices).
      moved: ``(what, stage, microbatch, bytes)`` for every array handed to a stage's devices:
        ``what`` is ``"batch"`` (the microbatch, to the first and last stage), ``"activations"``
        (from the stage above) or ``"gradients"`` (from the stage below); ``bytes`` are those
        of the array as placed, on each receiving device. Recorded by the caller's task:
        :func:`execute` leaves it empty.
    """

    slots: list[Slot] = field(default_factory=list)
    stashed: list[tuple[float, int, int]] = field(default_factory=list)
    in_use: list[tuple[float, int, int]] = field(default_factory=list)
    moved: list[tuple[str, int, int, int]] = field(default_factory=list)

    def orders(self) -> list[list[tuple]]:
        """Per stage, the passes in the order they ran (compare with :func:`~.schedules.stage_orders`)."""
        return stage_orders(self.slots)

    def bubble_fraction(self) -> float:
        """The measured share of stage-time spent idle (see :func:`.schedules.bubble_fraction`)."""
        return bubble_fraction(self.slots)

    def peak_in_flight(self) -> dict[int, int]:
        """Per stage, the most microbatches between their forward and backward pass, from the recorded ends."""
        return peak_in_flight(self.slots)

    def peak_stashed_bytes(self) -> dict[int, int]:
        """Per stage, the most bytes of activations the executor's stash kept at once (per device; bookkeeping)."""
        return _peaks(self.stashed)

    def peak_in_use_bytes(self) -> dict[int, int] | None:
        """Per stage, the most bytes in use its first device reported after a pass; None where none are reported."""
        return _peaks(self.in_use) if self.in_use else None


def _peaks(rows: Sequence[tuple[float, int, int]]) -> dict[int, int]:
    peaks: dict[int, int] = {}
    for _, stage, nbytes in rows:
        peaks[stage] = max(peaks.get(stage, 0), nbytes)
    return dict(sorted(peaks.items()))


def device_bytes_in_use(device: jax.Device) -> int | None:
    """The bytes in use on ``device`` as its backend reports them; None where it reports none (the CPU backend)."""
    stats = device.memory_stats()
    return None if not stats or "bytes_in_use" not in stats else int(stats["bytes_in_use"])


def execute(
    orders: Sequence[Sequence[tuple]],
    task: Task,
    stashed_bytes: Callable[[int], int],
    devices: Sequence[jax.Device] | None = None,
    virtual: int = 1,
) -> Timeline:
    """Run every stage's passes in its given order, one thread per stage; return the timeline.

    Args:
      orders: per stage, ``(kind, microbatch)`` or ``(kind, microbatch, chunk)`` in the order
        to run (from :func:`~.schedules.stage_orders`).
      task: runs one pass and blocks until it is done. It is called as ``task(kind,
        model_stage, microbatch, received)``: the run of layers (chunk ``c`` of stage ``s`` is
        run ``c x stages + s``, :func:`~.schedules.model_stage`; with one chunk per stage, the
        stage), and what the pass it depends on returned (None for the model's first forward
        pass and for a weight pass); it returns what to hand on.
      stashed_bytes: ``stashed_bytes(stage)``, the bytes the stage's stash keeps after a pass,
        for :attr:`Timeline.stashed`.
      devices: each stage's first device, whose own memory reading goes into
        :attr:`Timeline.in_use` after every pass (where its backend reports one).
      virtual: chunks of layers per stage (an interleaved schedule's).

    Raises:
      Whatever a pass raised: the other stages stop at their next wait instead of hanging.
    """
    stages = len(orders)
    passes = [[(item[0], item[1], item[2] if len(item) > 2 else 0) for item in order] for order in orders]
    # Each hand-over is a box emptied by its reader, so no array outlives its use here.
    handed: dict[tuple[str, int, int, int], Future] = {
        (kind, s, m, c): Future() for s, order in enumerate(passes) for kind, m, c in order if kind != "weight"
    }
    timeline = Timeline()
    start_of_step = time.perf_counter()
    failures: list[BaseException] = []  # in the order they happened: the first is the step's error

    def run_stage(stage: int) -> None:
        try:
            for kind, microbatch, chunk in passes[stage]:
                after = depends_on(kind, stage, microbatch, stages, chunk, virtual)
                received = None if after is None else handed[after].result().pop()
                start = time.perf_counter() - start_of_step
                out = task(kind, model_stage(stage, chunk, stages), microbatch, received)
                end = time.perf_counter() - start_of_step
                timeline.slots.append(Slot(stage, microbatch, start, end, kind, chunk))  # list.append is thread-safe
                timeline.stashed.append((end, stage, stashed_bytes(stage)))
                if devices is not None and (in_use := device_bytes_in_use(devices[stage])) is not None:
                    timeline.in_use.append((end, stage, in_use))
                if kind == "weight":  # nothing waits for a weight pass
                    continue
                try:
                    handed[kind, stage, microbatch, chunk].set_result([out])
                except InvalidStateError:  # another stage failed and closed every box: stop here
                    return
        except BaseException as err:
            failures.append(err)
            for box in list(handed.values()):  # wake every stage waiting on a pass that will never come
                try:
                    box.set_exception(err)
                except InvalidStateError:  # already handed over
                    pass
            raise

    with ThreadPoolExecutor(stages, thread_name_prefix="pipeline-stage") as pool:
        for run in [pool.submit(run_stage, s) for s in range(stages)]:
            run.exception()  # wait; a stage's error is in failures
    if failures:  # the first failure; the stages that waited on it received the same error
        raise failures[0]
    timeline.slots.sort(key=lambda s: s.start)
    timeline.stashed.sort()
    timeline.in_use.sort()
    return timeline
