"""Compile a strategy's step for a TPU topology this machine lacks: :func:`devices`, :func:`compile`."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import optax

from ..core.contract import batch_size
from ..core.devices import quiet_libtpu
from ..core.precision import Precision
from ..core.step import Placed
from ..core.types import Batch, LossFn, PyTree
from .inspect import Collective, parse_collectives

if TYPE_CHECKING:
    from ..core.protocol import StrategyProtocol as Strategy

_GENERATIONS = ("v4", "v5e", "v5p", "v6e")  # the TPU generations whose topologies libtpu describes
_TOPOLOGY = re.compile(r"^(?P<generation>[a-z0-9]+):(?P<shape>\d+(?:x\d+){1,2})$")
INSTALL = 'pip install "parallelkit[tpu]"'


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device of the target holds for one step, as the TPU compiler planned them (``memory_analysis()``).

    ``peak`` is the compiler's own figure, not a sum of the others: for the MLPs of the tests it
    exceeds arguments + outputs + temporaries - aliased. libtpu 0.0.42 (JAX 0.10) reports their
    temporaries as 0, libtpu 0.0.50 (JAX 0.12) as 1.6-3.1 MB, with the same peaks.
    """

    arguments: int  # inputs: parameters, optimizer state, the batch's slice
    outputs: int  # results: the new state and the metrics
    temporaries: int  # scratch as XLA counts it (temp_size_in_bytes): activations, gathered weights, buffers
    aliased: int  # outputs written into donated inputs (counted once, not twice)
    peak: int  # the most the device holds at once: XLA's peak_memory_in_bytes for this program


@dataclass(frozen=True)
class _CompiledStep:
    """A step compiled for a target machine: what it holds, sends and computes there, and its program."""

    target: str  # the devices, e.g. "16 TPU v5 lite"
    memory: DeviceMemory
    collectives: list[Collective]  # pk.inspect.collectives' rows, with .asynchronous and .overlaps
    flops: float  # the compiler's count for one device's program
    hlo: str  # the compiled text

    def summary(self) -> str:
        """One line: the target, the peak per device, and how many collectives of each kind (async ones apart)."""
        kinds: dict[str, list[int]] = {}
        for c in self.collectives:
            row = kinds.setdefault(c.op, [0, 0])
            row[0] += 1
            row[1] += c.asynchronous
        counts = ", ".join(f"{n} {op}" + (f" ({a} async)" if a else "") for op, (n, a) in kinds.items())
        return f"{self.target}: peak {self.memory.peak / 2**20:.1f} MiB a device; {counts or 'no collectives'}"


def available() -> bool:
    """Whether the TPU compiler (the ``libtpu`` package) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def devices(topology: str) -> list[jax.Device]:
    """The devices of a TPU topology, described without the chips: build a strategy on them to compile for it.

    Args:
      topology: a generation and a shape, ``"v5e:4x4"``, ``"v5p:4x4x4"``, ``"v4:2x2x1"``, ``"v6e:8x8"``.

    Returns:
      The target's devices (``platform == "tpu"``), which no array can live on: pass them to a strategy's
      ``devices=`` and its step to :func:`compile`.

    Raises:
      ModuleNotFoundError: the TPU compiler is not installed.
      ValueError: a topology name libtpu does not describe.
    """
    generation = _check_topology(topology)
    _require_libtpu()
    from jax.experimental import topologies  # loads libtpu: only here, never at import

    with quiet_libtpu():
        try:
            return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
        except Exception as err:  # libtpu's own sentence, which says what it expected
            raise ValueError(
                f"libtpu does not describe topology={topology!r} ({err}). Pass a {generation} shape that its hosts "
                f"divide, such as {generation}:2x2" + ("x1." if generation in ("v4", "v5p") else ".")
            ) from err


def compile(  # noqa: A001 (pk.aot.compile, as jax's .compile: the name says what it does)
    strategy: Strategy,
    loss_fn: LossFn,
    params: PyTree,
    optimizer: optax.GradientTransformation,
    batch: Batch,
    *,
    precision: Precision | None = None,
) -> _CompiledStep:
    """Compile ``strategy.step(loss_fn)`` for the devices it was built on, from shapes: nothing is allocated.

    Conceptually, this is::

        state = strategy.init(params, optimizer)
        compiled = strategy.step(loss_fn, precision=precision).lower(state, batch).compile()

    with ``params`` and ``batch`` as shapes (arrays are read only for their shapes and dtypes), so a
    model far larger than this machine's memory compiles all the same.

    Args:
      strategy: an SPMD strategy (``Mirrored(backend="jit")``, ``FullySharded``, ``Hybrid``, ...) built on
        the target's devices, ``devices=pk.aot.devices("v5e:4x4")``.
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), as for ``strategy.step``.
      params: the parameters, as arrays or ``jax.ShapeDtypeStruct``.
      optimizer: the optax optimizer.
      batch: one global batch, as arrays or ``jax.ShapeDtypeStruct`` (a dict of them, or one).
      precision: as for ``strategy.step``.

    Returns:
      The :class:`_CompiledStep`: memory per device, collectives, FLOPs and the program's text.

    Raises:
      TypeError: a strategy that does not lay its state and batch out with shardings (pmap, the off-device
        strategies, a pipeline), or one built on devices that are not a TPU topology's.
    """
    _check_target(strategy)
    shapes = _shapes(params)
    try:
        state_shardings, batch_shardings = strategy.state_shardings(shapes, optimizer), strategy.batch_shardings
    except AttributeError as err:
        raise TypeError(
            f"pk.aot.compile got {strategy!r}, which does not lay its state out with shardings: pass an SPMD "
            "strategy (Mirrored(backend='jit'), FullySharded, Hybrid, TensorParallel, ...) built on "
            "devices=pk.aot.devices(topology)."
        ) from err
    state = jax.eval_shape(lambda p: strategy.init(p, optimizer), shapes)
    state = jax.tree.map(_with_sharding, state, state_shardings)
    host = _shapes(batch)
    placed = _laid_out(host, batch_shardings(host))
    compiled = strategy.step(loss_fn, precision=precision).lower(state, Placed(placed, batch_size(host), strategy))
    return _report(strategy, compiled.compile())


def _report(strategy: Strategy, compiled: Any) -> _CompiledStep:
    """The :class:`_CompiledStep` of a compiled program."""
    stats, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost  # one dict per program in some JAX versions
    hlo = compiled.as_text()
    kind = strategy.devices[0].device_kind
    return _CompiledStep(
        target=f"{len(strategy.devices)} {kind}",
        memory=DeviceMemory(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            temporaries=int(stats.temp_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            peak=int(stats.peak_memory_in_bytes),
        ),
        collectives=parse_collectives(hlo),
        flops=float(cost.get("flops", 0.0)),
        hlo=hlo,
    )


def _check_topology(topology: object) -> str:
    """The generation of a topology name, or a ValueError that names it and the shapes to pass."""
    m = _TOPOLOGY.match(topology) if isinstance(topology, str) else None
    if not m or m.group("generation") not in _GENERATIONS:
        raise ValueError(
            f"pk.aot.devices got topology={topology!r}, which names no TPU topology it knows. Pass a generation "
            f"among {', '.join(_GENERATIONS)} and a shape of chips, such as 'v5e:4x4' or 'v5p:4x4x4'."
        )
    return m.group("generation")


def _check_target(strategy: object) -> None:
    """Refuse a strategy built on devices that are not a TPU topology's (its step would compile for them)."""
    platforms = {d.platform for d in getattr(strategy, "devices", ())}
    if platforms != {"tpu"}:
        raise TypeError(
            f"pk.aot.compile got {strategy!r}, built on {sorted(platforms) or 'no'} devices, not a TPU topology's: "
            "build it on devices=pk.aot.devices('v5e:4x4') (any topology) to compile for that machine."
        )


def _require_libtpu() -> None:
    if not available():
        raise ModuleNotFoundError(
            f"pk.aot needs the TPU compiler, the libtpu package, which is not installed. Install it with "
            f"{INSTALL} (about 680 MB; it keeps jax, jaxlib and libtpu in step)."
        )


def _shapes(tree: PyTree) -> PyTree:
    """Every array of ``tree`` as a ``jax.ShapeDtypeStruct`` (its shape and dtype only)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _with_sharding(leaf: Any, sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _laid_out(batch: PyTree, shardings: jax.sharding.Sharding | Mapping) -> PyTree:
    """``batch``'s shapes with the strategy's sharding for each array (one for all, or one per key)."""
    if isinstance(shardings, Mapping):
        return {key: _with_sharding(batch[key], shardings[key]) for key in batch}
    return jax.tree.map(lambda leaf: _with_sharding(leaf, shardings), batch)
