"""The benchmark's figure: samples per second of every strategy, one group of bars per layout."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure


def bench_figure(rows: Sequence[dict], title: str = "") -> Figure:
    """Samples/s per strategy (bars), one colour per layout (devices x processes).

    ``rows`` are the dicts ``python -m parallelkit bench`` writes (keys ``strategy``,
    ``devices``, ``processes``, ``samples_per_s``).

    >>> fig = bench_figure([{"strategy": "SingleDevice", "devices": 1, "processes": 1, "samples_per_s": 10.0}])
    >>> len(fig.axes[0].patches)
    1
    """
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    layouts = list(dict.fromkeys((r["devices"], r["processes"]) for r in rows))
    fig = Figure(figsize=(max(6.0, 0.9 * len(strategies) + 2), 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(layouts)
    for k, (devices, processes) in enumerate(layouts):
        here = [r for r in rows if (r["devices"], r["processes"]) == (devices, processes)]
        values = {r["strategy"]: r["samples_per_s"] for r in here}
        x = [i + k * width for i, s in enumerate(strategies) if s in values]
        label = f"{devices} device{'s' * (devices != 1)}" + (f", {processes} processes" if processes > 1 else "")
        ax.bar(x, [values[s] for s in strategies if s in values], width, label=label)
    ax.set_xticks(np.arange(len(strategies)) + 0.4 - width / 2, strategies, rotation=30, ha="right")
    ax.set_ylabel("samples / s (higher is faster)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig
