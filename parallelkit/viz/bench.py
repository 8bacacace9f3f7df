"""The benchmark's figure: samples per second of every strategy, one group of bars per layout."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure


def bench_figure(rows: Sequence[dict], title: str = "") -> Figure:
    """Samples/s per strategy (bars), one colour per layout (devices x processes).

    ``rows`` are the dicts ``python -m parallelkit bench`` writes (keys ``strategy``,
    ``devices``, ``processes``, ``samples_per_s``, and ``equals_single`` where known).
    A row whose parameters left one device's (``equals_single`` false) is hatched and
    labelled "differs from 1 device": its speed is that of another computation.

    >>> fig = bench_figure([{"strategy": "SingleDevice", "devices": 1, "processes": 1, "samples_per_s": 10.0},
    ...                     {"strategy": "Mirrored", "devices": 1, "processes": 1, "samples_per_s": 9.0,
    ...                      "equals_single": False}])
    >>> [p.get_hatch() for p in fig.axes[0].patches], [t.get_text() for t in fig.axes[0].texts]
    ([None, 'xx'], ['differs from 1 device'])
    """
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    layouts = list(dict.fromkeys((r["devices"], r["processes"]) for r in rows))
    fig = Figure(figsize=(max(6.0, 0.9 * len(strategies) + 2), 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(layouts)
    for k, (devices, processes) in enumerate(layouts):
        here = [r for r in rows if (r["devices"], r["processes"]) == (devices, processes)]
        values = {r["strategy"]: r["samples_per_s"] for r in here}
        differs = {r["strategy"] for r in here if r.get("equals_single") is False}
        x = [i + k * width for i, s in enumerate(strategies) if s in values]
        label = f"{devices} device{'s' * (devices != 1)}" + (f", {processes} processes" if processes > 1 else "")
        bars = ax.bar(x, [values[s] for s in strategies if s in values], width, label=label)
        for bar, name in zip(bars, [s for s in strategies if s in values], strict=True):
            if name in differs:
                bar.set_hatch("xx")
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), "differs from 1 device",
                        rotation=90, ha="center", va="bottom", fontsize=7, color="red")  # fmt: skip
    ax.set_xticks(np.arange(len(strategies)) + 0.4 - width / 2, strategies, rotation=30, ha="right")
    ax.set_ylabel("samples / s (higher is faster)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig
