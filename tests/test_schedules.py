"""Pipeline schedules are valid plain data: every pass once, no overlaps, dependencies kept."""

from __future__ import annotations

import pytest

from parallelkit.strategies.pipeline.schedules import (
    Slot,
    bubble_fraction,
    check_schedule,
    gpipe_schedule,
    makespan,
    one_f_one_b_schedule,
    peak_in_flight,
)


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 3), (4, 4), (4, 8), (3, 1)])
def test_gpipe_schedule_is_valid_and_its_bubble_is_the_formula(stages, microbatches):
    slots = gpipe_schedule(stages, microbatches, forward=1, backward=2)
    check_schedule(slots)
    assert len(slots) == 2 * stages * microbatches
    assert makespan(slots) == 3 * (microbatches + stages - 1)  # one fill and one drain, forward then backward
    assert bubble_fraction(slots) == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_gpipe_forward_passes_flow_down_one_step_apart():
    slots = gpipe_schedule(3, 2)
    forward = {(s.stage, s.microbatch): s.start for s in slots if s.kind == "forward"}
    assert forward == {(s, m): m + s for s in range(3) for m in range(2)}
    backward = [s for s in slots if s.kind == "backward"]
    first = min(backward, key=lambda s: s.start)
    assert (first.stage, first.microbatch, first.start) == (2, 1, 4)  # last stage, last microbatch, after the flush


def test_check_schedule_names_what_is_wrong():
    good = gpipe_schedule(2, 2)
    with pytest.raises(ValueError, match="at once"):
        check_schedule([*good[:-1], good[-1]._replace(start=good[-2].start)])
    with pytest.raises(ValueError, match="Missing"):
        check_schedule(good[:-1])
    with pytest.raises(ValueError, match="starts before"):
        # stage 1 starts microbatch 0 before stage 0 has computed its activations
        moved = (1, 0, "forward")
        check_schedule([s._replace(start=0, end=1) if (s.stage, s.microbatch, s.kind) == moved else s for s in good])
    with pytest.raises(ValueError, match="kind must be"):
        check_schedule([Slot(0, 0, 0, 1, "sideways")])
    with pytest.raises(ValueError, match="microbatches >= 1"):
        gpipe_schedule(2, 0)


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 3), (4, 4), (4, 8), (3, 1), (2, 8)])
def test_1f1b_is_valid_has_gpipes_bubble_and_holds_at_most_stages_minus_s_microbatches(stages, microbatches):
    slots = one_f_one_b_schedule(stages, microbatches, forward=1, backward=2)
    check_schedule(slots)
    assert len(slots) == 2 * stages * microbatches
    assert bubble_fraction(slots) == pytest.approx((stages - 1) / (microbatches + stages - 1))
    held = peak_in_flight(slots)
    assert held == {s: min(stages - s, microbatches) for s in range(stages)}
    assert peak_in_flight(gpipe_schedule(stages, microbatches)) == {s: microbatches for s in range(stages)}


def test_1f1b_alternates_after_its_warm_up():
    slots = one_f_one_b_schedule(3, 4)
    stage0 = [(s.kind[0], s.microbatch) for s in sorted(slots, key=lambda s: s.start) if s.stage == 0]
    assert stage0 == [("f", 0), ("f", 1), ("f", 2), ("b", 0), ("f", 3), ("b", 1), ("b", 2), ("b", 3)]


@pytest.mark.parametrize("schedule", [gpipe_schedule, one_f_one_b_schedule])
def test_schedules_reject_bad_counts(schedule):
    with pytest.raises(ValueError, match="stages >= 1 and microbatches >= 1"):
        schedule(0, 4)
    with pytest.raises(ValueError, match="durations above 0"):
        schedule(2, 4, forward=0)
