"""``fit``: a small training loop over any strategy; what it does besides stepping, callbacks do."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from ..core.contract import batch_size
from ..core.devices import device_summary
from ..core.precision import Precision, PrecisionWarning
from ..core.skipped import NonFiniteGradientsError
from ..core.state import TrainState
from ..core.step import DONATED_STATE, Placed, Step, is_deleted
from ..core.types import Batch, LossFn, PyTree, is_count
from ..data import Dataset
from ..strategies.base import Strategy
from .callbacks import (
    Callback,
    Checkpointing,
    History,
    NonFiniteCheck,
    NonFiniteLossError,
    RunInfo,
    SkippedStepsCheck,
    StepRecord,
    nonfinite_gradients,
)
from .checkpoint import Checkpoints, host_step, restore_or_check
from .prefetch import prefetch as prefetch_batches
from .signals import InterruptsDeferred

__all__ = [
    "Callback",
    "FitResult",
    "History",
    "NonFiniteGradientsError",
    "NonFiniteLossError",
    "RunInfo",
    "ShortRunWarning",
    "StepRecord",
    "fit",
]

log = logging.getLogger(__name__)


class ShortRunWarning(UserWarning):
    """``pk.fit`` trained fewer steps than asked, or none: its batches ended first."""


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
    check_finite: bool = True,
    model_state: PyTree = None,
    rng: int | jax.Array | None = None,
    prefetch: int = 0,
    accumulate: int = 1,
    precision: Precision | None = None,
) -> FitResult:
    """Train ``params`` with ``strategy`` on global ``batches``; record loss, metrics and timing.

    Args:
      strategy: any parallelkit strategy.
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, dict of metrics)``: scalars, recorded as
        floats, or arrays (recorded as NumPy arrays).
      params, tx: initial parameters and the Optax optimizer.
      batches: an iterable of global batches (dicts of host arrays), such as
        ``pk.data.batches(dataset, size, steps=N)``; the strategy splits them. When resuming,
        the same batches as the interrupted run, from its start.
      steps: stop after this many steps of the run, counted from its start (default:
        when ``batches`` ends). Batches that end before ``steps``, or give none, warn
        (:class:`ShortRunWarning`).
      callbacks: :class:`Callback` objects, told of every step after ``fit``'s own check and
        checkpoint (:mod:`parallelkit.run.callbacks`).
      state: continue from this placed state instead of ``strategy.init(params, tx)``.
      checkpoint_dir: save checkpoints here (see :mod:`parallelkit.run.checkpoint`); on a
        cluster, a directory every process sees.
      checkpoint_every: save every this many steps (and always after the last one).
      checkpoint_keep: how many checkpoints to keep (``None``: all).
      resume: restore the newest checkpoint in ``checkpoint_dir`` onto ``strategy``
        and continue from it, skipping the batches it had consumed.
      check_finite: stop with :class:`NonFiniteLossError` when the loss becomes NaN or infinite (that
        step changes nothing: see Raises) and, with
        a loss scale, with :class:`~parallelkit.core.skipped.NonFiniteGradientsError` when steps are
        skipped ``SKIPPED_STEPS_LIMIT`` (20) times in a row under a fixed scale, or at a dynamic
        scale's floor of 1 (:mod:`parallelkit.core.skipped`), naming the parameters whose gradients
        are not finite.
      model_state, rng: mutable model state (BatchNorm statistics) and a PRNG seed or key
        (dropout) for the state, as for ``strategy.init``; ``loss_fn`` then receives them
        (see :class:`parallelkit.TrainState`).
      prefetch: how many batches a background thread places on the devices ahead of
        the step that needs them (:func:`parallelkit.run.prefetch`), so that copying a batch
        overlaps the step before it and is not in the step's time; 0 (the default)
        places each batch inside its step. Off by default because the one measurement
        here, on a 2-core CPU, found it slower (``benchmarks/prefetch.py``: the copy is a
        fraction of a millisecond and the thread competes with the step for the cores).
        On a GPU try 2: Flax's ``flax.jax_utils.prefetch_to_device`` documentation
        recommends 2 there, to overlap a step on the GPU with the next batch's copy; this
        project has not measured it.
      accumulate, precision: as for ``strategy.step`` (microbatches a step, and a
        :class:`~parallelkit.Precision` policy). A checkpoint holds a dynamic loss scale
        too, so a resumed run continues with the scale it had: the checkpoint's scale wins
        over ``initial_scale`` (logged when they differ). A checkpoint with a scale resumed
        without a dynamic policy, or one without a scale resumed with one, warns
        (``pk.PrecisionWarning``).

    Returns:
      A :class:`FitResult`. Interrupting the kernel (KeyboardInterrupt) ends the run
      early and returns what was trained so far with ``interrupted=True``, so no
      work is lost (and saves a checkpoint of it, with ``checkpoint_dir``). The
      interrupt is held back while a step is being dispatched, so the state returned
      is always the complete result of the last step.

    An exception from a callback or from the data ends the run too: it is raised as
    it was, with the state of the last completed step checkpointed (with
    ``checkpoint_dir``) and attached as ``err.fit_result`` (a :class:`FitResult`).

    The ``state`` passed in is consumed: its buffers are donated to the first step.
    Continue from ``result.state``; passing a consumed state again is a ``ValueError``.

    Raises:
      ValueError: ``steps``, ``checkpoint_every`` or ``prefetch`` not a whole number (at least 0,
        1 and 0); ``resume`` without ``checkpoint_dir`` or together with ``state``;
        ``batches`` shorter than what the checkpoint had consumed; or, without
        ``resume``, a ``checkpoint_dir`` that already holds another run's checkpoints.
      FileNotFoundError: ``resume=True`` but ``checkpoint_dir`` holds no checkpoint.
      TypeError: ``batches`` is not an iterable of batches (one batch, or a ``pk.data`` dataset).
      NonFiniteLossError: the loss became NaN or infinite (the message names the step). The
        step changed nothing, so ``err.fit_result`` holds the state after the step before it:
        its donated input, kept by a step compiled to return it unchanged (``Step.keep_finite``).
        An async parameter server's step is one update a worker, each kept or applied by its own
        loss, so the state also holds that step's updates whose loss was finite. The note says
        which step the state is after and whether it is all finite.
      NonFiniteGradientsError: with a loss scale, step after step was skipped (see ``check_finite``).
    """
    _check_batches(batches)
    _check_counts(steps, checkpoint_every, prefetch)
    _check_resume(resume, checkpoint_dir, state)
    ckpt = Checkpoints(checkpoint_dir, every=checkpoint_every, keep=checkpoint_keep) if checkpoint_dir else None
    with ckpt or contextlib.nullcontext():  # closed also on a crash: what was saved stays saved
        restored = restore_or_check(ckpt, resume, strategy, params, tx, model_state, rng) if ckpt else None
        state, consumed, resumed_from = (state, 0, None) if restored is None else restored
        if restored is not None:
            _tell_resumed_scale(strategy, state, precision)
        batches, total = _remaining(batches, steps, consumed)
        if state is not None and any(is_deleted(x) for x in jax.tree.leaves(state)):
            raise ValueError(f"fit(state=...): {DONATED_STATE}")
        info = RunInfo(repr(strategy), len(strategy.devices), total, device_summary().simulated)
        state = strategy.init(params, tx, model_state=model_state, rng=rng) if state is None else state
        step = _training_step(strategy, loss_fn, accumulate, precision, check_finite)
        counted = host_step(strategy, state) if ckpt or check_finite else 0  # the counter before this run's steps
        run = _Run(strategy, state, counted, first=counted if ckpt else 0, resumed_from=resumed_from)
        hooks = _own_hooks(run, loss_fn, step, precision, check_finite, ckpt, consumed) + list(callbacks)
        feed = prefetch_batches(batches, strategy, prefetch) if prefetch else iter(batches)
        try:
            history, interrupted = _loop(run, step, feed, hooks, info)
        finally:  # the prefetching thread ends, also on a crash
            if prefetch:
                feed.close()
        if not interrupted:
            _tell_short_run(len(history.records), steps, consumed)
        for cb in hooks:
            cb.on_train_end(history, interrupted)
    return FitResult(run.state, history, strategy, interrupted, resumed_from)


@dataclass
class _Run:
    """What :func:`fit`'s loop rebinds each step (``state``, ``batch``), read by the hooks that need the latest."""

    strategy: Strategy
    state: TrainState
    counted: int  # the state's step counter when the run began
    first: int  # the step the run's numbering starts from (the counter, with checkpoints; else 0)
    resumed_from: int | None
    batch: Batch | Placed | None = None


def _training_step(
    strategy: Strategy, loss_fn: LossFn, accumulate: int, precision: Precision | None, check_finite: bool
) -> Step:
    """``strategy.step(loss_fn)`` with the options asked for; with ``check_finite``, a step whose loss is not finite
    changes nothing (the check then stops the run)."""
    options = {"accumulate": accumulate} if accumulate != 1 else {}
    options |= {"precision": precision} if precision is not None else {}
    step = strategy.step(loss_fn, **options)
    step.keep_finite = check_finite
    return step


def _own_hooks(
    run: _Run,
    loss_fn: LossFn,
    step: Step,
    precision: Precision | None,
    check_finite: bool,
    ckpt: Checkpoints | None,
    consumed: int,
) -> list[Callback]:
    """``fit``'s own callbacks, told of each step before the user's: the non-finite checks, then checkpointing."""
    hooks: list[Callback] = [NonFiniteCheck(run.first)] if check_finite else []
    if check_finite and precision is not None and precision.loss_scale is not None:

        def nonfinite(scale: float) -> list[str]:  # reads the state and batch as the loop rebinds them
            host = run.batch.batch if isinstance(run.batch, Placed) else run.batch
            return nonfinite_gradients(loss_fn, run.strategy.unreplicate(run.state.params), host, precision, scale)

        hooks.append(SkippedStepsCheck(precision, run.first, nonfinite))
        step.watch = None  # the check above stops the run: the step need not warn as well
    if ckpt:  # reads the state as the loop rebinds it
        saving = Checkpointing(
            ckpt, run.strategy, lambda: run.state, first=run.first, consumed=consumed, saved=run.resumed_from
        )
        hooks.append(saving)
    return hooks


def _loop(
    run: _Run, step: Step, feed: Iterable[Batch], hooks: Sequence[Callback], info: RunInfo
) -> tuple[History, bool]:
    """Every step on ``feed``, each recorded and told to ``hooks``; returns the history and whether it was interrupted.

    A KeyboardInterrupt ends the run with the state so far; any other error is raised with it attached
    (:func:`_hand_over`).
    """
    history, pending = History(), None  # pending: the step whose state is bound but not yet recorded
    try:
        for cb in hooks:
            cb.on_train_begin(info)
        for i, batch in enumerate(feed, start=1):
            run.batch, start = batch, time.perf_counter()
            with InterruptsDeferred():  # between the old state's donation and the new one's binding
                run.state, metrics = step(run.state, batch)
                pending = (i, start, metrics, batch.size if isinstance(batch, Placed) else batch_size(batch))
            record, pending = history.record(*pending, run.state), None
            for cb in hooks:
                cb.on_step_end(record)
    except KeyboardInterrupt:
        if pending is not None:  # interrupted while waiting for a step: its state is the one we hold
            history.record(*pending, run.state)
        log.warning("fit interrupted after %d steps; returning the state so far.", len(history.records))
        return history, True
    except Exception as err:
        _hand_over(err, run, history, pending, hooks)
        raise
    return history, False


def _hand_over(err: Exception, run: _Run, history: History, pending: tuple | None, hooks: Sequence[Callback]) -> None:
    """Attach the state of the last completed step to ``err`` (``err.fit_result``), with a note saying what it holds,
    and tell ``hooks``. The state is intact: the step rebinds it at once."""
    if pending is not None:
        with contextlib.suppress(Exception):  # a step that failed on the device leaves nothing to keep
            history.record(*pending, run.state)
    err.fit_result = FitResult(run.state, history, run.strategy, True, run.resumed_from)
    err.add_note(_stopped_note(err, run.strategy, run.state, run.counted, run.first, len(history.records)))
    for cb in hooks:
        cb.on_train_error(history, err)


def _stopped_note(err: Exception, strategy: Strategy, state: TrainState, counted: int, first: int, done: int) -> str:
    """What the state handed over with ``err`` holds, after ``done`` steps of a run.

    ``counted``: the state's step counter when the run began; ``first``: the step the run's numbering
    starts from. After a :class:`NonFiniteLossError` the counter tells whether the last step kept its
    input state (``Step.keep_finite``), and the note whether that state is all finite.
    """
    if not isinstance(err, NonFiniteLossError):
        return (
            f"pk.fit stopped after {done} completed steps; the state after the last one is in this exception's "
            "`fit_result` attribute."
        )
    per = getattr(strategy, "updates_per_step", 1)  # an async parameter server's step is one update a worker
    taken = host_step(strategy, state) - counted  # the updates of this run the state has taken
    last, before = first + done, (done - 1) * per  # before: the updates of the steps whose loss was finite
    kept = taken < before + per  # the non-finite step kept its input state, or some of its updates did
    held = f"the state after step {last - 1}" if done > 1 else "the state the run started from"
    if taken == before:
        held += ", the last step whose loss was finite" if done > 1 else ""
        held += f" (step {last} changed nothing)"
    elif kept:
        held += (
            f" and the {taken - before} of step {last}'s {per} updates whose loss was finite (the other "
            f"{before + per - taken} changed nothing)"
        )
    else:
        held = f"the state after step {last}, whose loss was not finite: {strategy!r} applied its update"
    if all(np.isfinite(x).all() for x in jax.tree.leaves(strategy.unreplicate((state.params, state.opt_state)))):
        verdict = "All its parameters and optimizer state are finite."
    else:
        why = (
            ": an update whose loss was finite made them so (gradients not finite, or a step too large)" if kept else ""
        )
        verdict = (
            f"Not all its parameters and optimizer state are finite{why}. Pass checkpoint_dir to keep earlier states."
        )
    return f"pk.fit stopped at step {last} of the run; this exception's `fit_result` holds {held}. {verdict}"


def _tell_short_run(done: int, steps: int | None, consumed: int) -> None:
    """Warn when the batches ended before ``steps`` (``consumed``: those a resumed run skipped), or gave none."""
    asked = None if steps is None else steps - consumed
    if done >= (1 if asked is None else asked):
        return
    ran = (
        "pk.fit trained no step"
        if asked is None
        else f"pk.fit(steps={steps}) trained {done} of the {asked} steps asked"
    )
    if done:
        why = f"the batches ended after {consumed + done}"
    elif consumed:
        why = f"the batches ended with the {consumed} the checkpoint had consumed, so the state is the checkpoint's"
    else:
        why = "the batches yielded none (an empty or used-up iterator), so the state is the one it started from"
    warnings.warn(
        f"{ran}: {why}. Pass a batch for every step, for example pk.data.batches(dataset, size, steps=N) made anew "
        "for each run (without steps or epochs it never ends).",
        ShortRunWarning,
        stacklevel=3,
    )


def _check_batches(batches: Any) -> None:
    """Refuse what fit cannot iterate as batches (one batch, a dataset), saying how to make batches of it."""
    how = "pk.data.batches(dataset, batch_size, steps=N), which yields dicts of batch_size examples"
    if isinstance(batches, Dataset):
        raise TypeError(f"fit(batches=...) got the dataset {batches.name!r} itself, not batches of it. Pass {how}.")
    if isinstance(batches, Mapping):
        raise TypeError(
            f"fit(batches=...) got one batch (a {type(batches).__name__} with keys {list(batches)}), not an "
            "iterable of batches. Pass [batch] to train one step on it, itertools.repeat(batch, N) for N steps, "
            f"or {how}."
        )
    if not isinstance(batches, Iterable) and not hasattr(batches, "__getitem__"):  # iter() could start a loader
        raise TypeError(
            f"fit(batches=...) got a value of type {type(batches).__name__}, which is not an iterable of batches. "
            f"Pass a list of batches (dicts of arrays) or {how}."
        )


def _tell_resumed_scale(strategy: Strategy, state: TrainState, precision: Precision | None) -> None:
    """Say which loss scale a resumed run goes on with: the checkpoint's, if it has one and the policy is dynamic."""
    dynamic = precision is not None and precision.dynamic
    if state.loss_scale is None:
        if dynamic:
            warnings.warn(
                f"The checkpoint holds no loss scale (its run had no dynamic one), so this run starts one at "
                f"initial_scale={precision.initial_scale:g}.",
                PrecisionWarning,
                stacklevel=3,
            )
        return
    saved = float(np.asarray(strategy.unreplicate(state.loss_scale.scale)).reshape(-1)[0])
    if not dynamic:
        warnings.warn(
            f"The checkpoint holds a dynamic loss scale ({saved:g}), but this run's precision={precision!r} has "
            "none, so it goes unused. Resume with the run's own policy (for example pk.Precision.fp16()) to keep it.",
            PrecisionWarning,
            stacklevel=3,
        )
    elif saved != precision.initial_scale:
        log.warning(
            "Resumed with the checkpoint's loss scale %g: the scale is part of the run's state, and "
            "initial_scale=%g applies to a new run only.",
            saved,
            precision.initial_scale,
        )


def _check_counts(steps: int | None, checkpoint_every: int, prefetch: int) -> None:
    """Refuse counts that would train silently wrong (``steps=-1`` trained nothing) or fail far from their cause."""
    for name, value, least in (
        ("steps", steps, 0),
        ("checkpoint_every", checkpoint_every, 1),
        ("prefetch", prefetch, 0),
    ):
        if value is None and name == "steps":
            continue
        if not is_count(value, least):
            raise ValueError(f"fit({name}={value!r}): give a whole number of at least {least}.")


def _check_resume(resume: bool, checkpoint_dir: str | Path | None, state: TrainState | None) -> None:
    if resume and checkpoint_dir is None:
        raise ValueError(
            "resume=True needs checkpoint_dir: the directory the interrupted run saved its checkpoints to."
        )
    if resume and state is not None:
        raise ValueError("Give state or resume=True, not both: resuming restores the state from checkpoint_dir.")


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
