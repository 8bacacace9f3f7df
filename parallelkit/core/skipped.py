"""Runs that skip every step: a loss scale that never finds finite gradients is told, not left to run.

Holds :class:`SkippedSteps` (the count of skipped steps in a row), :class:`StepWatch`,
:class:`SkippedStepsWarning` and :class:`NonFiniteGradientsError`."""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

import jax
import numpy as np

from .precision import MIN_SCALE, Precision

# Skipped steps in a row after which a run with a fixed scale is stuck (a dynamic one: at its floor, SkippedSteps).
SKIPPED_STEPS_LIMIT = 20

ADVICE = (
    "Check the batches for NaN or infinite values, lower the learning rate, keep the parameters in float32 "
    "with a dynamic scale (pk.Precision.fp16()), or train in bfloat16 (pk.Precision.bf16()), whose range is "
    "float32's and needs no loss scale."
)


class SkippedStepsWarning(UserWarning):
    """Step after step was skipped because its gradients were not finite: the run is not training."""


class NonFiniteGradientsError(FloatingPointError):
    """``pk.fit`` stopped a run whose steps were all skipped: their gradients were not finite."""


class SkippedSteps:
    """Counts the skipped steps in a row of a run with a loss scale, and says when the run is stuck.

    >>> watch = SkippedSteps(Precision.fp16())
    >>> [watch.update(finite, scale) is None for finite, scale in [(0, 8.0), (1, 4.0), (0, 4.0), (0, 2.0)]]
    [True, True, True, True]
    >>> print(watch.update(False, 1.0))  # doctest: +NORMALIZE_WHITESPACE
    3 steps in a row were skipped because the gradients were not finite (at the dynamic scale's
    floor of 1, where halving cannot help), so the run is not training.
    """

    def __init__(self, precision: Precision, limit: int = SKIPPED_STEPS_LIMIT):
        self.precision, self.limit, self.in_a_row = precision, limit, 0

    def update(self, finite: Any, scale: Any) -> str | None:
        """Take one step's ``grads_finite`` and ``loss_scale`` metrics; a message when the run is stuck.

        ``finite`` may be a fraction (an asynchronous round's finite pushes): 0 is a skipped step.
        """
        if np.any(np.asarray(finite)):
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.precision.dynamic:  # it halves on every skip: stuck once it skips at its floor
            if float(np.min(np.asarray(scale))) > MIN_SCALE:
                return None
            where = "at the dynamic scale's floor of 1, where halving cannot help"
        else:
            if self.in_a_row < self.limit:
                return None
            where = f"at loss scale {float(np.max(np.asarray(scale))):g}"
        count = f"{self.in_a_row} steps in a row were skipped" if self.in_a_row > 1 else "A step was skipped"
        return f"{count} because the gradients were not finite ({where}), so the run is not training."


class StepWatch:
    """A :class:`SkippedSteps` fed by a step's metrics as the device finishes them, without waiting.

    ``observe(metrics)`` after each call; a step whose flag is not ready yet is read at a later
    call. Warns once per run (a :class:`SkippedStepsWarning`).
    """

    def __init__(self, precision: Precision):
        self.count = SkippedSteps(precision)
        self.pending: deque = deque()
        self.warned = False

    def observe(self, metrics: dict) -> None:
        if self.warned or "grads_finite" not in metrics:
            return
        self.pending.append((metrics["grads_finite"], metrics["loss_scale"]))
        while self.pending and all(not isinstance(x, jax.Array) or x.is_ready() for x in self.pending[0]):
            message = self.count.update(*jax.device_get(self.pending.popleft()))
            if message is not None:
                warnings.warn(f"{message} {ADVICE}", SkippedStepsWarning, stacklevel=3)
                self.warned = True
                self.pending.clear()
                return
