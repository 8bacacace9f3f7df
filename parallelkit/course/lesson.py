"""Helpers for the course notebooks: checked settings (:func:`setup`) and exercises that test a prediction or the
learner's code (:func:`check`, :func:`check_function`, :func:`check_orders`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..core.devices import accelerator_count, device_summary, simulate_devices
from ..core.types import is_count, is_number
from ..measure.inspect import COLLECTIVES, parse_collectives

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

    Where the machine has at least ``needs`` accelerators, the lesson runs on them. Where it
    has fewer (one GPU, say), it runs on ``n_devices`` simulated CPU devices instead and
    prints one line saying so; without accelerators, on the simulated CPU devices as ever.

    Args:
      n_devices: simulated CPU devices (``pk.simulate_devices``); on enough accelerators those are used.
      batch: the global batch, which must split evenly over the devices.
      model: a name from ``models``, for ``pk.models.build``.
      models: the models this lesson works with.
      force_cpu: simulate CPU devices even where there are enough accelerators.
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
    accelerators = 0 if force_cpu else accelerator_count()
    if 0 < accelerators < needs:
        print(fallback_line(accelerators, n_devices, needs))
    devices = simulate_devices(n_devices, force_cpu=force_cpu or accelerators < needs)
    if batch is not None and batch % len(devices):
        n = len(devices)
        raise ValueError(
            f"BATCH={batch} does not split evenly over {n} devices: choose a multiple of {n}, "
            f"such as {max(n, round(batch / n) * n)}."
        )
    print(device_summary())
    return devices


def fallback_line(accelerators: int, n_devices: int, needs: int) -> str:
    """The line :func:`setup` prints where the machine has too few accelerators for the lesson.

    >>> print(fallback_line(1, 8, 2))  # doctest: +NORMALIZE_WHITESPACE
    This machine has 1 accelerator and this lesson needs at least 2, so it runs on 8 simulated CPU devices;
    on a machine with 2 or more accelerators it uses them (FORCE_CPU = True keeps the CPU there).
    """
    return (
        f"This machine has {accelerators} accelerator{'s' * (accelerators > 1)} and this lesson needs at least "
        f"{needs}, so it runs on {n_devices} simulated CPU devices; on a machine with {needs} or more accelerators "
        "it uses them (FORCE_CPU = True keeps the CPU there)."
    )


NO_PREDICTION = (
    "no prediction yet for {what}: set prediction = <your answer> in this cell and run it again; "
    "the measured value shows beside your prediction."
)  # what check prints without a prediction: no measured value, so that a plain run reveals no answer


def check(prediction: Any, measured: Any, *, rtol: float = 0.1, what: str = "the answer") -> bool | None:
    """Say how a learner's prediction compares with the measured value.

    A number within ``rtol`` of a measured number counts as right, and so does a tuple of
    numbers each within ``rtol`` of its measured one (an exercise that asks for two numbers);
    any other answer (a name, a tuple of names) must equal the measurement. ``None`` means no prediction yet: the
    measurement stays hidden, so that running the whole notebook reveals no answer, and
    the line says how to enter one. The measured value shows beside the verdict.

    Returns:
      True or False for a prediction, None without one.

    >>> check(8, 8.0, what="the gradient's growth")
    your prediction for the gradient's growth: 8, right (measured 8)
    True
    >>> check("P()", "P('data')", what="the spec")
    your prediction for the spec: 'P()', not quite (measured "P('data')")
    False
    >>> check((2, 1), (2.0, 1.04), what="the two growths")
    your prediction for the two growths: (2, 1), right (measured (2, 1.04))
    True
    >>> check(None, 0.5)  # doctest: +NORMALIZE_WHITESPACE
    no prediction yet for the answer: set prediction = <your answer> in this cell and run it again;
    the measured value shows beside your prediction.
    """
    if prediction is None:
        print(NO_PREDICTION.format(what=what))
        return None
    right = _close(prediction, measured, rtol)
    verdict = "right" if right else "not quite"
    print(f"your prediction for {what}: {_show(prediction)}, {verdict} (measured {_show(measured)})")
    return bool(right)


def _close(prediction: Any, measured: Any, rtol: float) -> bool:
    """Whether a prediction matches: numbers within ``rtol``, tuples element by element, anything else equal."""
    if is_number(prediction) and is_number(measured):
        return bool(abs(prediction - measured) <= rtol * abs(measured))
    if isinstance(prediction, tuple) and isinstance(measured, tuple) and len(prediction) == len(measured):
        return all(_close(mine, theirs, rtol) for mine, theirs in zip(prediction, measured, strict=True))
    return bool(prediction == measured)


def _show(x: Any) -> str:
    """A number to 4 significant figures, a tuple element by element, anything else as its repr."""
    if isinstance(x, tuple):
        return f"({', '.join(map(_show, x))}{',' * (len(x) == 1)})"
    return f"{x:.4g}" if is_number(x) else repr(x)


def check_function(
    learner: Callable[..., Any] | None,
    reference: Callable[..., Any],
    *args: Any,
    what: str,
    needs: str | Sequence[str] = (),
    never: str | Sequence[str] = (),
    rtol: float = 1e-5,
    atol: float = 1e-6,
    timeout: float = 30.0,
) -> bool | None:
    """Run a function the learner wrote and the kit's on the same arguments; say in one sentence how they differ.

    The two must return the same structure of arrays, with equal shapes and dtypes, and values
    within ``rtol``/``atol`` (the course's float32 tolerances). Where the exercise is about
    communication, ``needs`` lists collectives the learner's compiled program must contain and
    ``never`` those it must not (HLO names from :data:`parallelkit.measure.inspect.COLLECTIVES`,
    such as ``"collective-permute"`` or ``"all-reduce"``, one name or several; any other name is
    refused with a ValueError): an all-reduce written with ``ppermute`` must not compile to
    XLA's own all-reduce.

    The learner's function runs in a thread of its own, under the caller's ``jax.set_mesh``
    mesh (other ``with`` settings of JAX's stay behind), and the cell waits ``timeout`` seconds
    for its results (and again for its compiled program): a loop that never ends cannot be
    stopped from outside, and a compiled one ignores even an interrupt, so the cell raises
    instead of waiting for ever and leaves the function running in the background.

    Returns:
      True when it matches, False with the first difference printed, None while ``learner`` is None.

    Raises:
      ValueError: a name in ``needs``/``never`` that is not a collective, or a ``timeout`` that is
        not a number of seconds above 0.
      TimeoutError: the learner's function did not return within ``timeout`` seconds.

    >>> import jax.numpy as jnp
    >>> check_function(lambda x: x * 2, lambda x: x + x, jnp.arange(3.0), what="doubling")
    right: doubling returns what the kit's does
    True
    >>> check_function(lambda x: x[:2], lambda x: x + x, jnp.arange(3.0), what="doubling")
    not yet: it returns shape (2,) where the kit's answer has shape (3,)
    False
    >>> from jax.sharding import PartitionSpec as P
    >>> check_function(lambda: {"kernel": P(None, "model")}, lambda: {"kernel": P("model", None)}, what="the rule")
    not yet: it returns P(None, 'model') at ['kernel'] where the kit's answer has P('model', None)
    False
    """
    needs, never = _names(needs), _names(never)
    unknown = [op for op in (*needs, *never) if op not in COLLECTIVES]
    if unknown:
        raise ValueError(f"needs/never name {unknown}, which are not collectives: choose from {list(COLLECTIVES)}.")
    if not (is_number(timeout) and timeout > 0):
        raise ValueError(
            f"check_function(timeout={timeout!r}): the seconds the learner's function may run, a number above 0. "
            "Pass, say, timeout=30."
        )
    if learner is None:
        print(f"write {what} in the cell above, then run it again")
        return None
    expected = reference(*args)
    got, error = _within(timeout, what, learner, *args)
    difference = _first_difference(got, expected, rtol=rtol, atol=atol) if error is None else _raised(error, what)
    if difference is None and (needs or never):
        ops, error = _within(timeout, what, _collectives, learner, *args)
        difference = _collective_difference(ops, needs, never) if error is None else _raised(error, what)
    if difference is not None:
        print(f"not yet: {difference}")
        return False
    print(f"right: {what} returns what the kit's does" + (f", and compiles to {', '.join(needs)}" if needs else ""))
    return True


def _names(ops: str | Sequence[str]) -> tuple[str, ...]:
    """``needs`` or ``never`` as a tuple of names: a single string is one name, not a sequence of letters."""
    return (ops,) if isinstance(ops, str) else tuple(ops)


def _collectives(fn: Callable[..., Any], *args: Any) -> set[str]:
    """The collectives in ``fn``'s compiled program for ``args`` (their HLO names)."""
    return {c.op for c in parse_collectives(jax.jit(fn).lower(*args).compile().as_text())}


def _within(seconds: float, what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, Exception | None]:
    """``(fn(*args), None)``, computed to the end, or ``(None, error)`` with what it raised.

    ``fn`` runs in a daemon thread, under the caller's ``jax.set_mesh`` mesh: neither a Python
    thread nor a compiled loop can be stopped from outside, so on time-out the thread is left
    to run and the caller gets the error.

    Raises:
      TimeoutError: ``fn`` did not return within ``seconds``.
    """
    mesh, outcome, done = jax.sharding.get_mesh(), {}, threading.Event()

    def run() -> None:
        try:
            with contextlib.nullcontext() if mesh.empty else jax.set_mesh(mesh):
                outcome["result"] = jax.block_until_ready(fn(*args))  # a compiled loop hangs here, not in the caller
        except Exception as error:  # the learner's code: said in one line by _raised
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name=f"pk.lesson: {what}", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(
            f"{what} did not return within {seconds:g} s: look for a loop that never ends (a Python while, or a "
            "jax.lax.while_loop whose condition stays true). It may still be running in the background, since "
            "a running function cannot be stopped: if the notebook slows down, restart the kernel "
            "(Kernel > Restart Kernel) and run the cells again."
        )
    return outcome.get("result"), outcome.get("error")


def _raised(error: Exception, what: str) -> str:
    """What the learner's function raised, in one sentence that says what to change where the cause is known."""
    if isinstance(error, NotImplementedError):
        return f"{what} still raises NotImplementedError; write its body in place of that line"
    if isinstance(error, jax.errors.TracerArrayConversionError):
        return (
            "it hands a traced array to NumPy (TracerArrayConversionError): inside a function JAX traces, NumPy "
            "cannot read the values; use jax.numpy instead (jnp.sum, not np.sum)"
        )
    if isinstance(error, jax.errors.TracerBoolConversionError):
        return (
            "it asks a Python if, while or bool() about a traced value (TracerBoolConversionError): use "
            "jnp.where or jax.lax.cond instead"
        )
    first = str(error).splitlines()[0] if str(error) else ""
    return f"it raised {type(error).__name__}: {first}"


def _first_difference(got: Any, expected: Any, *, rtol: float, atol: float) -> str | None:
    """The first way ``got`` differs from ``expected`` (structure, shape, dtype, value), in words; None if none."""
    if got is None:
        return "it returns None: write its body (replace the ... or the raise) so that it returns a result"
    got_leaves, got_tree = jax.tree.flatten(got)
    want, want_tree = jax.tree.flatten_with_path(expected)
    if got_tree != want_tree:
        found = _structure_difference(got, expected)
        return found or f"it returns the structure {got_tree} where the kit's answer has {want_tree}"
    for mine, (path, theirs) in zip(got_leaves, want, strict=True):
        where = f" at {jax.tree_util.keystr(path)}" if path else ""
        if not (_is_array(mine) and _is_array(theirs)):  # a PartitionSpec, a name: equal or not
            if mine != theirs:
                return f"it returns {mine!r}{where} where the kit's answer has {theirs!r}"
            continue
        if np.shape(mine) != np.shape(theirs):
            return f"it returns shape {np.shape(mine)}{where} where the kit's answer has shape {np.shape(theirs)}"
        if hasattr(mine, "dtype") and hasattr(theirs, "dtype") and mine.dtype != theirs.dtype:  # not Python numbers
            return f"it returns {mine.dtype} values{where} where the kit's answer has {theirs.dtype} ones"
        difference = _value_difference(np.asarray(mine), np.asarray(theirs), where, rtol=rtol, atol=atol)
        if difference is not None:
            return difference
    return None


def _value_difference(mine: np.ndarray, theirs: np.ndarray, where: str, *, rtol: float, atol: float) -> str | None:
    """Where two arrays of one shape differ beyond the tolerances: a NaN or an infinity by place, else by how much."""
    off = ~np.isclose(mine, theirs, rtol=rtol, atol=atol, equal_nan=True)
    if not off.any():
        return None
    mine64, theirs64 = mine.astype(np.float64), theirs.astype(np.float64)
    for bad, name in ((np.isnan, "NaN"), (np.isinf, "an infinity")):
        hit = off & bad(mine64)
        if hit.any():
            first = tuple(int(i) for i in np.argwhere(hit)[0])
            element = f", element [{', '.join(map(str, first))}] ({int(hit.sum())} of {hit.size})" if first else ""
            return f"it returns {name}{where}{element} where the kit's answer has {theirs64[first]:.4g}"
    return f"its values{where} differ from the kit's by up to {float(np.max(np.abs(mine64 - theirs64)[off])):.3g}"


def _structure_difference(got: Any, want: Any, path: str = "") -> str | None:
    """The first place where ``got``'s tree differs from ``want``'s (a key, a length, a kind of node), in words."""
    mine, theirs = _children(got), _children(want)
    if mine is None and theirs is None:  # two leaves: the values are compared elsewhere
        return None
    where = f" at {path}" if path else ""
    same_kind = mine is not None and theirs is not None and type(got) is type(want)
    if not same_kind or (isinstance(got, list | tuple) and len(mine) != len(theirs)):
        return f"it returns {_kind(got)}{where} where the kit's answer has {_kind(want)}"
    if mine.keys() != theirs.keys():
        extra, missing = [k for k in mine if k not in theirs], [k for k in theirs if k not in mine]
        if extra and missing:
            return f"its result{where} has {', '.join(extra)} where the kit's answer has {', '.join(missing)}"
        if missing:
            return f"its result{where} lacks {', '.join(missing)}, which the kit's answer has"
        return f"its result{where} has {', '.join(extra)}, which the kit's answer lacks"
    for key, child in theirs.items():
        found = _structure_difference(mine[key], child, path + key)
        if found is not None:
            return found
    return None


def _children(x: Any) -> dict[str, Any] | None:
    """``x``'s children by key (``"['a']"``, ``"[0]"``, ``".name"``), in order; None where ``x`` is a leaf."""
    pairs, tree = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda node: node is not x)
    if tree.num_nodes == 1 and tree.num_leaves == 1:
        return None
    return {jax.tree_util.keystr(path): child for path, child in pairs}


def _kind(x: Any) -> str:
    """What ``x`` is, in a few words: ``a dict with keys ['a', 'b']``, ``a tuple of 2``, ``an array of shape (3,)``."""
    if x is None:
        return "None"
    name = type(x).__name__
    if isinstance(x, dict):
        return f"{_a(name)} with keys {list(x)}"
    if isinstance(x, list | tuple):
        return f"{_a(name)} of {len(x)}"
    if _is_array(x):
        return f"an array of shape {np.shape(x)}" if np.ndim(x) else "a number"
    return _a(name)


def _a(word: str) -> str:
    return f"{'an' if word[0].lower() in 'aeiou' else 'a'} {word}"


def _is_array(x: Any) -> bool:
    """A number or an array of numbers (what ``np.allclose`` compares), as opposed to a spec or a name."""
    return isinstance(x, jax.Array | np.ndarray | np.generic) or is_number(x)


def _collective_difference(ops: set[str], needs: Sequence[str], never: Sequence[str]) -> str | None:
    """Which required collective the learner's compiled program (its ``ops``) lacks, or which forbidden one it holds."""
    for op in never:
        if op in ops:
            return f"it compiles to {_a(op)}; write it without one (this exercise builds it by hand)"  # an all-reduce
    for op in needs:
        if op not in ops:
            return f"the right values, but its program has no {op}: the exercise asks for one"
    return None


def check_orders(orders: Any, stages: int, microbatches: int) -> bool | None:
    """Play a learner's per-stage pipeline order and say, in one sentence, whether it is a 1F1B order.

    ``orders[s]`` lists stage ``s``'s passes in the order it runs them, each ``("forward", m)``
    or ``("backward", m)`` with ``m`` a whole number (any other pass is refused in words, before
    anything is played). The order is played with a forward pass of 1 and a backward pass
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
    unplayable = _unplayable(orders, schedules.KINDS[:2])
    if unplayable is not None:
        print(f"not yet: {unplayable}")
        return False
    covered = {m for order in orders for _, m in order}
    if len(orders) != stages or covered != set(range(microbatches)):
        print(
            f"not yet: write one order for each of the {stages} stages, covering microbatches 0 to {microbatches - 1}"
        )
        return False
    try:
        played = schedules.timed(
            [[(kind, m, 0) for kind, m in order] for order in orders], {"forward": 1, "backward": 2}
        )
        schedules.check_schedule(played)
    except (ValueError, TypeError, KeyError) as err:
        print(f"not yet: {err}")
        return False
    held, most = schedules.peak_in_flight(played), schedules.peak_in_flight(target)
    over = [s for s in range(stages) if held[s] > most[s]]
    if over:
        print(f"not yet: stage {over[0]} holds {held[over[0]]} microbatches at once, where 1F1B holds {most[over[0]]}")
        return False
    took, best = schedules.makespan(played), schedules.makespan(target)
    if took > best:
        print(f"not yet: it takes {took:g} where 1F1B takes {best:g}")
        return False
    print(f"right: {took:g} time units, at most {list(held.values())} microbatches held per stage")
    return True


def _unplayable(orders: Any, kinds: Sequence[str]) -> str | None:
    """Why ``orders`` cannot be played at all (not lists of pairs, an unknown pass, a microbatch that is not a whole
    number), in words; None if every pass is a ``(kind, microbatch)`` pair of a known kind."""
    pair = 'each stage\'s order is a list of pairs such as ("forward", 0)'
    try:
        passes = [(s, p) for s, order in enumerate(orders) for p in order]
    except TypeError:
        return pair
    for s, p in passes:
        if not isinstance(p, tuple | list) or len(p) != 2:
            return f"stage {s} runs {p!r}, and {pair}"
        kind, m = p
        if kind not in kinds:
            return f"stage {s} runs {tuple(p)!r}, and {kind!r} is not a pass: use {' or '.join(map(repr, kinds))}"
        if not is_count(m, least=0):
            return f"stage {s} runs {tuple(p)!r}, and a microbatch is a whole number (0, 1, ...), not {m!r}"
    return None
