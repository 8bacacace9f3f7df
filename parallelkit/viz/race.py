"""A strategy race as a figure: step times, throughput against ideal scaling, scaling efficiency.

Takes the plain data of :class:`parallelkit.widgets.StrategyRace` (a
:class:`~parallelkit.widgets.live.RaceStandings`) and returns a
:class:`matplotlib.figure.Figure` (no pyplot).

>>> from parallelkit.widgets.live import RaceRow, RaceStandings
>>> rows = (RaceRow("one", 1, 9, 9, 0.5, 0.004, 16000.0, 1.0, 1.0, 0.3, True),
...         RaceRow("four", 4, 9, 9, 0.9, 0.002, 32000.0, 0.5, 0.5, 0.3, True))
>>> fig = race_figure(RaceStandings(rows, "one", simulated=False))
>>> [float(p.get_height()) for p in fig.axes[0].patches], [float(p.get_height()) for p in fig.axes[2].patches]
([4.0, 2.0], [1.0, 0.5])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from ..core.devices import device_summary
from .placement import annotate_bar

if TYPE_CHECKING:
    from ..widgets.live import RaceStandings

_REFERENCE, _OTHER = "0.55", "tab:blue"


def race_figure(standings: RaceStandings, title: str = "") -> Figure:
    """Three panels over the race's rows, one bar per strategy in race order.

    - ``axes[0]``: median steady-state step time (ms), each bar labelled with its
      ratio to the reference's (``x1.00`` for the reference itself);
    - ``axes[1]``: throughput (samples/s), with a marker at ideal linear scaling,
      ``N x`` the reference's throughput per device;
    - ``axes[2]``: scaling efficiency, ``throughput_N / (N x throughput_1)``, with the
      ideal 1.0 dashed.

    Strategies that have not run yet have no bar (``nan``). On simulated devices the
    title says how they use the cores (:attr:`DeviceSummary.simulation
    <parallelkit.core.devices.DeviceSummary.simulation>`): sharing them, the times show
    overhead, not speed-up; one core each, the devices compute in parallel (whether that
    beats one device depends on how many cores the one device is given).

    Returns:
      The figure; bar ``k`` of ``axes[0].patches`` has height ``rows[k].median_seconds * 1e3``,
      of ``axes[1]`` ``rows[k].samples_per_second``, of ``axes[2]``
      ``rows[k].scaling_efficiency``; ``axes[1].lines[0]`` is the ideal throughput.
    """
    rows = standings.rows
    names = [r.name for r in rows]
    x = np.arange(len(rows))
    colors = [_REFERENCE if r.name == standings.reference else _OTHER for r in rows]
    median_ms = np.array([r.median_seconds * 1e3 for r in rows])
    throughput = np.array([r.samples_per_second for r in rows])
    efficiency = np.array([r.scaling_efficiency for r in rows])
    ref = next((r for r in rows if r.name == standings.reference), None)
    per_device = ref.samples_per_second / ref.devices if ref else float("nan")
    ideal = np.array([r.devices * per_device for r in rows])

    fig = Figure(figsize=(11, 3.4), layout="constrained")
    axes = fig.subplots(1, 3)
    bars = axes[0].bar(x, median_ms, color=colors, width=0.6)
    for bar, r in zip(bars, rows, strict=True):
        if r.ratio_to_reference == r.ratio_to_reference:
            annotate_bar(axes[0], bar, f"x{r.ratio_to_reference:.2f}")
    axes[0].set_ylabel("median step time (ms)")
    axes[0].set_title(f"step time (x = ratio to {standings.reference})", fontsize=9)

    axes[1].bar(x, throughput, color=colors, width=0.6)
    axes[1].plot(x, ideal, linestyle="none", marker="_", markersize=22, color="tab:red", label="ideal: N x reference")
    axes[1].set_ylabel("samples / s")
    axes[1].set_title("throughput", fontsize=9)
    axes[1].legend(fontsize=7, loc="upper left")

    axes[2].bar(x, efficiency, color=colors, width=0.6)
    axes[2].axhline(1.0, color="tab:red", linestyle="--", linewidth=1)
    axes[2].set_ylabel("throughput_N / (N x throughput_1)")
    axes[2].set_title("scaling efficiency (1 = linear)", fontsize=9)
    top = np.nanmax(efficiency, initial=0.0)
    axes[2].set_ylim(0, max(1.1, top * 1.1))

    for ax in axes:
        ax.set_xticks(x, [f"{n}\n{r.devices} dev" for n, r in zip(names, rows, strict=True)], fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    note = f" · simulated CPU devices, {device_summary().simulation}" if standings.simulated else ""
    state = " · interrupted" if standings.interrupted else ""
    fig.suptitle(f"{title or 'strategy race'}{note}{state}", fontsize=10)
    return fig
