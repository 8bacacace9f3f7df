"""The ceilings of this machine, measured by short microbenchmarks and cached (:func:`measure_ceilings`): matmul
FLOP/s, memory bandwidth, the all-reduce's latency and bandwidth."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .costmodel.links import fit_alpha_beta as fit_alpha_beta
from .timing import timed

CACHE_ENV = "PARALLELKIT_CACHE_DIR"
_AXIS = "d"


@dataclass(frozen=True)
class Measured:
    """One measured number with its unit and how it was measured."""

    value: float
    unit: str
    method: str

    def __str__(self) -> str:
        return f"{self.value:.4g} {self.unit}  ({self.method})"


@dataclass(frozen=True)
class Ceilings:
    """What one device of this machine delivers, and (with 2+ devices) what an all-reduce costs."""

    key: str  # the machine: platform, device kind, device count, JAX version, mode
    matmul_f32: Measured  # FLOP/s
    matmul_bf16: Measured  # FLOP/s
    memory: Measured  # bytes/s, read + written
    allreduce_latency: Measured | None  # seconds (alpha); None with one device
    # bytes/s (1 / beta): the algorithm bandwidth, buffer bytes per device over seconds; None with one device
    allreduce_bandwidth: Measured | None

    def figures(self) -> dict[str, Measured]:
        """The figures that were measured, by name."""
        return {name: value for name, value in self.__dict__.items() if isinstance(value, Measured)}

    def __str__(self) -> str:
        return "\n".join([f"measured on {self.key}"] + [f"  {k}: {v}" for k, v in self.figures().items()])


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> float:
    """Median wall-clock seconds of ``fn(*args)`` over ``repeats`` calls (:func:`.timing.timed`), after a warm-up."""
    jax.block_until_ready(fn(*args))  # trace + compile + one run: not timed
    return float(np.median([timed(fn, *args)[1] for _ in range(repeats)]))


def matmul_flops(device: jax.Device, n: int, dtype: Any = jnp.float32, repeats: int = 5) -> Measured:
    """FLOP/s of an ``n x n`` by ``n x n`` product on ``device``: ``2 n^3`` FLOPs over its median time."""
    x = jax.device_put(jnp.ones((n, n), dtype), device)
    seconds = median_seconds(jax.jit(jnp.dot), x, x, repeats=repeats)
    name = jnp.dtype(dtype).name
    return Measured(2 * n**3 / seconds, "FLOP/s", f"{name} {n}x{n} matmul, median of {repeats}")


def memory_bandwidth(device: jax.Device, elements: int, repeats: int = 5) -> Measured:
    """Bytes/s of ``x + 1`` in place on a float32 array of ``elements``: each element read once, written once.

    The input is donated, so each call writes into the memory it reads: a fresh output
    buffer would be paid for in page faults on first touch, not in bandwidth.
    """
    step = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    held = [jax.device_put(jnp.zeros((elements,), jnp.float32), device)]

    def once() -> jax.Array:
        held[0] = step(held[0])
        return held[0]

    seconds = median_seconds(once, repeats=repeats)
    method = f"x + 1 in place on {4 * elements / 2**20:.0f} MiB float32, read + write, median of {repeats}"
    return Measured(2 * 4 * elements / seconds, "B/s", method)


def _allreduce_times(devices: Sequence[jax.Device], sizes: Sequence[int], repeats: int = 5) -> list[float]:
    """Median seconds of a ``psum`` over ``devices`` of each float32 buffer size (elements per device)."""
    mesh = Mesh(np.asarray(devices), (_AXIS,))
    sharding = NamedSharding(mesh, P(_AXIS))
    summed = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, _AXIS), mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS)))
    times = []
    for size in sizes:
        x = jax.device_put(jnp.ones((len(devices) * size,), jnp.float32), sharding)
        times.append(median_seconds(summed, x, repeats=repeats))
    return times


def _allreduce_figures(
    devices: Sequence[jax.Device], sizes: Sequence[int], repeats: int = 5
) -> tuple[Measured, Measured]:
    """(latency, bandwidth) of the alpha-beta model fitted to ``psum`` times over ``devices``."""
    nbytes = [4 * s for s in sizes]
    alpha, beta = fit_alpha_beta(nbytes, _allreduce_times(devices, sizes, repeats))
    if alpha <= 0 or beta <= 0:
        raise RuntimeError(
            f"All-reduce times over {len(devices)} devices do not fit t = alpha + beta x bytes with alpha, beta > 0 "
            f"(alpha={alpha:.3g} s, beta={beta:.3g} s/B; noise from other work on this machine?): measure again "
            "on a quieter machine, or with quick=False for larger sizes."
        )
    method = (
        f"psum over {len(devices)} devices of {nbytes[0]} B to {nbytes[-1]} B per device, "
        f"least-squares fit t = alpha + beta x bytes, median of {repeats}"
    )
    return Measured(alpha, "s", method), Measured(1.0 / beta, "B/s", method)


def _machine_key(devices: Sequence[jax.Device], quick: bool) -> str:
    """A file-name-safe key for these devices on this machine, JAX version and mode."""
    first = devices[0]
    raw = f"{first.platform}-{first.device_kind}-{len(devices)}dev-jax{jax.__version__}-{'quick' if quick else 'full'}"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


def cache_dir() -> Path:
    """Where measured ceilings are kept: ``$PARALLELKIT_CACHE_DIR``, else ``~/.cache/parallelkit``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "parallelkit")


def _load(path: Path) -> Ceilings | None:
    try:
        raw = json.loads(path.read_text())
        return Ceilings(**{k: Measured(**v) if isinstance(v, dict) else v for k, v in raw.items()})
    except (OSError, ValueError, TypeError):
        return None  # missing or unreadable: measure again


def measure_ceilings(
    devices: Sequence[jax.Device] | None = None,
    *,
    quick: bool = True,
    cache: bool = True,
    refresh: bool = False,
    directory: str | os.PathLike | None = None,
) -> Ceilings:
    """Measure (or read from the cache) this machine's matmul, memory and all-reduce ceilings.

    Args:
        devices: the devices to measure (default: all); matmul and memory use the first.
        quick: small sizes, a few seconds in all; False for larger sizes, closer to the peaks.
        cache: read and write the cache file; False measures and writes nothing.
        refresh: measure again and overwrite the cached figures.
        directory: the cache folder (default :func:`cache_dir`).

    Returns:
        The :class:`Ceilings`, all-reduce figures ``None`` with a single device.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("measure_ceilings(devices=[]): pass at least one device, or None for all of them.")
    key = _machine_key(devices, quick)
    path = Path(directory or cache_dir()) / f"ceilings-{key}.json"
    if cache and not refresh and (found := _load(path)) is not None:
        return found
    n, elements, sizes = (
        (512, 2**24, [2**k for k in range(10, 21, 2)]) if quick else (2048, 2**26, [2**k for k in range(10, 25, 2)])
    )
    latency, bandwidth = _allreduce_figures(devices, sizes) if len(devices) > 1 else (None, None)
    result = Ceilings(
        key=key,
        matmul_f32=matmul_flops(devices[0], n, jnp.float32),
        matmul_bf16=matmul_flops(devices[0], n, jnp.bfloat16),
        memory=memory_bandwidth(devices[0], elements),
        allreduce_latency=latency,
        allreduce_bandwidth=bandwidth,
    )
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(result), indent=1))
    return result
