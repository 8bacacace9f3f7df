"""Pipeline schedules as plain data (:class:`Slot` rows): GPipe, 1F1B, interleaved and zero bubble.

>>> slots = gpipe_schedule(stages=2, microbatches=2)
>>> [(s.stage, s.microbatch, s.start, s.end, s.kind) for s in slots[:3]]
[(0, 0, 0, 1, 'forward'), (0, 1, 1, 2, 'forward'), (1, 0, 1, 2, 'forward')]
>>> round(bubble_fraction(slots), 6)  # (stages - 1) / (microbatches + stages - 1)
0.333333
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

KINDS = ("forward", "backward", "weight")


class Slot(NamedTuple):
    """One stage busy with one microbatch's pass, from ``start`` to ``end``.

    ``kind`` is ``"forward"``, ``"backward"`` (the whole backward pass, or only the input's
    gradient where the schedule has ``"weight"`` passes) or ``"weight"`` (the parameters'
    gradients). ``chunk`` is which of the stage's chunks of layers ran: always 0 but in an
    interleaved schedule, whose stage ``s`` runs the model's stages ``s``, ``s + stages``, ...
    (:func:`model_stage`).
    """

    stage: int
    microbatch: int
    start: float
    end: float
    kind: str
    chunk: int = 0


def model_stage(stage: int, chunk: int, stages: int) -> int:
    """Which of the model's ``stages x virtual`` runs of layers chunk ``chunk`` of ``stage`` is.

    >>> [model_stage(s, c, stages=2) for c in (0, 1) for s in (0, 1)]  # device 0: runs 0 and 2
    [0, 1, 2, 3]
    """
    return chunk * stages + stage


def _check_counts(stages: int, microbatches: int, forward: float, backward: float) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"A pipeline needs stages >= 1 and microbatches >= 1, got {stages} and {microbatches}.")
    if forward <= 0 or backward <= 0:
        raise ValueError(f"Pass durations above 0, got forward={forward} and backward={backward}.")


def depends_on(
    kind: str, stage: int, microbatch: int, stages: int, chunk: int = 0, virtual: int = 1
) -> tuple[str, int, int, int] | None:
    """The ``(kind, stage, microbatch, chunk)`` pass whose output this one receives (None: none).

    Activations flow down the model's stages (a forward after the forward above), gradients
    flow up (a backward after the backward below), and the model's last stage starts its
    backward from its own forward. A ``"weight"`` pass receives nothing: it follows its own
    stage's backward pass of the same microbatch, which :func:`check_schedule` checks.
    """
    k, last = model_stage(stage, chunk, stages), stages * virtual - 1
    if kind == "weight" or (kind == "forward" and k == 0):
        return None
    if kind == "backward" and k == last:
        return ("forward", stage, microbatch, chunk)
    k += -1 if kind == "forward" else 1
    return (kind, k % stages, microbatch, k // stages)


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

    Args, Returns and Raises: as :func:`gpipe_schedule`.
    """
    _check_counts(stages, microbatches, forward, backward)
    orders = [_one_f_one_b_order(min(stages - 1 - s, microbatches), microbatches) for s in range(stages)]
    return timed(orders, {"forward": forward, "backward": backward})


def _one_f_one_b_order(warmup: int, total: int, numbered=lambda kind, k: (kind, k, 0)) -> list[tuple[str, int, int]]:
    """A stage's 1F1B order of ``total`` passes of each kind: ``warmup`` forward passes, then one forward and one
    backward in turn, then the backward passes left. Pass ``k`` of a kind is ``numbered(kind, k)``, its
    ``(kind, microbatch, chunk)``: by default microbatch ``k`` of chunk 0 (stage ``s`` of plain 1F1B warms up
    with ``stages - 1 - s``)."""
    order = [numbered("forward", k) for k in range(warmup)]
    for j in range(total - warmup):
        order += [numbered("forward", warmup + j), numbered("backward", j)]
    return order + [numbered("backward", j) for j in range(total - warmup, total)]


def interleaved_schedule(
    stages: int, microbatches: int, virtual: int = 2, forward: float = 1, backward: float = 2
) -> list[Slot]:
    """Interleaved 1F1B (Narayanan et al., 2021; Megatron-LM's virtual pipeline stages).

    The model is cut into ``stages x virtual`` runs of layers and stage ``s`` holds runs
    ``s, s + stages, s + 2 stages, ...`` (its ``virtual`` chunks), so a microbatch crosses every
    stage ``virtual`` times and each pass of a chunk takes ``1 / virtual`` of a stage's pass.
    The fill and drain then take ``virtual`` times less time, and the bubble falls from
    1F1B's ``(stages - 1) / (microbatches + stages - 1)`` to ``(stages - 1) / (virtual x
    microbatches + stages - 1)``, at the price of ``virtual`` times as many hand-overs
    between stages. Each stage runs Megatron's order: microbatches in groups of ``stages``,
    each group through chunk 0, then chunk 1, ...; ``(stages - 1 - s) x 2 + (virtual - 1) x
    stages`` forward passes as its warm-up, then one forward and one backward in turn.

    Args:
      stages, microbatches, forward, backward: as :func:`gpipe_schedule`, the durations those
        of a whole stage (each chunk takes ``1 / virtual`` of them).
      virtual: chunks per stage, >= 1 (1 is :func:`one_f_one_b_schedule`).

    Raises:
      ValueError: as :func:`gpipe_schedule`, or ``virtual`` below 1, or (with ``virtual > 1``)
        microbatches that are not a multiple of ``stages`` (as Megatron requires).

    >>> slots = interleaved_schedule(2, 4, virtual=2)
    >>> sorted({(s.stage, s.chunk) for s in slots})  # each stage runs two chunks
    [(0, 0), (0, 1), (1, 0), (1, 1)]
    >>> round(bubble_fraction(slots), 4), round(1 / (2 * 4 + 1), 4)
    (0.1111, 0.1111)
    """
    _check_counts(stages, microbatches, forward, backward)
    if not (isinstance(virtual, int) and virtual >= 1):
        raise ValueError(f"interleaved_schedule(virtual={virtual!r}): chunks per stage, a whole number >= 1.")
    if virtual == 1:
        return one_f_one_b_schedule(stages, microbatches, forward, backward)
    if microbatches % stages:
        raise ValueError(
            f"An interleaved schedule takes microbatches in groups of stages: {microbatches} microbatches "
            f"over {stages} stages leave a group short. Use a multiple of {stages} microbatches."
        )
    group, total = stages * virtual, microbatches * virtual  # passes of each kind per stage

    def chunk(k: int, kind: str) -> int:
        c = (k % group) // stages
        return c if kind == "forward" else virtual - 1 - c

    def numbered(kind: str, k: int) -> tuple[str, int, int]:
        return (kind, (k // group) * stages + k % stages, chunk(k, kind))

    warmups = [min((stages - 1 - s) * 2 + (virtual - 1) * stages, total) for s in range(stages)]
    orders = [_one_f_one_b_order(warmup, total, numbered) for warmup in warmups]
    return timed(orders, {"forward": forward / virtual, "backward": backward / virtual}, virtual)


def zero_bubble_schedule(stages: int, microbatches: int, forward: float = 1, backward: float = 2) -> list[Slot]:
    """ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism"): a third of 1F1B's idle time, its peak memory.

    Each backward pass is split in two, each taking half of ``backward``: ``"backward"``,
    the gradient of the stage's input, which the stage above waits for, and ``"weight"``,
    the gradient of its parameters, which nobody waits for. Stage ``s`` runs 1F1B's order
    with the input's gradient as its backward pass, and the weight pass of microbatch
    ``j - s`` after the backward pass of microbatch ``j``: the later the stage, the longer
    it defers them, so the weight passes fill the gaps where 1F1B's stages wait for the
    gradients from below; the ones left run at the end. With ``microbatches >= stages`` the
    idle time per stage is ``(stages - 1) x forward`` where 1F1B's is ``(stages - 1) x
    (forward + backward)``. A microbatch's activations are held until its weight pass, so
    every stage holds up to ``stages`` microbatches at once: as many as 1F1B's first stage,
    so the peak is 1F1B's (as Qi et al. designed it) and only the later stages hold more.

    Args and Raises: as :func:`gpipe_schedule`.

    >>> slots = zero_bubble_schedule(4, 8)
    >>> round(bubble_fraction(slots), 3), round(3 / (3 * 8 + 3), 3)  # (stages - 1) / (3 m + stages - 1)
    (0.111, 0.111)
    >>> round(bubble_fraction(one_f_one_b_schedule(4, 8)), 3)
    0.273
    >>> peak_in_flight(slots), peak_in_flight(one_f_one_b_schedule(4, 8))
    ({0: 4, 1: 4, 2: 4, 3: 4}, {0: 4, 1: 3, 2: 2, 3: 1})
    """
    _check_counts(stages, microbatches, forward, backward)
    orders = []
    for s in range(stages):
        order = []
        for kind, m, chunk in _one_f_one_b_order(min(stages - 1 - s, microbatches), microbatches):
            order.append((kind, m, chunk))
            if kind == "backward" and m >= s:  # the weight pass of microbatch m - s
                order.append(("weight", m - s, chunk))
        orders.append(order + [("weight", m, 0) for m in range(max(microbatches - s, 0), microbatches)])
    return timed(orders, {"forward": forward, "backward": backward / 2, "weight": backward / 2})


def timed(
    orders: Sequence[Sequence[tuple[str, int, int]]], durations: dict[str, float], virtual: int = 1
) -> list[Slot]:
    """Each stage's passes in its ``(kind, microbatch, chunk)`` order, each as early as it can start.

    A pass starts when its stage is free and the pass it receives from (:func:`depends_on`)
    has ended; it lasts ``durations[kind]``.

    Raises:
      ValueError: orders that wait on each other forever (no stage can start its next pass).
    """
    stages = len(orders)
    ends: dict[tuple[str, int, int, int], float] = {}
    free, position, slots = [0.0] * stages, [0] * stages, []
    while len(slots) < sum(len(order) for order in orders):
        progressed = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            kind, m, c = orders[s][position[s]]
            after = depends_on(kind, s, m, stages, c, virtual)
            if after is not None and after not in ends:
                continue  # waits for another stage
            start = max(free[s], 0.0 if after is None else ends[after])
            end = start + durations[kind]
            slots.append(Slot(s, m, start, end, kind, c))
            ends[kind, s, m, c], free[s], position[s], progressed = end, end, position[s] + 1, True
        if not progressed:
            raise ValueError(f"These orders deadlock: every stage waits on another ({[o[:4] for o in orders]}...).")
    return sorted(slots, key=lambda x: (KINDS.index(x.kind), x.chunk, x.stage, x.microbatch))


def peak_in_flight(schedule: Sequence[Slot]) -> dict[int, int]:
    """Per stage, the most microbatch-chunks whose forward pass has ended and whose last pass has not.

    Each such microbatch's activations are held until its backward pass, or its weight pass
    where the schedule splits the backward: this counts the activation memory a stage needs,
    in microbatches: ``microbatches`` for GPipe, at most ``stages - stage`` for 1F1B and
    ``stages`` for ZB-H1. An interleaved schedule counts a microbatch once per chunk, each chunk
    ``1 / virtual`` of the stage's layers (a microbatch-chunk).

    >>> peak_in_flight(gpipe_schedule(2, 4)), peak_in_flight(one_f_one_b_schedule(2, 4))
    ({0: 4, 1: 4}, {0: 2, 1: 1})
    """
    last = "weight" if any(slot.kind == "weight" for slot in schedule) else "backward"
    peaks = {}
    for stage in sorted({s.stage for s in schedule}):
        events = sorted(
            (slot.end, 1 if slot.kind == "forward" else -1)
            for slot in schedule
            if slot.stage == stage and slot.kind in ("forward", last)
        )
        held = peak = 0
        for _, change in events:
            held += change
            peak = max(peak, held)
        peaks[stage] = peak
    return peaks


def stage_orders(schedule: Sequence[Slot]) -> list[list[tuple]]:
    """Per stage, its passes in the order they run: ``[[(kind, microbatch), ...], ...]``.

    Where the schedule interleaves chunks, each pass also names its chunk: ``(kind,
    microbatch, chunk)``. What an executor needs from a schedule (:class:`parallelkit.Pipeline`
    runs each stage's list in turn); also how an executed timeline is compared with the plan.

    >>> stage_orders(one_f_one_b_schedule(2, 2))[0]
    [('forward', 0), ('forward', 1), ('backward', 0), ('backward', 1)]
    >>> stage_orders(interleaved_schedule(2, 2, virtual=2))[1][:3]
    [('forward', 0, 0), ('forward', 1, 0), ('forward', 0, 1)]
    """
    _check_not_empty(schedule, "stage_orders")
    stages = 1 + max(s.stage for s in schedule)
    chunked = any(s.chunk for s in schedule)
    return [
        [
            (s.kind, s.microbatch, s.chunk) if chunked else (s.kind, s.microbatch)
            for s in sorted((x for x in schedule if x.stage == stage), key=lambda x: x.start)
        ]
        for stage in range(stages)
    ]


def makespan(schedule: Sequence[Slot]) -> float:
    """Time from the first slot's start to the last slot's end."""
    _check_not_empty(schedule, "makespan")
    return max(s.end for s in schedule) - min(s.start for s in schedule)


def bubble_fraction(schedule: Sequence[Slot]) -> float:
    """The share of stage-time spent idle: ``1 - busy / (stages x makespan)``.

    For GPipe and 1F1B this is ``(stages - 1) / (microbatches + stages - 1)``: more
    microbatches, smaller bubble; interleaving ``v`` chunks makes it ``(stages - 1) / (v x
    microbatches + stages - 1)``.
    """
    stages = len({s.stage for s in schedule})
    busy = sum(s.end - s.start for s in schedule)
    return 1 - busy / (stages * makespan(schedule))


def _check_not_empty(schedule: Sequence[Slot], caller: str) -> None:
    if not schedule:
        raise ValueError(
            f"{caller} got an empty schedule ({schedule!r}): a schedule lists every stage's passes of every "
            "microbatch as Slot rows. Build one with a schedule function, such as gpipe_schedule(stages, microbatches)."
        )


def check_schedule(schedule: Sequence[Slot]) -> None:
    """Raise a ValueError if the schedule could not run.

    A valid schedule is not empty and has one forward and one backward slot per (stage, chunk,
    microbatch), and one weight slot each too if it has any; no two slots overlapping on a stage; a
    forward after the forward above in the model (activations flow down), a backward after
    the backward below (gradients flow up), the model's last stage's backward after its own
    forward, and a weight pass after its own backward pass.
    """
    _check_not_empty(schedule, "check_schedule")
    slots = {}
    for slot in schedule:
        if slot.kind not in KINDS:
            raise ValueError(f"{slot}: kind must be one of {KINDS}.")
        key = (slot.kind, slot.stage, slot.microbatch, slot.chunk)
        if key in slots:
            raise ValueError(f"{slot}: a second {slot.kind} pass of microbatch {slot.microbatch} on stage {slot.stage}")
        slots[key] = slot
    stages = 1 + max(s.stage for s in schedule)
    micro = 1 + max(s.microbatch for s in schedule)
    virtual = 1 + max(s.chunk for s in schedule)
    kinds = KINDS if any(s.kind == "weight" for s in schedule) else KINDS[:2]
    wanted = [(k, s, m, c) for k in kinds for s in range(stages) for m in range(micro) for c in range(virtual)]
    missing = [key for key in wanted if key not in slots]
    if missing:
        raise ValueError(f"Missing (kind, stage, microbatch, chunk) slots: {missing[:4]}.")
    for s in range(stages):
        mine = sorted((x for x in schedule if x.stage == s), key=lambda x: x.start)
        for a, b in zip(mine, mine[1:], strict=False):
            if b.start < a.end:
                raise ValueError(f"Stage {s} runs {a} and {b} at once.")
    for (kind, s, m, c), slot in slots.items():
        after = ("backward", s, m, c) if kind == "weight" else depends_on(kind, s, m, stages, c, virtual)
        before = None if after is None else slots[after]
        if before is not None and slot.start < before.end:
            raise ValueError(f"{slot} starts before {before} ends, which it depends on.")
