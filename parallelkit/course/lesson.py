"""Helpers for the course notebooks: checked settings, and exercises that test a prediction.

Every notebook starts with a cell of settings (tagged ``parameters``, so tools such as
papermill can override them) and then calls :func:`setup`, which refuses values the
lesson cannot run with, in words that say what to change: every value before JAX starts,
except the batch, whose check needs the device count.
Exercises ask the learner to predict a number, measure it, and :func:`check` says how
close the prediction was; or to write something, which a checker runs:
:func:`check_orders` plays a pipeline order the learner wrote.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax

from ..core.devices import device_summary, simulate_devices

MODELS = ("mlp", "cnn", "transformer")  # the names pk.models.build knows


def setup(
    n_devices: int,
    *,
    batch: int | None = None,
    model: str | None = None,
    models: Sequence[str] = MODELS,
    force_cpu: bool = False,
    needs: int = 2,
) -> list[jax.Device]:
    """Check a notebook's settings, start JAX on its devices, and print what it runs on.

    Args:
      n_devices: simulated CPU devices (``pk.simulate_devices``); on accelerators those are used.
      batch: the global batch, which must split evenly over the devices.
      model: a name from ``models``, for ``pk.models.build``.
      models: the models this lesson works with.
      force_cpu: simulate CPU devices even where there are accelerators (a hosted notebook
        with one GPU still shows several devices).
      needs: the fewest devices the lesson can show anything with.

    Returns:
      The devices, as ``pk.simulate_devices`` returns them.

    Raises:
      ValueError: a setting the lesson cannot run with; the message names it.
      DeviceCountError: JAX already started (restart the kernel and run from the top).

    >>> setup(8, batch=63)
    Traceback (most recent call last):
    ...
    ValueError: BATCH=63 does not split evenly over 8 devices: choose a multiple of 8, such as 64.
    """
    if model is not None and model not in models:
        raise ValueError(
            f"MODEL={model!r} is not one this lesson can use: choose one of {', '.join(map(repr, models))}."
        )
    if not isinstance(force_cpu, bool):
        raise ValueError(f"FORCE_CPU must be True or False, got {force_cpu!r}.")
    if not isinstance(n_devices, int) or n_devices < needs:
        raise ValueError(f"N_DEVICES={n_devices!r}: this lesson needs a whole number of at least {needs} devices.")
    if batch is not None and (not isinstance(batch, int) or batch < 1):
        raise ValueError(f"BATCH={batch!r} must be a whole number of examples, at least 1.")
    devices = simulate_devices(n_devices, force_cpu=force_cpu)
    if len(devices) < needs:
        raise ValueError(
            f"This lesson needs at least {needs} devices and JAX found {len(devices)} "
            f"({devices[0].platform}): set FORCE_CPU = True in the first cell, restart the kernel, and run again."
        )
    if batch is not None and batch % len(devices):
        n = len(devices)
        raise ValueError(
            f"BATCH={batch} does not split evenly over {n} devices: choose a multiple of {n}, "
            f"such as {max(n, round(batch / n) * n)}."
        )
    print(device_summary())
    return devices


def check(prediction: Any, measured: Any, *, rtol: float = 0.1, what: str = "the answer") -> bool | None:
    """Say how a learner's prediction compares with the measured value.

    A number within ``rtol`` of a measured number counts as right; any other answer (a
    name, a tuple) must equal the measurement. ``None`` means no prediction yet: the
    measurement is shown so that the learner can compare in their head.

    Returns:
      True or False for a prediction, None without one.

    >>> check(8, 8.0, what="the gradient's growth")
    your prediction for the gradient's growth: 8, right (measured 8)
    True
    >>> check("P()", "P('data')", what="the spec")
    your prediction for the spec: 'P()', not quite (measured "P('data')")
    False
    >>> check(None, 0.5)
    measured the answer: 0.5 (set the prediction above and run the cell again to compare)
    """
    if prediction is None:
        print(f"measured {what}: {_show(measured)} (set the prediction above and run the cell again to compare)")
        return None
    if _is_number(prediction) and _is_number(measured):
        right = abs(prediction - measured) <= rtol * abs(measured)
    else:
        right = prediction == measured
    verdict = "right" if right else "not quite"
    print(f"your prediction for {what}: {_show(prediction)}, {verdict} (measured {_show(measured)})")
    return bool(right)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _show(x: Any) -> str:
    return f"{x:.4g}" if _is_number(x) else repr(x)


def check_orders(orders: Any, stages: int, microbatches: int) -> bool | None:
    """Play a learner's per-stage pipeline order and say, in one sentence, whether it is a 1F1B order.

    ``orders[s]`` lists stage ``s``'s passes in the order it runs them, each ``("forward", m)``
    or ``("backward", m)``. The order is played with a forward pass of 1 and a backward pass
    of 2 (:func:`~parallelkit.strategies.pipeline.schedules.timed`) and must run every pass
    once, never wait forever, take no longer than 1F1B and hold no more microbatches on any
    stage than 1F1B does. ``None`` means not written yet.

    >>> from parallelkit.strategies.pipeline.schedules import gpipe_schedule, stage_orders
    >>> check_orders(stage_orders(gpipe_schedule(2, 2)), 2, 2)
    not yet: stage 1 holds 2 microbatches at once, where 1F1B holds 1
    False
    """
    from ..strategies.pipeline import schedules

    if orders is None:
        print("write each stage's order in the list above, then run the cell again")
        return None
    target = schedules.one_f_one_b_schedule(stages, microbatches)
    try:
        played = schedules.timed(
            [[(kind, m, 0) for kind, m in order] for order in orders], {"forward": 1, "backward": 2}
        )
        schedules.check_schedule(played)
    except (ValueError, TypeError, KeyError) as err:
        print(f"not yet: {err}")
        return False
    if len(orders) != stages or {s.microbatch for s in played} != set(range(microbatches)):
        print(
            f"not yet: write one order for each of the {stages} stages, covering microbatches 0 to {microbatches - 1}"
        )
        return False
    held, most = schedules.peak_in_flight(played), schedules.peak_in_flight(target)
    over = [s for s in range(stages) if held[s] > most[s]]
    if over:
        print(f"not yet: stage {over[0]} holds {held[over[0]]} microbatches at once, where 1F1B holds {most[over[0]]}")
        return False
    if schedules.makespan(played) > schedules.makespan(target):
        print(f"not yet: it takes {schedules.makespan(played):g} where 1F1B takes {schedules.makespan(target):g}")
        return False
    print(
        f"right: {schedules.makespan(played):g} time units, at most {list(held.values())} microbatches held per stage"
    )
    return True
