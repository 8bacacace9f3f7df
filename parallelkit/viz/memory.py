"""Bytes per device under each strategy, as stacked bars beside a formula's figures.

>>> fig = memory_figure({"one": {"parameters": 40, "optimizer": 80}}, formula={"one": 120})
>>> [float(p.get_height()) for p in fig.axes[0].patches]
[40.0, 80.0]
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure

from .placement import format_bytes


def memory_figure(
    parts: Mapping[str, Mapping[str, float]],
    formula: Mapping[str, float] | None = None,
    budget: float | None = None,
    title: str = "bytes per device",
) -> Figure:
    """One stacked bar per strategy: its parts (parameters, optimizer state, ...) in one colour each.

    Args:
      parts: ``{strategy: {part: bytes per device}}``, wherever they come from (bytes of the
        placed arrays, the compiler's estimate of the temporaries, a device's memory
        counters); the parts stack in the order of the first strategy's mapping (a part a
        strategy lacks counts 0).
      formula: ``{strategy: bytes}``, drawn as a black tick across the bar (e.g. the ZeRO
        paper's count of the same parts), so the bars and the formula meet at a glance.
      budget: a dashed line at this many bytes per device.
      title: drawn above the bars.

    Returns:
      The figure; ``fig.axes[0].patches`` are the bars' segments, part by part (all
      strategies' first part, then all strategies' second part, ...).
    """
    names = list(parts)
    stacked = list(dict.fromkeys(part for row in parts.values() for part in row))
    fig = Figure(figsize=(max(5.0, 1.2 * len(names) + 2.5), 3.8), layout="constrained")
    ax = fig.add_subplot()
    bottoms = [0.0] * len(names)
    for part in stacked:
        heights = [float(parts[name].get(part, 0)) for name in names]
        ax.bar(range(len(names)), heights, bottom=bottoms, width=0.6, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for i, total in enumerate(bottoms):
        ax.annotate(format_bytes(total), (i, total), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    if formula:
        xs = [i for i, name in enumerate(names) if name in formula]
        ax.scatter(xs, [formula[names[i]] for i in xs], marker="_", s=900, color="black", zorder=3, label="formula")
    if budget is not None:
        ax.axhline(budget, color="tab:red", linestyle="--", linewidth=1.2, label=f"budget {format_bytes(budget)}")
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel("bytes per device")
    top = max([*bottoms, *(formula or {}).values(), budget or 0])
    ax.set_ylim(0, top * 1.2 if top else 1)
    ax.legend(fontsize=8, frameon=False, loc="upper right")
    ax.set_title(title)
    return fig
