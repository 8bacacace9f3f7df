"""The one mesh factory, :func:`make_mesh`: devices laid out on named axes (``data``, ``fsdp``, ``stage``, ``seq``,
``expert``, ``model``).

>>> mesh = make_mesh(jax.devices()[:1], model=1)
>>> dict(mesh.shape)
{'data': 1, 'model': 1}
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh

from .devices import DeviceCountError, resolve_devices
from .types import DATA, EXPERT, FSDP, MODEL, SEQ, STAGE
from .types import is_count as is_count  # the vocabulary's checks, read here too
from .types import is_number as is_number

_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")

# Outer to inner: model-parallel groups get neighbouring devices. Other names follow these, in the order given.
AXES = (DATA, FSDP, STAGE, SEQ, EXPERT, MODEL)


def make_mesh(
    devices: Sequence[jax.Device] | None = None,
    *,
    data: int | None = None,
    explicit: bool = False,
    **axes: int | None,
) -> Mesh:
    """A mesh over ``devices`` (all by default) with the named axes given.

    Axes left out (or given as ``None``) are absent; ``data=None`` next to other axes
    takes whatever devices remain (``devices / (stage x model)``, say). The product of
    the axis sizes must equal the number of devices. The kit's axes come in the fixed
    outer-to-inner order ``data``, ``fsdp``, ``stage``, ``seq``, ``expert``, ``model``
    (:data:`AXES`); any other name comes after them, in the order given. Devices keep
    their order, so with ``model`` innermost the devices of one tensor-parallel group
    are neighbours, which on real machines usually share the fastest links.

    >>> dict(make_mesh(jax.devices()[:1], seq=1, data=1).shape)
    {'data': 1, 'seq': 1}

    Args:
      devices: the devices, in order, or a count (the first ones); ``jax.devices()`` by default.
      data: the ``data`` axis size; ``None`` takes the devices the other axes leave.
      **axes: other axis sizes by name (``stage``, ``model``, ``seq``, ...; whole numbers >= 1).
      explicit: every axis ``AxisType.Explicit`` (an array's sharding is part of its type,
        ``jax.typeof(x)``; JAX's ``jax.make_mesh`` default) instead of ``AxisType.Auto``.

    Returns:
      A ``jax.sharding.Mesh`` with the axes in that order, each with ``AxisType.Auto``
      (shardings propagate through the program, as with ``Mesh(...)``) or, with ``explicit``,
      ``AxisType.Explicit``.

    Raises:
      ValueError: ``explicit`` that is not a bool, an axis size that is not a whole number >= 1, sizes whose product
        is not the device count (the message names the numbers), an empty axis name, one
        that differs from a kit axis only by case or spaces (``Model``, ``"data "``), or a
        device listed twice.
    """
    if not isinstance(explicit, bool):
        raise ValueError(f"make_mesh(explicit={explicit!r}): pass True (Explicit axes) or False (Auto axes).")
    devices = resolve_devices(devices)
    for name in axes:  # refuse an empty name, and one that differs from the kit's own only by case or spaces
        if not name.strip():
            raise ValueError(f"Mesh axis name {name!r} is empty: name it, for example {MODEL}=... or {SEQ}=....")
        near = [axis for axis in AXES if axis == name.strip().lower()]
        if near and name != near[0]:
            raise ValueError(
                f"Mesh axis {name!r} is not the kit's {near[0]!r}: axis names are exact, and rules for {near[0]!r} "
                f"would never split it. Write {near[0]}=...."
            )
    sizes = {DATA: data, **{name: axes[name] for name in AXES if name in axes}, **axes}
    for name, size in sizes.items():
        if size is not None and not is_count(size):
            raise ValueError(f"Mesh axis {name!r} needs a whole number >= 1, got {size!r}.")
    fixed = math.prod(size for size in sizes.values() if size is not None)
    if data is None:
        if len(devices) % fixed:
            raise DeviceCountError(
                f"{len(devices)} devices do not split into groups of {fixed} "
                f"({_spell(sizes)}): use a device count divisible by {fixed}."
            )
        sizes[DATA] = len(devices) // fixed
    shape = {name: size for name, size in sizes.items() if size is not None}
    if math.prod(shape.values()) != len(devices):
        raise DeviceCountError(
            f"A mesh of {_spell(shape)} needs {math.prod(shape.values())} devices, but {len(devices)} were given. "
            "Make the axis sizes multiply to the device count, or pass that many devices."
        )
    names = tuple(shape)
    grid = np.array(devices, dtype=object).reshape([shape[name] for name in names])
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    return Mesh(grid, names, axis_types=(kind,) * len(names))


def is_explicit(mesh: Mesh) -> bool:
    """Whether every axis of ``mesh`` is ``AxisType.Explicit`` (False: every axis ``Auto``).

    >>> is_explicit(make_mesh(jax.devices()[:1], data=1, explicit=True))
    True

    Raises:
      ValueError: a mesh that mixes the two, or has ``Manual`` axes (the kit's strategies take one mode).
    """
    kinds = set(mesh.axis_types)
    if kinds == {jax.sharding.AxisType.Explicit}:
        return True
    if kinds <= {jax.sharding.AxisType.Auto}:
        return False
    raise ValueError(
        f"The mesh's axes are {dict(zip(mesh.axis_names, mesh.axis_types, strict=True))}: a strategy runs every "
        "axis Auto or every axis Explicit. Build it with pk.mesh.make_mesh(..., explicit=True or False)."
    )


def _spell(sizes: dict[str, int | None]) -> str:
    return " x ".join(f"{name}={size}" for name, size in sizes.items() if size is not None)


def outside_callers_mesh(fn: Callable[_Args, _Result]) -> Callable[_Args, _Result]:
    """``fn`` run with no mesh set, when its caller set one (``with jax.set_mesh(mesh):``).

    A strategy's programs carry their own shardings on their own devices. A caller's mesh would meet
    them inside ``jax.jit`` with JAX's mismatch errors (an Explicit mesh, ``jax.make_mesh``'s default,
    in the optimizer's first ``zeros_like``), so the strategy runs them as it would outside the block.
    An SPMD step on an Explicit mesh sets its own mesh inside.

    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> with jax.set_mesh(mesh):
    ...     outside_callers_mesh(lambda: jax.sharding.get_abstract_mesh().empty)()
    True
    """

    @functools.wraps(fn)
    def run(*args: _Args.args, **kwargs: _Args.kwargs) -> _Result:
        if jax.sharding.get_abstract_mesh().empty:  # the usual case: nothing to set aside
            return fn(*args, **kwargs)
        with jax.set_mesh(None):
            return fn(*args, **kwargs)

    return run
