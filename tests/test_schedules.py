"""Pipeline schedules are valid plain data: every pass once, no overlaps, dependencies kept."""

from __future__ import annotations

import pytest

from parallelkit.schedules import Slot, bubble_fraction, check_schedule, gpipe_schedule, makespan


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
