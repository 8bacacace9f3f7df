"""Plain data behind the live views: what a run has recorded so far, and its summary.

Nothing here imports ipywidgets or matplotlib: the widgets in this package are thin
views over these dataclasses, and the tests check the data, not the pixels.

>>> log = LiveTimes(strategy="Mirrored(backend='jit', devices=8)", devices=8, batch_size=64)
>>> for s in (1.5, 0.02, 0.04, 0.03):
...     log.add(s)
>>> log.summary().median_seconds
0.03
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..timing import StepTimes, scaling_efficiency


@dataclass(frozen=True)
class TimingSummary:
    """One snapshot of a run: what the dashboard shows, as numbers."""

    strategy: str
    devices: int
    simulated: bool
    steps_done: int
    steps_total: int | None
    first_step_seconds: float  # trace + compile + one step; nan before the first step
    compile_seconds: float  # first step minus a steady step (the estimate StepTimes gives)
    median_seconds: float  # steady state: every step after the first; nan until there is one
    samples_per_second: float  # from the median step; nan without a batch size
    steps_per_second: float
    loss: float
    interrupted: bool
    finished: bool


@dataclass
class LiveTimes:
    """Step times and losses of a run as they arrive; :meth:`times` is the same
    :class:`~parallelkit.timing.StepTimes` that ``History.times`` gives at the end."""

    strategy: str = ""
    devices: int = 1
    simulated: bool = False
    steps_total: int | None = None
    batch_size: int = 0
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    interrupted: bool = False
    finished: bool = False

    def add(self, seconds: float, loss: float = float("nan")) -> None:
        self.seconds.append(float(seconds))
        self.losses.append(float(loss))

    @property
    def times(self) -> StepTimes:
        if not self.seconds:
            raise ValueError("No step has run yet.")
        return StepTimes(self.seconds[0], tuple(self.seconds[1:]), self.batch_size)

    def summary(self) -> TimingSummary:
        nan = float("nan")
        times = self.times if self.seconds else None
        median = times.median if times else nan
        return TimingSummary(
            strategy=self.strategy,
            devices=self.devices,
            simulated=self.simulated,
            steps_done=len(self.seconds),
            steps_total=self.steps_total,
            first_step_seconds=times.first_step_seconds if times else nan,
            compile_seconds=times.compile_seconds if times else nan,
            median_seconds=median,
            samples_per_second=self.batch_size / median if self.batch_size and median == median else nan,
            steps_per_second=1.0 / median if median == median and median > 0 else nan,
            loss=self.losses[-1] if self.losses else nan,
            interrupted=self.interrupted,
            finished=self.finished,
        )


def format_summary(s: TimingSummary) -> str:
    """One line of text: the dashboard outside a notebook, and its headline inside one.

    >>> s = TimingSummary("SingleDevice(devices=1)", 1, False, 3, 10, 1.2, 1.19, 0.01, 6400.0, 100.0, 0.5, False, False)
    >>> format_summary(s)
    'SingleDevice(devices=1) · 1 device · step 3/10 · compile 1.19 s · median 10.00 ms · 6,400 samples/s · loss 0.5000'
    """
    parts = [s.strategy, f"{s.devices} device{'s' * (s.devices != 1)}" + (" (simulated)" if s.simulated else "")]
    parts.append(f"step {s.steps_done}" + (f"/{s.steps_total}" if s.steps_total else ""))
    if s.steps_done:
        parts.append(f"compile {s.compile_seconds:.2f} s")
    if s.median_seconds == s.median_seconds:
        parts.append(f"median {s.median_seconds * 1e3:.2f} ms")
        if s.samples_per_second == s.samples_per_second:
            parts.append(f"{s.samples_per_second:,.0f} samples/s")
        else:
            parts.append(f"{s.steps_per_second:,.1f} steps/s")
    if s.loss == s.loss:
        parts.append(f"loss {s.loss:.4f}")
    if s.interrupted:
        parts.append("INTERRUPTED")
    elif s.finished:
        parts.append("done")
    return " · ".join(parts)


@dataclass(frozen=True)
class RaceRow:
    """One strategy of a :class:`~parallelkit.widgets.StrategyRace`, relative to the reference."""

    name: str
    devices: int
    steps_done: int
    median_seconds: float
    samples_per_second: float
    ratio_to_reference: float  # median step time / the reference's (SingleDevice) median
    scaling_efficiency: float  # throughput_N / (N x throughput_1)
    final_loss: float


def race_rows(runs: dict[str, LiveTimes], reference: str | None) -> list[RaceRow]:
    """Compare runs with ``runs[reference]`` (the single-device one): ratio and scaling efficiency."""
    ref = runs[reference].summary() if reference in runs and runs[reference].seconds else None
    rows = []
    for name, log in runs.items():
        s = log.summary()
        ratio = s.median_seconds / ref.median_seconds if ref else float("nan")
        eff = (
            scaling_efficiency(s.samples_per_second, ref.samples_per_second, s.devices) if ref else float("nan")
        )
        rows.append(RaceRow(name, s.devices, s.steps_done, s.median_seconds, s.samples_per_second, ratio, eff, s.loss))
    return rows


def svg_polyline(values: np.ndarray | list[float], width: int = 360, height: int = 90) -> str:
    """A tiny SVG line chart of ``values`` (no matplotlib: cheap enough to redraw live).

    The points are in ``data-values`` too, so a browser test can read what was drawn.
    """
    v = np.asarray(values, dtype=float)
    pad = 4
    if v.size == 0:
        points = ""
        top = 0.0
    else:
        top = float(np.nanmax(v)) or 1.0
        x = np.linspace(pad, width - pad, v.size) if v.size > 1 else np.array([width / 2])
        y = height - pad - (v / top) * (height - 2 * pad)
        points = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(x, y, strict=True))
    data = ",".join(f"{x:.6g}" for x in v)
    return (
        f'<svg class="pk-line" width="{width}" height="{height}" data-values="{data}" '
        f'style="border:1px solid #ddd;background:#fff">'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{points}"/>'
        f'<text x="{pad}" y="12" font-size="10" fill="#555">max {top * 1e3:.2f} ms</text></svg>'
    )
