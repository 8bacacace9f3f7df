"""Mixture-of-experts figures: where the router sent the tokens, step by step, and what an all-to-all moves."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle


def routing_figure(
    routed: np.ndarray, kept: np.ndarray, step: int, capacity: int | None = None, title: str = ""
) -> Figure:
    """Tokens per expert over the steps (a heat map) and, for one ``step``, each expert's kept and dropped tokens.

    ``routed`` and ``kept`` are ``(steps, experts)`` token-choices routed to each expert
    (before capacity) and kept by it, as the MoE GPT's metrics ``tokens_per_expert`` and
    ``kept_per_expert`` give for one block. Left: ``routed`` with the row of ``step``
    outlined. Right: that step's kept choices (blue) with the dropped ones (red) on top,
    and ``capacity``, an expert's slots over all groups, as a dashed line where given.

    >>> fig = routing_figure(np.array([[3, 1], [4, 0]]), np.array([[2, 1], [2, 0]]), step=1, capacity=2)
    >>> [round(p.get_height()) for p in fig.axes[1].patches]  # kept 2, 0; dropped 2, 0
    [2, 0, 2, 0]
    """
    routed, kept = np.asarray(routed), np.asarray(kept)
    if routed.shape != kept.shape or routed.ndim != 2:
        raise ValueError(f"routed and kept must both be (steps, experts), got {routed.shape} and {kept.shape}.")
    if not 0 <= step < len(routed):
        raise ValueError(f"step={step} is not one of the {len(routed)} recorded steps (0 to {len(routed) - 1}).")
    steps, experts = routed.shape
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    heat, bars = fig.subplots(1, 2, width_ratios=(1.2, 1))
    image = heat.imshow(routed, aspect="auto", cmap="viridis", interpolation="nearest")
    heat.add_patch(Rectangle((-0.5, step - 0.5), experts, 1, fill=False, edgecolor="white", linewidth=2))
    heat.set_xlabel("expert"), heat.set_ylabel("step"), heat.set_xticks(range(experts))
    heat.set_title("token-choices routed to each expert", fontsize=10)
    fig.colorbar(image, ax=heat, shrink=0.85)
    x = np.arange(experts)
    bars.bar(x, kept[step], color="tab:blue", label="kept")
    bars.bar(x, routed[step] - kept[step], bottom=kept[step], color="tab:red", label="dropped")
    if capacity is not None:
        bars.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity ({capacity})")
    dropped = 1 - kept[step].sum() / max(routed[step].sum(), 1)
    bars.set_title(f"step {step}: {dropped:.0%} of the choices dropped", fontsize=10)
    bars.set_xlabel("expert"), bars.set_ylabel("token-choices"), bars.set_xticks(x)
    bars.legend(fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def alltoall_figure(devices: int, payload_bytes: float, title: str = "") -> Figure:
    """One all-to-all over ``devices``: the bytes each device (row) sends each other (column).

    Every device's ``payload_bytes`` buffer is cut into ``devices`` equal parts, part ``j``
    going to device ``j``; the diagonal is the part each keeps (drawn grey, not sent). The
    row sums of the sent parts are ``(n-1)/n`` of the payload.

    >>> fig = alltoall_figure(4, 4096)
    >>> [t.get_text() for t in fig.axes[0].texts][:2]
    ['kept', '1.0 kB']
    """
    n = devices
    sent = np.full((n, n), payload_bytes / n)
    np.fill_diagonal(sent, np.nan)
    fig = Figure(figsize=(1.2 * n + 2.4, 0.9 * n + 1.4), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(np.where(np.isnan(sent), 0, 1), cmap="Blues", vmin=0, vmax=1.6, interpolation="nearest")
    for i in range(n):
        for j in range(n):
            ax.text(j, i, "kept" if i == j else _kb(sent[i, j]), ha="center", va="center", fontsize=8,
                    color="grey" if i == j else "black")  # fmt: skip
    ax.set_xticks(range(n), [f"to {j}" for j in range(n)])
    ax.set_yticks(range(n), [f"device {i}" for i in range(n)])
    ax.set_title(title or f"all-to-all: each device sends {n - 1}/{n} of {_kb(payload_bytes)}", fontsize=10)
    return fig


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1024:.1f} kB"
