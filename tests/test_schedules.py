"""Pipeline schedules are valid plain data: every pass once, no overlaps, dependencies kept."""

from __future__ import annotations

import pytest

from parallelkit.strategies.pipeline.schedules import (
    Slot,
    bubble_fraction,
    check_schedule,
    gpipe_schedule,
    interleaved_schedule,
    makespan,
    one_f_one_b_schedule,
    peak_in_flight,
    stage_orders,
    timed,
    zero_bubble_schedule,
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


@pytest.mark.parametrize(("stages", "microbatches", "virtual"), [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (2, 6, 3)])
def test_interleaving_v_chunks_shrinks_the_bubble_to_the_formula(stages, microbatches, virtual):
    slots = interleaved_schedule(stages, microbatches, virtual, forward=1, backward=2)
    check_schedule(slots)
    assert len(slots) == 2 * stages * microbatches * virtual
    assert {(s.stage, s.chunk) for s in slots} == {(s, c) for s in range(stages) for c in range(virtual)}
    assert bubble_fraction(slots) == pytest.approx((stages - 1) / (virtual * microbatches + stages - 1))
    assert all(s.end - s.start == pytest.approx((1 if s.kind == "forward" else 2) / virtual) for s in slots)


def test_interleaved_stages_run_megatrons_order():
    """Microbatches in groups of ``stages`` through chunk 0, then chunk 1; backward chunks in reverse."""
    stage0 = stage_orders(interleaved_schedule(2, 4, virtual=2))[0]
    assert stage0[:6] == [("forward", 0, 0), ("forward", 1, 0), ("forward", 0, 1), ("forward", 1, 1),
                          ("forward", 2, 0), ("backward", 0, 1)]  # fmt: skip
    assert interleaved_schedule(3, 4, virtual=1) == one_f_one_b_schedule(3, 4)


def test_interleaving_needs_whole_groups_of_microbatches():
    with pytest.raises(ValueError, match="multiple of 4 microbatches"):
        interleaved_schedule(4, 6, virtual=2)
    with pytest.raises(ValueError, match="whole number >= 1"):
        interleaved_schedule(2, 4, virtual=0)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 6), (4, 4), (4, 8), (4, 5), (8, 16)])
def test_zero_bubble_has_a_third_of_1f1bs_idle_time_and_holds_stages_microbatches(stages, microbatches):
    slots = zero_bubble_schedule(stages, microbatches, forward=1, backward=2)
    check_schedule(slots)
    assert len(slots) == 3 * stages * microbatches
    assert makespan(slots) == 3 * microbatches + stages - 1  # idle (stages - 1) x forward per stage
    assert makespan(one_f_one_b_schedule(stages, microbatches)) == 3 * (microbatches + stages - 1)
    assert peak_in_flight(slots) == {s: stages for s in range(stages)}  # held until the weight pass


def test_zero_bubble_defers_a_later_stages_weight_passes_longer():
    orders = stage_orders(zero_bubble_schedule(3, 4))
    assert orders[0][:6] == [("forward", 0), ("forward", 1), ("forward", 2), ("backward", 0), ("weight", 0),
                             ("forward", 3)]  # fmt: skip
    last = [(k[0], m) for k, m in orders[2]]
    assert last[:6] == [("f", 0), ("b", 0), ("f", 1), ("b", 1), ("f", 2), ("b", 2)]  # weight 0 after backward 2
    assert last[6] == ("w", 0)


def test_a_weight_pass_before_its_backward_pass_is_refused():
    slots = zero_bubble_schedule(2, 2)
    weight = next(s for s in slots if s.kind == "weight" and s.stage == 1)
    backward = next(s for s in slots if s.kind == "backward" and (s.stage, s.microbatch) == (1, weight.microbatch))
    moved = [s._replace(start=backward.start - 10, end=backward.start - 9) if s == weight else s for s in slots]
    with pytest.raises(ValueError, match="starts before"):
        check_schedule(moved)


def test_orders_that_wait_on_each_other_are_refused():
    with pytest.raises(ValueError, match="deadlock"):
        timed([[("backward", 0, 0), ("forward", 0, 0)], [("forward", 0, 0), ("backward", 0, 0)]],
              {"forward": 1, "backward": 2})  # fmt: skip


@pytest.mark.parametrize("schedule", [gpipe_schedule, one_f_one_b_schedule, interleaved_schedule, zero_bubble_schedule])
def test_schedules_reject_bad_counts(schedule):
    with pytest.raises(ValueError, match="stages >= 1 and microbatches >= 1"):
        schedule(0, 4)
    with pytest.raises(ValueError, match="durations above 0"):
        schedule(2, 4, forward=0)
