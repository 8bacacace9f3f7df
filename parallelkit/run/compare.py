"""Train strategies side by side from one start, time them, and compare each with a reference
(:func:`run_side_by_side`)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np
import optax

from ..core.contract import batch_size
from ..core.protocol import StrategyProtocol
from ..core.types import Batch, LossFn, PyTree, is_count
from ..measure.timing import StepTimes
from .callbacks import Callback, History
from .training import FitResult, fit

RTOL, ATOL = 1e-5, 1e-6  # the float32 tolerance of every equivalence in parallelkit


def max_abs_diff(a: PyTree, b: PyTree) -> float:
    """Largest absolute difference between two parameter trees of the same structure."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def assert_close(actual: PyTree, expected: PyTree, rtol: float = RTOL, atol: float = ATOL) -> float:
    """Assert two trees of the same structure agree leaf by leaf (NumPy's ``allclose`` rule); return max |diff|.

    >>> round(assert_close({"w": np.ones(3)}, {"w": np.ones(3) + 1e-7}), 9)
    1e-07
    >>> assert_close({"w": np.ones(3)}, {"w": np.ones(3) + 0.1})
    Traceback (most recent call last):
    ...
    AssertionError: ...
    Not equal to tolerance rtol=1e-05, atol=1e-06
    leaf ['w'] differs...
    """
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(actual)[0], strict=True)
    if jax.tree.structure(actual) != jax.tree.structure(expected):
        raise AssertionError(
            f"The trees differ in structure: {jax.tree.structure(actual)} vs {jax.tree.structure(expected)}"
        )
    for path, x, y in zip(paths, leaves, jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=f"leaf {jax.tree_util.keystr(path)} differs"
        )
    return max_abs_diff(actual, expected)


def compare(trained: PyTree, reference: PyTree) -> tuple[float, bool]:
    """(largest |difference|, whether every parameter is within rtol 1e-5, atol 1e-6 of ``reference``)."""
    try:
        return assert_close(trained, reference), True
    except AssertionError:
        return max_abs_diff(trained, reference), False


@dataclass(frozen=True)
class Run:
    """One strategy's run beside the others: what :func:`fit` returns, its times, and how far it ended
    from the reference's parameters."""

    name: str
    result: FitResult
    times: StepTimes  # the first step apart; the steps after warm-up
    max_param_diff: float  # max |param - reference param| at the end
    equals_reference: bool  # every parameter within rtol 1e-5, atol 1e-6 of the reference's
    meant_to_equal: bool = True  # False: differs from the reference by design (asynchronous updates)

    @property
    def params(self) -> PyTree:
        return self.result.params

    @property
    def devices(self) -> int:
        return len(self.result.strategy.devices)


def run_side_by_side(
    strategies: Mapping[str, StrategyProtocol],
    loss_fn: LossFn,
    params: PyTree,
    tx: optax.GradientTransformation,
    batches: Callable[[], Iterable[Batch]] | Sequence[Batch],
    *,
    steps: int | None = None,
    warmup: int = 0,
    interleave: bool = False,
    seed: int = 0,
    prefetch: int = 0,
    reference: str | None = None,
    against: PyTree | None = None,
    meant_to_differ: Collection[str] = (),
    callbacks: Callable[[str], Sequence[Callback]] | None = None,
) -> dict[str, Run]:
    """Train every strategy from ``params`` on the same batches; each :class:`Run` compared with a reference.

    Args:
      strategies: name -> strategy, run in this order.
      loss_fn, params, tx: the model's loss, its initial parameters and the optimizer, shared by every run.
      batches: a list of global batches, or a function returning a fresh iterable of them
        (every run needs the same batches, so a one-shot iterator is refused).
      steps: train this many steps (default: every batch).
      warmup: steps after the first left out of the times (none left: the median is nan).
      interleave: one step of every strategy per batch, in a fresh order each round (``seed``),
        the garbage collector off; otherwise one :func:`fit` after another.
      prefetch: batches placed ahead by a background thread (sequential runs; see :func:`fit`).
      reference: the run the others are compared with (default: the first).
      against: compare with these parameters instead (say, a differently built model's run).
      meant_to_differ: names whose difference from the reference is by design (recorded, not a failure).
      callbacks: name -> the callbacks of that strategy's :func:`fit` (sequential runs).

    Returns:
      name -> :class:`Run`, in ``strategies``' order. A run interrupted from the keyboard
      ends the comparison: the runs so far are returned (``run.result.interrupted``).

    Raises:
      ValueError: no strategies, an unknown ``reference``, ``steps`` or ``warmup`` that is not a whole
        number (>= 1, >= 0), a one-shot iterator of batches, or callbacks with ``interleave``.

    Example:
      >>> import optax, parallelkit as pk
      >>> apply, params = pk.models.build("mlp", (64,), 10)
      >>> batches = list(pk.data.batches(pk.data.digits(), 32, steps=4))
      >>> runs = run_side_by_side({"one": pk.SingleDevice(), "two": pk.Mirrored(2)},
      ...                         pk.models.classifier_loss(apply), params, optax.sgd(0.1), batches)
      >>> [(name, run.equals_reference, len(run.times.step_seconds)) for name, run in runs.items()]
      [('one', True, 3), ('two', True, 3)]
    """
    if not strategies:
        raise ValueError("run_side_by_side needs at least one strategy, e.g. {'SingleDevice': pk.SingleDevice()}.")
    if reference is not None and reference not in strategies:
        raise ValueError(f"reference={reference!r} is not one of the strategies {list(strategies)}.")
    if steps is not None and not is_count(steps):
        raise ValueError(f"steps={steps!r}: train a whole number of steps >= 1, or None for every batch.")
    if isinstance(warmup, bool) or not (warmup == 0 or is_count(warmup)):
        raise ValueError(f"warmup={warmup!r}: leave out a whole number of steps >= 0 after the first.")
    fresh = fresh_batches(batches)
    if interleave and callbacks is not None:
        raise ValueError("Callbacks follow one fit at a time: run with interleave=False to use them.")
    if interleave:
        results = _interleaved(strategies, loss_fn, params, tx, list(fresh())[:steps], seed)
    else:
        results = _sequential(strategies, loss_fn, params, tx, fresh, steps, prefetch, callbacks)
    first = next(iter(results.values()))
    expected = against if against is not None else results.get(reference, first).params
    runs = {}
    for name, result in results.items():
        seconds = [r.seconds for r in result.history.records] or [float("nan")]  # nan: stopped before a step
        times = StepTimes.of(seconds, result.history.batch_size, skip=warmup)
        diff, equal = compare(result.params, expected)
        runs[name] = Run(name, result, times, diff, equal, name not in meant_to_differ)
    return runs


def fresh_batches(batches: Callable[[], Iterable[Batch]] | Sequence[Batch]) -> Callable[[], Iterable[Batch]]:
    """A function returning the same batches afresh for every run; a one-shot iterator is refused.

    Raises:
      ValueError: ``batches`` is an iterator, which the first run would use up.
    """
    if callable(batches):
        return batches
    if iter(batches) is batches:
        raise ValueError(
            "The batches are a one-shot iterator, which the first run would use up. Pass a list of batches or "
            "a function that returns fresh ones, e.g. lambda: pk.data.batches(dataset, 64, steps=30)."
        )
    return lambda: batches


def _sequential(strategies, loss_fn, params, tx, fresh, steps, prefetch, callbacks) -> dict[str, FitResult]:
    results = {}
    for name, strategy in strategies.items():
        hooks = callbacks(name) if callbacks else ()
        results[name] = fit(strategy, loss_fn, params, tx, fresh(), steps=steps, callbacks=hooks, prefetch=prefetch)
        if results[name].interrupted:
            break
    return results


def _interleaved(strategies, loss_fn, params, tx, batches, seed) -> dict[str, FitResult]:
    names = list(strategies)
    states = {name: strategy.init(params, tx) for name, strategy in strategies.items()}
    compiled = {name: strategy.step(loss_fn) for name, strategy in strategies.items()}
    histories = {name: History() for name in names}

    def one(name: str, i: int, batch: Batch) -> None:
        start = time.perf_counter()
        states[name], metrics = compiled[name](states[name], batch)
        histories[name].record(i, start, metrics, batch_size(batch), states[name])

    order, enabled = np.random.default_rng(seed), gc.isenabled()
    try:
        for i, batch in enumerate(batches, start=1):
            if i == 1:  # the first step (compiling) of each, in the given order, before the clock matters
                for name in names:
                    one(name, i, batch)
                gc.disable()
                continue
            for k in order.permutation(len(names)):
                one(names[k], i, batch)
    finally:
        if enabled:
            gc.enable()
    return {name: FitResult(states[name], histories[name], strategies[name]) for name in names}
