"""A profiler trace as a timeline: one row per device (and one for the host), bars coloured by kind of work."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..measure.profile import COLLECTIVE, COMPUTE, KINDS, TRANSFER, TraceSummary

COLORS = {COMPUTE: "tab:blue", COLLECTIVE: "tab:red", TRANSFER: "tab:green"}


def trace_figure(summary: TraceSummary, ax: Any = None) -> Figure:
    """Where each device's time went during the traced steps: compute, collectives, transfers.

    Args:
        summary: what :func:`parallelkit.measure.profile.profile` (``pk.profile``) returned.
        ax: a matplotlib ``Axes`` to draw on (default: a new figure).

    Returns:
        The figure the timeline is drawn in.
    """
    if ax is None:
        ax = Figure(figsize=(10, 1 + 0.5 * len(summary.devices)), layout="constrained").subplots()
    rows = [d.device for d in summary.devices]
    for row, device in enumerate(rows):
        for kind in KINDS:
            bars = [(e.start_s * 1e3, e.seconds * 1e3) for e in summary.events if e.device == device and e.kind == kind]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLORS[kind])
    ax.set_yticks(range(len(rows)), ["host" if d is None else f"device {d}" for d in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds since the first traced operation")
    ax.set_title(f"Where the time goes: {summary.steps} traced steps")
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in KINDS], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax.figure
