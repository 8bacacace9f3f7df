"""Plain data behind the live views: what a run has recorded so far, and its summary.

Nothing here imports ipywidgets or matplotlib: the live views beside it in :mod:`parallelkit.viz`
are thin views over these dataclasses, and the tests check the data, not the pixels.

>>> log = LiveTimes(strategy="Mirrored(backend='jit', devices=8)", devices=8, batch_size=64)
>>> for s in (1.5, 0.02, 0.04, 0.03):
...     log.add(s)
>>> log.summary().median_seconds
0.03
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.devices import device_summary
from ..measure.timing import StepTimes, scaling_efficiency


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
    :class:`~parallelkit.measure.timing.StepTimes` that ``History.times`` gives at the end."""

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
        return StepTimes.of(self.seconds, self.batch_size)

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


def number_or_dash(value: float, spec: str, unit: str = "") -> str:
    """``value`` formatted by ``spec``, then ``unit``; a dash for nan (nothing measured yet)."""
    return "–" if value != value else f"{value:{spec}}{unit}"


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
    """One strategy of a :class:`~parallelkit.viz.StrategyRace`, measured against the reference."""

    name: str
    devices: int
    steps_done: int
    steps_total: int | None
    compile_seconds: float
    median_seconds: float  # steady state, as ``History.times.median``
    samples_per_second: float
    ratio_to_reference: float  # median step time / the reference's median: 1.0 for the reference itself
    scaling_efficiency: float  # throughput_N / (N x throughput_1): 1.0 is perfect linear scaling
    final_loss: float
    finished: bool


@dataclass(frozen=True)
class RaceStandings:
    """Where a race stands: one row per strategy (in race order), and how to read them."""

    rows: tuple[RaceRow, ...]
    reference: str | None  # the row the ratios and efficiencies are relative to
    simulated: bool  # simulated CPU devices (the views say how they use the cores)
    running: str | None = None  # the strategy training now
    interrupted: bool = False

    def row(self, name: str) -> RaceRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"No strategy {name!r} in this race; it has {[r.name for r in self.rows]}.")


def race_rows(runs: dict[str, LiveTimes], reference: str | None) -> list[RaceRow]:
    """Compare every run with ``runs[reference]`` (a single-device run): step-time ratio and scaling efficiency.

    The efficiency is ``throughput_N / (N x throughput_1)``, with ``throughput_1`` the
    reference's throughput per device (its own throughput when it runs on one device).
    Runs without a steady step yet, or without a reference, get ``nan``.

    >>> runs = {"one": LiveTimes(devices=1, batch_size=64), "four": LiveTimes(devices=4, batch_size=64)}
    >>> for s in (1.0, 0.04, 0.04):
    ...     runs["one"].add(s)
    >>> for s in (2.0, 0.02, 0.02):
    ...     runs["four"].add(s)
    >>> [(r.ratio_to_reference, r.scaling_efficiency) for r in race_rows(runs, "one")]
    [(1.0, 1.0), (0.5, 0.5)]
    """
    nan = float("nan")
    ref = runs[reference].summary() if reference in runs and runs[reference].seconds else None
    rows = []
    for name, log in runs.items():
        s = log.summary()
        ratio = s.median_seconds / ref.median_seconds if ref else nan
        eff = scaling_efficiency(s.samples_per_second, ref.samples_per_second / ref.devices, s.devices) if ref else nan
        rows.append(
            RaceRow(
                name,
                s.devices,
                s.steps_done,
                s.steps_total,
                s.compile_seconds,
                s.median_seconds,
                s.samples_per_second,
                ratio,
                eff,
                s.loss,
                s.finished,
            )
        )
    return rows


def format_race(standings: RaceStandings) -> str:
    """The race as a text table: the view outside a notebook.

    >>> row = RaceRow("SingleDevice", 1, 30, 30, 0.5, 0.002, 32000.0, 1.0, 1.0, 0.25, True)
    >>> print(format_race(RaceStandings((row,), "SingleDevice", simulated=False)))
    strategy          devices   steps  compile s  median ms   samples/s  x ref  efficiency      loss
    SingleDevice            1   30/30       0.50      2.000      32,000   1.00        100%    0.2500
    """
    lines = [
        f"{'strategy':<16}{'devices':>9}{'steps':>8}{'compile s':>11}{'median ms':>11}"
        f"{'samples/s':>12}{'x ref':>7}{'efficiency':>12}{'loss':>10}"
    ]
    for r in standings.rows:
        steps = f"{r.steps_done}/{r.steps_total}" if r.steps_total else str(r.steps_done)
        numbers = (
            (r.compile_seconds, 11, ".2f"),
            (r.median_seconds * 1e3, 11, ".3f"),
            (r.samples_per_second, 12, ",.0f"),
            (r.ratio_to_reference, 7, ".2f"),
            (r.scaling_efficiency, 12, ".0%"),
            (r.final_loss, 10, ".4f"),
        )
        cells = "".join(f"{number_or_dash(v, spec):>{width}}" for v, width, spec in numbers)
        lines.append(f"{r.name:<16}{r.devices:>9}{steps:>8}{cells}")
    if standings.simulated:
        lines.append(simulated_note())
    if standings.interrupted:
        lines.append("INTERRUPTED: the race stopped early")
    return "\n".join(lines)


def simulated_note() -> str:
    """What the views add to numbers measured on simulated devices: ``simulated CPU devices, <how>``."""
    return f"simulated CPU devices, {device_summary().simulation}"


def svg_polyline(values: np.ndarray | list[float], unit: str = "ms", width: int = 360, height: int = 90) -> str:
    """A tiny SVG line chart of ``values``, in ``unit`` (no matplotlib: cheap enough to redraw live).

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
        f'<text x="{pad}" y="12" font-size="10" fill="#555">max {top:.2f} {unit}</text></svg>'
    )
