"""Where a step's time goes, read from a profiler trace (:func:`profile`): computing, communicating, transferring."""

from __future__ import annotations

import re
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from ..core.step import check_step_call
from .timing import timed

COMPUTE, COLLECTIVE, TRANSFER = "compute", "collective", "transfer"
KINDS = (COMPUTE, COLLECTIVE, TRANSFER)
_COLLECTIVE_OP = re.compile(
    r"^(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all|ragged-all-to-all|"
    r"collective-broadcast|send|recv)(-start|-done)?(\.\d+)?$"
)
_TRANSFER_OP = re.compile(r"^copy-(start|done)(\.\d+)?$")
_HOST_TRANSFER = re.compile(r"DevicePut|TransferToDevice|TransferFromDevice|Memcpy[HD]to[HD]|Memcpy[HD]2[HD]")
_DEVICE_PLANE = re.compile(r"^/device:[A-Z]+:(\d+)")


@dataclass(frozen=True)
class Event:
    """One operation in the trace."""

    device: int | None  # device ordinal; None for the host
    name: str  # the HLO operation (or the host event's name)
    kind: str  # "compute", "collective" or "transfer"
    start_s: float  # seconds after the trace's first event
    seconds: float


@dataclass(frozen=True)
class DeviceTime:
    """Seconds one device (or the host, ``device=None``) spent in each kind of work."""

    device: int | None
    compute_s: float
    collective_s: float
    transfer_s: float
    overlap_s: float  # computing while a collective was in flight


@dataclass(frozen=True)
class TraceSummary:
    """What the devices did during the traced steps."""

    trace_path: Path  # the Perfetto trace (open it in ui.perfetto.dev)
    steps: int
    events: tuple[Event, ...]
    devices: tuple[DeviceTime, ...]

    @property
    def collective_ops(self) -> set[str]:
        """The collectives seen, by HLO name without its number (``all-reduce``, ...)."""
        return {re.sub(r"\.\d+$", "", e.name) for e in self.events if e.kind == COLLECTIVE}

    def seconds(self, kind: str) -> float:
        """Seconds in ``kind`` summed over devices (and the host)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: choose one of {KINDS}.")
        return sum(getattr(d, f"{kind}_s") for d in self.devices)

    def __str__(self) -> str:
        rows = [f"{'device':>6}  {'compute ms':>10}  {'collective ms':>13}  {'transfer ms':>11}  {'overlap ms':>10}"]
        for d in self.devices:
            name = "host" if d.device is None else str(d.device)
            rows.append(
                f"{name:>6}  {d.compute_s * 1e3:>10.3f}  {d.collective_s * 1e3:>13.3f}  "
                f"{d.transfer_s * 1e3:>11.3f}  {d.overlap_s * 1e3:>10.3f}"
            )
        return f"{self.steps} steps traced ({self.trace_path})\n" + "\n".join(rows)


def kind_of(op_name: str) -> str:
    """The kind of a device operation from its HLO name.

    >>> kind_of("all-reduce.6"), kind_of("copy-start.2"), kind_of("dot.4")
    ('collective', 'transfer', 'compute')
    """
    if _COLLECTIVE_OP.match(op_name):
        return COLLECTIVE
    return TRANSFER if _TRANSFER_OP.match(op_name) else COMPUTE


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum((b - a for a, b in intervals), 0.0)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where two sorted, disjoint interval lists overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def device_times(events: Iterable[Event]) -> tuple[DeviceTime, ...]:
    """Per device, the union of each kind's intervals and the overlap of compute with collectives.

    >>> evs = [Event(0, "dot", "compute", 0.0, 2.0), Event(0, "all-reduce", "collective", 1.0, 2.0)]
    >>> device_times(evs)[0]
    DeviceTime(device=0, compute_s=2.0, collective_s=2.0, transfer_s=0.0, overlap_s=1.0)
    """
    by_device: dict[int | None, dict[str, list[tuple[float, float]]]] = {}
    for e in events:
        by_device.setdefault(e.device, {k: [] for k in KINDS})[e.kind].append((e.start_s, e.start_s + e.seconds))
    found = []
    for device in sorted(by_device, key=lambda d: -1 if d is None else d):
        spans = {k: _union(v) for k, v in by_device[device].items()}
        found.append(
            DeviceTime(
                device=device,
                compute_s=_length(spans[COMPUTE]),
                collective_s=_length(spans[COLLECTIVE]),
                transfer_s=_length(spans[TRANSFER]),
                overlap_s=_intersection(spans[COMPUTE], spans[COLLECTIVE]),
            )
        )
    return tuple(found)


def _event(plane_name: str, name: str, start_ns: float, duration_ns: float, stats: dict) -> Event | None:
    """The :class:`Event` of one raw trace event, or None for host bookkeeping."""
    plane = _DEVICE_PLANE.match(plane_name)
    if "hlo_op" in stats or (plane and "Memcpy" in name):
        device = int(stats["device_ordinal"]) if "device_ordinal" in stats else int(plane.group(1)) if plane else None
        kind = TRANSFER if "Memcpy" in name else kind_of(str(stats.get("hlo_op", name)))
        return Event(device, str(stats.get("hlo_op", name)), kind, start_ns / 1e9, duration_ns / 1e9)
    if _HOST_TRANSFER.search(name):
        return Event(None, name, TRANSFER, start_ns / 1e9, duration_ns / 1e9)
    return None


def _read_trace(xplane_path: str | Path) -> list[Event]:
    """The device operations and host transfers of a trace, times from its first event.

    Args:
        xplane_path: the ``*.xplane.pb`` file that ``jax.profiler.trace`` wrote.
    """
    found = []
    with _unnamed_types_allowed():
        data = jax.profiler.ProfileData.from_file(str(xplane_path))
        for plane in data.planes:
            for line in plane.lines:
                for raw in line.events:
                    event = _event(plane.name, raw.name, raw.start_ns, raw.duration_ns, dict(raw.stats))
                    if event is not None:
                        found.append(event)
    origin = min((e.start_s for e in found), default=0.0)
    return sorted(
        (Event(e.device, e.name, e.kind, e.start_s - origin, e.seconds) for e in found), key=lambda e: e.start_s
    )


@contextmanager
def _unnamed_types_allowed() -> Iterator[None]:
    """Ignore, for the block only, Python 3.12+'s warning about jaxlib's trace types.

    ``ProfileData`` creates its types (``plane_stats``, ``event_stats``) on first use without a
    module name, which Python 3.12 and later warn about (a DeprecationWarning). Under
    ``-W error`` or pytest's ``filterwarnings = error`` the warning becomes an exception inside
    the extension, which aborts the process. Every other warning still reaches the caller.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"builtin type \w+ has no __module__ attribute", DeprecationWarning)
        yield


def _latest_run(logdir: Path) -> Path:
    runs = [p for p in (logdir / "plugins" / "profile").iterdir() if p.is_dir()]
    return max(runs, key=lambda p: p.stat().st_mtime)


def profile(
    step: Any, state: Any, batch: Any, steps: int = 3, logdir: str | Path | None = None, *, warmup: bool = True
) -> tuple[Any, TraceSummary]:
    """Run ``steps`` steps under the JAX profiler and summarize where each device's time went.

    Each step is waited for before the next starts (``jax.block_until_ready``), so the
    trace shows steps one after another. With ``warmup`` one more step runs first,
    outside the trace, so that tracing and compiling the step stay out of it.

    Args:
        step: a strategy's step (``strategy.step(loss_fn)``): ``step(state, batch)`` returns
            ``(state, metrics)``.
        state: its state.
        batch: the batch every traced step takes.
        steps: how many steps to trace.
        logdir: where the trace goes (default: a new temporary folder).
        warmup: run one untraced step first (the returned state has then taken ``steps + 1``).

    Returns:
        ``(state, summary)``: the state after the steps, and the :class:`TraceSummary`.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"profile(steps={steps!r}): trace at least one step (an int >= 1).")
    check_step_call("pk.profile", step, state)
    logdir = Path(logdir) if logdir is not None else Path(tempfile.mkdtemp(prefix="parallelkit-trace-"))
    if warmup:
        (state, _), _ = timed(step, state, batch)  # timed: waits for the step's every output
    with jax.profiler.trace(str(logdir), create_perfetto_trace=True):
        for _ in range(steps):
            (state, _), _ = timed(step, state, batch)
    run = _latest_run(logdir)
    xplanes = sorted(run.glob("*.xplane.pb"))
    if not xplanes:
        raise RuntimeError(f"The profiler wrote no *.xplane.pb file in {run}: check that jax.profiler works here.")
    events = [e for path in xplanes for e in _read_trace(path)]
    summary = TraceSummary(
        trace_path=run / "perfetto_trace.json.gz", steps=steps, events=tuple(events), devices=device_times(events)
    )
    return state, summary
