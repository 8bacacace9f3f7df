"""``fit``: a small training loop over any strategy, with callbacks for live views.

Conceptually, ``fit`` is::

    state = strategy.init(params, tx)
    step = strategy.step(loss_fn)
    for batch in batches:
        state, metrics = step(state, batch)

plus per-step timing (read after the work is done, the compiling first step kept
apart), callbacks that dashboards hang on, and optional checkpoints.

Resuming after a crash. With ``checkpoint_dir``, ``fit`` saves the state every
``checkpoint_every`` steps and at the end. ``fit(..., resume=True)`` restores the
newest checkpoint and continues. The data contract that makes the resumed run end
with exactly the parameters of an uninterrupted one: pass the *same* batches as the
interrupted run, from its beginning (a deterministic iterator such as
``pk.data.batches(dataset, size, steps=N, seed=0)`` made anew), and the same
``steps``; ``fit`` skips the batches already trained on (the checkpoint records how
many) and ``steps`` still counts from the start of the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import jax
import numpy as np
import optax

from .checkpoint import Checkpoints, host_step
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
    resumed_from: int | None = None  # the checkpointed step this run continued from

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
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
    checkpoint_keep: int | None = 3,
    resume: bool = False,
) -> FitResult:
    """Train ``params`` with ``strategy`` on global ``batches``; record loss, metrics and timing.

    Args:
      strategy: any parallelkit strategy.
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, dict of scalar metrics)``.
      params, tx: initial parameters and the Optax optimizer.
      batches: global batches (dicts of host arrays); the strategy splits them. When
        resuming, the same batches as the interrupted run, from its start.
      steps: stop after this many steps of the run, counted from its start (default:
        when ``batches`` ends).
      callbacks: :class:`Callback` objects, told of every step.
      state: continue from this placed state instead of ``strategy.init(params, tx)``.
      checkpoint_dir: save checkpoints here (see :mod:`parallelkit.checkpoint`); on a
        cluster, a directory every process sees.
      checkpoint_every: save every this many steps (and always after the last one).
      checkpoint_keep: how many checkpoints to keep (``None``: all).
      resume: restore the newest checkpoint in ``checkpoint_dir`` onto ``strategy``
        and continue from it, skipping the batches it had consumed.

    Returns:
      A :class:`FitResult`. Interrupting the kernel (KeyboardInterrupt) ends the run
      early and returns what was trained so far with ``interrupted=True``, so no
      work is lost (and saves a checkpoint of it, with ``checkpoint_dir``).

    Raises:
      ValueError: ``resume`` without ``checkpoint_dir`` or together with ``state``;
        ``batches`` shorter than what the checkpoint had consumed; or, without
        ``resume``, a ``checkpoint_dir`` that already holds another run's checkpoints.
      FileNotFoundError: ``resume=True`` but ``checkpoint_dir`` holds no checkpoint.
    """
    if resume and checkpoint_dir is None:
        raise ValueError(
            "resume=True needs checkpoint_dir: the directory the interrupted run saved its checkpoints to."
        )
    if resume and state is not None:
        raise ValueError("Give state or resume=True, not both: resuming restores the state from checkpoint_dir.")
    ckpt = Checkpoints(checkpoint_dir, every=checkpoint_every, keep=checkpoint_keep) if checkpoint_dir else None
    try:
        if ckpt:
            restored = _restore_or_check(ckpt, resume, strategy, params, tx)
            state, consumed, resumed_from = (state, 0, None) if restored is None else restored
        else:
            consumed, resumed_from = 0, None
        batches, total = _remaining(batches, steps, consumed)
    except BaseException:
        if ckpt:
            ckpt.close()
        raise
    info = RunInfo(repr(strategy), strategy.num_replicas, total, device_summary().simulated)
    state = strategy.init(params, tx) if state is None else state
    step = strategy.step(loss_fn)
    history = History()
    first = host_step(strategy, state) if ckpt else 0
    saved = resumed_from
    for cb in callbacks:
        cb.on_train_begin(info)
    interrupted = False
    try:
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
                if ckpt and ckpt.should_save(first + i):  # after the clock: saving is not the step's time
                    ckpt.save(state, strategy, batches=consumed + i)
                    saved = first + i
                for cb in callbacks:
                    cb.on_step_end(record)
        except KeyboardInterrupt:
            interrupted = True
            log.warning("fit interrupted after %d steps; returning the state so far.", len(history.records))
        if ckpt and saved != first + len(history.records):  # the final state too, whatever its step
            ckpt.save(state, strategy, batches=consumed + len(history.records), force=True)
    finally:  # also on a crash: what was saved stays saved
        if ckpt:
            ckpt.close()
    for cb in callbacks:
        cb.on_train_end(history, interrupted)
    return FitResult(state, history, strategy, interrupted, resumed_from)


def _restore_or_check(
    ckpt: Checkpoints, resume: bool, strategy: Strategy, params: PyTree, tx: optax.GradientTransformation
) -> tuple[TrainState, int, int] | None:
    """With ``resume``: (restored state, batches it had consumed, its step). Without: None, if the directory is new."""
    if not resume:
        if ckpt.steps():
            raise ValueError(
                f"{ckpt.directory} already holds checkpoints (steps {ckpt.steps()}) of an earlier run. "
                "Pass resume=True to continue that run, or give an empty checkpoint_dir for a new one."
            )
        return None
    if ckpt.latest_step() is None:
        raise FileNotFoundError(
            f"resume=True, but {ckpt.directory} holds no checkpoint yet. Start the run without resume "
            f"(it saves every {ckpt.every} steps), or point checkpoint_dir at the interrupted run's."
        )
    restored = ckpt.restore(strategy, params, tx)
    return restored.state, restored.batches, restored.step


def _remaining(batches: Iterable[Batch], steps: int | None, consumed: int) -> tuple[Iterable[Batch], int | None]:
    """The batches still to train on (skipping the ``consumed`` ones), and how many there are if known."""
    known = len(batches) if hasattr(batches, "__len__") else None
    if consumed:
        batches = iter(batches)
        skipped = sum(1 for _ in islice(batches, consumed))
        if skipped < consumed:
            raise ValueError(
                f"The checkpoint was saved after {consumed} batches, but the batches given end after {skipped}. "
                "Pass the same batches as the interrupted run, from its start: fit skips those already trained on."
            )
    if steps is not None:
        left = max(steps - consumed, 0)
        return islice(batches, left), left if known is None else min(left, known - consumed)
    return batches, None if known is None else known - consumed
