"""``fit``: a small training loop over any strategy, with callbacks for live views.

Conceptually, ``fit`` is::

    state = strategy.init(params, tx)
    step = strategy.step(loss_fn)
    for batch in batches:
        state, metrics = step(state, batch)

plus per-step timing (read after the work is done, the compiling first step kept
apart) and callbacks that dashboards hang on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice

import jax
import numpy as np
import optax

from .devices import device_summary
from .strategies.base import Batch, LossFn, PyTree, Strategy, TrainState, batch_size
from .timing import StepTimes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunInfo:
    """What a run is, told to callbacks before its first step."""

    strategy: str
    devices: int
    steps: int | None  # None when the batches are an open-ended iterator
    simulated: bool


@dataclass(frozen=True)
class StepRecord:
    """One finished step: its metrics as floats and its wall-clock time."""

    step: int  # 1-based
    metrics: dict[str, float]
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
        return np.array([r.metrics[name] for r in self.records])

    @property
    def losses(self) -> np.ndarray:
        return self.metric("loss")

    @property
    def times(self) -> StepTimes:
        if not self.records:
            raise ValueError("No step has run yet.")
        seconds = [r.seconds for r in self.records]
        return StepTimes(seconds[0], tuple(seconds[1:]), self.batch_size)


class Callback:
    """Hooks into ``fit``; override what you need. Keep them cheap: they run between steps."""

    def on_train_begin(self, info: RunInfo) -> None: ...

    def on_step_end(self, record: StepRecord) -> None: ...

    def on_train_end(self, history: History, interrupted: bool) -> None: ...


@dataclass
class FitResult:
    """The final (placed) state, what was recorded, and whether the run was interrupted."""

    state: TrainState
    history: History
    strategy: Strategy
    interrupted: bool = False

    @property
    def params(self) -> PyTree:
        """One host copy of the trained parameters."""
        return self.strategy.unreplicate(self.state.params)


def fit(
    strategy: Strategy,
    loss_fn: LossFn,
    params: PyTree,
    tx: optax.GradientTransformation,
    batches: Iterable[Batch],
    *,
    steps: int | None = None,
    callbacks: Sequence[Callback] = (),
    state: TrainState | None = None,
) -> FitResult:
    """Train ``params`` with ``strategy`` on global ``batches``; record loss, metrics and timing.

    Args:
      strategy: any parallelkit strategy.
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, dict of scalar metrics)``.
      params, tx: initial parameters and the Optax optimizer.
      batches: global batches (dicts of host arrays); the strategy splits them.
      steps: stop after this many steps (default: when ``batches`` ends).
      callbacks: :class:`Callback` objects, told of every step.
      state: continue from this placed state instead of ``strategy.init(params, tx)``.

    Returns:
      A :class:`FitResult`. Interrupting the kernel (KeyboardInterrupt) ends the run
      early and returns what was trained so far with ``interrupted=True``, so no
      work is lost.
    """
    if steps is not None:
        batches = islice(batches, steps)
    total = steps if steps is not None else (len(batches) if hasattr(batches, "__len__") else None)
    info = RunInfo(repr(strategy), strategy.num_replicas, total, device_summary().simulated)
    state = strategy.init(params, tx) if state is None else state
    step = strategy.step(loss_fn)
    history = History()
    for cb in callbacks:
        cb.on_train_begin(info)
    interrupted = False
    try:
        for i, batch in enumerate(batches, start=1):
            start = time.perf_counter()
            # Rebind at once: the old state is donated to the step, so it must not be what we keep.
            state, metrics = step(state, batch)
            jax.block_until_ready((state, metrics))
            seconds = time.perf_counter() - start
            history.batch_size = batch_size(batch)
            record = StepRecord(i, {k: float(v) for k, v in metrics.items()}, seconds, compiled=i == 1)
            history.records.append(record)
            for cb in callbacks:
                cb.on_step_end(record)
    except KeyboardInterrupt:
        interrupted = True
        log.warning("fit interrupted after %d steps; returning the state so far.", len(history.records))
    for cb in callbacks:
        cb.on_train_end(history, interrupted)
    return FitResult(state, history, strategy, interrupted)
