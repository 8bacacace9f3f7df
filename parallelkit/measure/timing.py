"""Honest step timing: compile apart from steady state, medians and spreads, read after ``block_until_ready``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass(frozen=True)
class StepTimes:
    """Wall-clock seconds of a run's steps, the first (compiling) one kept apart."""

    first_step_seconds: float  # trace + compile + one step
    step_seconds: tuple[float, ...]  # every later step
    batch_size: int

    @classmethod
    def of(cls, seconds: Sequence[float], batch_size: int, skip: int = 0) -> StepTimes:
        """The steps' ``seconds``: the first kept apart, the ``skip`` after it left out (none at all: ValueError)."""
        if not seconds:
            raise ValueError("No step has run yet.")
        return cls(seconds[0], tuple(seconds[1 + skip :]), batch_size)

    @property
    def median(self) -> float:
        return float(np.median(self.step_seconds)) if self.step_seconds else float("nan")

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.step_seconds, q)) if self.step_seconds else float("nan")

    @property
    def samples_per_second(self) -> float:
        """Steady-state throughput from the median step."""
        return self.batch_size / self.median

    @property
    def compile_seconds(self) -> float:
        """First step minus a steady step: an estimate of trace + compile time."""
        return max(self.first_step_seconds - (self.median if self.step_seconds else 0.0), 0.0)


def scaling_efficiency(throughput: float, single_device_throughput: float, devices: int) -> float:
    """throughput_N / (N x throughput_1): 1.0 is perfect linear scaling.

    >>> scaling_efficiency(300.0, 100.0, 4)
    0.75
    """
    return throughput / (devices * single_device_throughput)


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Call ``fn(*args)``, wait for every output array, return ``(output, seconds)``."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - start


def time_steps(step: Callable, state: Any, batches: Iterable[Any]) -> tuple[Any, StepTimes]:
    """Run ``state, _ = step(state, batch)`` over ``batches``, timing each call.

    Returns the final state and the :class:`StepTimes` (the first call is the compiling one).
    """
    seconds, size = [], 0
    for batch in batches:
        (state, _), elapsed = timed(step, state, batch)
        seconds.append(elapsed)
        size = len(jax.tree.leaves(batch)[0])
    if not seconds:
        raise ValueError("time_steps needs at least one batch.")
    return state, StepTimes.of(seconds, size)
