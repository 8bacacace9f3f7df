"""What ``fit`` tells its callbacks, the :class:`Callback` hooks, and the callbacks ``fit`` installs itself.

A callback sees the run through four hooks, in this order::

    on_train_begin(info)                   # once, before the first step
    on_step_end(record)                    # after each step, its time read once the work is done
    on_train_error(history, error)         # only if the run stops with an exception
    on_train_end(history, interrupted)     # once, unless the run stopped with an exception

``fit`` puts its own callbacks first, then the user's: :class:`NonFiniteCheck` (stop on
a NaN or infinite loss), :class:`SkippedStepsCheck` (with a loss scale: stop a run whose every
step is skipped), then :class:`Checkpointing` (save every K steps, at the end and
on an error). Live views (``pk.viz.TimingDashboard``,
``pk.distributed.ReportProgress``) are callbacks of the same kind.

>>> class Losses(Callback):
...     def on_step_end(self, record):
...         print(record.step, record.loss)
>>> Losses().on_step_end(StepRecord(1, {"loss": 2.0}, 0.5, compiled=True))
1 2.0
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import numpy as np

from ..core.precision import LossScaleState, Precision
from ..core.skipped import ADVICE, NonFiniteGradientsError, SkippedSteps
from ..core.step import loss_and_grads
from ..core.types import PyTree
from ..measure.timing import StepTimes
from ..strategies.base import Strategy
from .checkpoint import Checkpoints

if TYPE_CHECKING:
    from ..core.state import TrainState


@dataclass(frozen=True)
class RunInfo:
    """What a run is, told to callbacks before its first step."""

    strategy: str
    devices: int
    steps: int | None  # None when the batches are an open-ended iterator
    simulated: bool


@dataclass(frozen=True)
class StepRecord:
    """One finished step: its metrics (floats; NumPy arrays for metrics with axes) and its wall-clock time."""

    step: int  # 1-based
    metrics: dict[str, float | np.ndarray]
    seconds: float
    compiled: bool  # True for the first step, which includes tracing and compiling

    @property
    def loss(self) -> float:
        return self.metrics["loss"]


@dataclass
class History:
    """Everything ``fit`` recorded, step by step."""

    records: list[StepRecord] = field(default_factory=list)
    batch_size: int = 0

    def metric(self, name: str) -> np.ndarray:
        """One metric over the steps: ``(steps,)``, or ``(steps, ...)`` for a metric with axes."""
        return np.array([r.metrics[name] for r in self.records])

    @property
    def losses(self) -> np.ndarray:
        return self.metric("loss")

    def record(self, step: int, start: float, metrics: dict[str, jax.Array], size: int, state: PyTree) -> StepRecord:
        """Wait for a dispatched step (its new ``state`` and ``metrics``), then record it, timed from ``start``.

        Metrics come to the host as floats, or NumPy arrays for those with axes (an MoE model's tokens per expert).
        """
        jax.block_until_ready((state, metrics))
        host = {k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in metrics.items()}
        record = StepRecord(step, host, time.perf_counter() - start, step == 1)
        self.batch_size = size
        self.records.append(record)
        return record

    @property
    def times(self) -> StepTimes:
        return StepTimes.of([r.seconds for r in self.records], self.batch_size)


class Callback:
    """Hooks into ``fit``; override what you need. Keep them cheap: they run between steps.

    An exception raised by a hook stops the run like one from the data: ``fit`` raises
    it with the state of the last completed step attached as ``err.fit_result``.
    """

    def on_train_begin(self, info: RunInfo) -> None: ...

    def on_step_end(self, record: StepRecord) -> None: ...

    def on_train_error(self, history: History, error: Exception) -> None:
        """The run stopped with ``error`` (raised once every callback has seen it)."""

    def on_train_end(self, history: History, interrupted: bool) -> None: ...


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite during :func:`fit` (turn the check off with ``check_finite=False``)."""


class NonFiniteCheck(Callback):
    """Stops the run with :class:`NonFiniteLossError` when a step's loss is NaN or infinite.

    Args:
      first: the step the run started from (a resumed run's), so the message names the run's step.
    """

    def __init__(self, first: int = 0):
        self.first = first

    def on_step_end(self, record: StepRecord) -> None:
        if not math.isfinite(record.loss):
            raise NonFiniteLossError(
                f"The loss became {record.loss} at step {self.first + record.step} of the run. Lower the learning "
                "rate, check the data for NaN or infinite values, or pass check_finite=False to keep going."
            )


class SkippedStepsCheck(Callback):
    """Stops a run with a loss scale whose steps are all skipped, naming the gradients that are not finite.

    A stuck run (:class:`~parallelkit.core.skipped.SkippedSteps`: ``SKIPPED_STEPS_LIMIT`` skipped
    steps in a row under a fixed scale, or one at a dynamic scale's floor) ends with
    :class:`~parallelkit.core.skipped.NonFiniteGradientsError`. ``nonfinite`` names the parameters
    whose gradients are not finite, from the last step's batch and scale.

    Args:
      precision: the run's policy, with a loss scale.
      first: the step the run started from (a resumed run's), so the message names the run's step.
      nonfinite: ``scale -> parameter paths`` (see :func:`nonfinite_gradients`).
    """

    def __init__(self, precision: Precision, first: int, nonfinite: Callable[[float], list[str]]):
        self.count, self.first, self.nonfinite = SkippedSteps(precision), first, nonfinite

    def on_step_end(self, record: StepRecord) -> None:
        scale = record.metrics["loss_scale"]
        message = self.count.update(record.metrics["grads_finite"], scale)
        if message is None:
            return
        try:
            found = self.nonfinite(float(scale))
            which = (
                f"Recomputed on one device with the last batch, these gradients are not finite: {', '.join(found)}."
                if found
                else "Recomputed on one device with the last batch, every gradient was finite."
            )
        except Exception as err:  # a strategy whose loss does not run whole on one device (a pipeline's head)
            which = f"(Recomputing the gradients on one device to name them failed: {type(err).__name__}: {err})"
        raise NonFiniteGradientsError(f"At step {self.first + record.step} of the run: {message} {which} {ADVICE}")


def nonfinite_gradients(
    loss_fn: Callable, params: PyTree, batch: PyTree, precision: Precision, scale: float
) -> list[str]:
    """The paths of the parameters whose gradients on ``batch`` are not finite, computed on one device.

    The same pass as a step's (:func:`~parallelkit.core.step.loss_and_grads`) under ``precision``
    at loss scale ``scale``, without a key or model state.
    """
    state = LossScaleState(np.float32(scale), np.int32(0)) if precision.dynamic else None

    def grads(p, b):
        return loss_and_grads(loss_fn, p, b, {}, precision=precision, loss_scale=state)[3]

    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(jax.jit(grads)(params, batch)))[0]
    return [jax.tree_util.keystr(path) for path, g in flat if not np.all(np.isfinite(g))]


class Checkpointing(Callback):
    """Saves the run's state every ``ckpt.every`` steps, after its last step, and when it stops with an error.

    Saving happens after the step's clock is read, so it is not in the step's time. A
    run stopped by :class:`NonFiniteLossError` is not saved again: its state is the one before
    the non-finite step (a checkpoint would count that step's batch as trained on), or, where the
    strategy cannot keep that, the one that went wrong.

    Args:
      ckpt: where to save.
      strategy: the strategy that placed the state.
      state: returns the state of the last completed step (``fit`` rebinds it every step).
      first: the state's step when the run began.
      consumed: how many batches earlier runs had consumed (a resumed run's).
      saved: the newest step already checkpointed, if any.
    """

    def __init__(
        self,
        ckpt: Checkpoints,
        strategy: Strategy,
        state: Callable[[], TrainState],
        *,
        first: int = 0,
        consumed: int = 0,
        saved: int | None = None,
    ):
        self.ckpt, self.strategy, self.state = ckpt, strategy, state
        self.first, self.consumed, self.saved = first, consumed, saved

    def _save(self, done: int, force: bool) -> None:
        """Save the state after ``done`` steps of this run, unless that step is saved already."""
        if self.saved != self.first + done:
            self.ckpt.save(self.state(), self.strategy, batches=self.consumed + done, force=force)
            self.saved = self.first + done

    def on_step_end(self, record: StepRecord) -> None:
        if self.ckpt.should_save(self.first + record.step):
            self._save(record.step, force=False)

    def on_train_error(self, history: History, error: Exception) -> None:
        if not isinstance(error, NonFiniteLossError):
            self._save(len(history.records), force=True)
        if self.saved:
            error.add_note(f"The newest checkpoint is step {self.saved} in {self.ckpt.directory}.")

    def on_train_end(self, history: History, interrupted: bool) -> None:
        self._save(len(history.records), force=True)  # the final state too, whatever its step
