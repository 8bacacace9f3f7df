"""Gradient synchronisation as figures, and the live :class:`GradSyncExplorer`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from ..measure.gradsync import GradSync, RingTrace
from .dashboard import Explorer
from .placement import png

_CMAP = "RdBu_r"  # gradients are signed: red positive, blue negative, white zero


def gradient_sync_figure(sync: GradSync, layer: int | str = 0, max_elements: int = 512) -> Figure:
    """One layer's gradient on every replica, before and after the all-reduce, and their norms.

    Args:
      sync: from :class:`parallelkit.measure.gradsync.GradientProbe`.
      layer: index or name (``sync.layers``).
      max_elements: draw the first this many numbers of the (flattened) layer.

    Returns:
      The figure: ``axes[0]`` shows ``before`` as ``[replicas, elements]``, ``axes[1]``
      ``after``; ``axes[2]`` has one bar per replica, its gradient's L2 norm, and a line
      at the synced gradient's norm.

    Example:
      >>> import numpy as np
      >>> from parallelkit.measure.gradsync import GradSync
      >>> g = np.array([[1.0, 2.0], [3.0, 4.0]])  # 2 replicas, one layer of 2 numbers
      >>> sync = GradSync(("w",), (g,), (np.tile(g.mean(0), (2, 1)),), np.array([0.5, 0.7]))
      >>> fig = gradient_sync_figure(sync, "w")
      >>> fig.axes[0].images[0].get_array().tolist(), fig.axes[1].images[0].get_array().tolist()
      ([[1.0, 2.0], [3.0, 4.0]], [[2.0, 3.0], [2.0, 3.0]])
    """
    if isinstance(layer, str) and layer not in sync.layers:
        raise ValueError(f"No layer {layer!r}; the layers are {list(sync.layers)}.")
    k = sync.layers.index(layer) if isinstance(layer, str) else layer
    n = sync.replicas
    before = sync.before[k].reshape(n, -1)[:, :max_elements]
    after = sync.after[k].reshape(n, -1)[:, :max_elements]
    scale = float(np.abs(before).max()) or 1.0
    fig = Figure(figsize=(10, 1.6 + 0.22 * n), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[3, 3, 1.4])
    for ax, grid, what in ((axes[0], before, "before sync"), (axes[1], after, "after the all-reduce")):
        image = ax.imshow(grid, cmap=_CMAP, vmin=-scale, vmax=scale, aspect="auto", interpolation="nearest")
        ax.set_title(what, fontsize=9)
        ax.set_xlabel(f"element of {sync.layers[k]} (first {grid.shape[1]})", fontsize=8)
        ax.set_yticks(range(n))
        ax.tick_params(labelsize=7)
    axes[0].set_ylabel("replica")
    fig.colorbar(image, ax=axes[:2], shrink=0.8).set_label("gradient", fontsize=8)
    norms = sync.replica_norms()[:, k]
    axes[2].barh(range(n), norms, color="tab:blue")
    axes[2].axvline(float(np.linalg.norm(sync.synced[k])), color="tab:red", linestyle="--", label="synced")
    axes[2].invert_yaxis()
    axes[2].set_title("norm per replica", fontsize=9)
    axes[2].tick_params(labelsize=7)
    axes[2].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"step {sync.step}: {sync.layers[k]}, {n} replicas (spread {sync.spread()[k]:.2e} -> 0)", fontsize=10)
    return fig


def spread_figure(syncs: Sequence[GradSync]) -> Figure:
    """Spread between replicas per layer over steps: positive before sync, zero after.

    Returns:
      The figure; line ``j`` of ``axes[0]`` is ``[s.spread()[j] for s in syncs]``, and of
      ``axes[1]`` the same after sync.
    """
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    steps = [s.step for s in syncs]
    for ax, after in ((axes[0], False), (axes[1], True)):
        spreads = np.array([s.spread(after) for s in syncs])
        for j, name in enumerate(syncs[0].layers):
            ax.plot(steps, spreads[:, j], marker=".", label=name)
        ax.set_title("after the all-reduce" if after else "before sync", fontsize=9)
        ax.set_xlabel("step")
    axes[0].set_ylabel("spread between replicas (RMS)")
    axes[0].legend(fontsize=7)
    return fig


def ring_figure(ring: RingTrace, step: int | None = None) -> Figure:
    """A ring all-reduce, step by step: which replica holds how much of each chunk's sum.

    Each panel is one ring step: a ``[replica, chunk]`` grid of how many replicas'
    gradients that chunk of the buffer already holds (1 at the start, ``n`` when done),
    with an arrow for every chunk sent to the next replica.

    Args:
      ring: from :func:`parallelkit.measure.gradsync.ring_allreduce_trace`.
      step: draw only this step (0-based); all steps by default.

    Returns:
      The figure; ``axes[k].images[0].get_array()`` is the drawn step's ``contributions``.
    """
    n = len(ring.inputs)
    shown = list(range(len(ring.steps))) if step is None else [step]
    cols = min(len(shown), 4)
    rows = -(-len(shown) // cols)
    # Fixed margins and shared, outer-only tick labels: a constrained layout of 2(n-1) panels
    # of n x n numbers costs seconds to draw, and every panel has the same axes anyway.
    fig = Figure(figsize=(2.3 * cols + 0.6, 2.2 * rows + 0.7))
    fig.subplots_adjust(left=0.6 / fig.get_figwidth(), right=0.98, bottom=0.45 / fig.get_figheight(),
                        top=1 - 0.75 / fig.get_figheight(), wspace=0.12, hspace=0.3)  # fmt: skip
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False, sharex=True, sharey=True)).ravel()
    for ax, k in zip(axes, shown, strict=False):
        s = ring.steps[k]
        ax.imshow(s.contributions, cmap="Greens", vmin=0, vmax=n, aspect="auto")
        for (r, c), held in np.ndenumerate(s.contributions):
            ax.text(c, r, str(held), ha="center", va="center", fontsize=7, color="white" if held > 0.6 * n else "black")
        for t in s.transfers:
            # an arrow from the sender's cell to the receiver's cell of the same chunk
            ax.annotate(
                "",
                xy=(t.chunk + 0.3, t.dst),
                xytext=(t.chunk + 0.3, t.src),
                arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1, "connectionstyle": "arc3,rad=0.3"},
            )
        ax.set_title(f"{k + 1}. {s.phase}", fontsize=8)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.tick_params(labelsize=6)
        ax.set_xlabel("chunk", fontsize=7)
        ax.set_ylabel("replica", fontsize=7)
        ax.label_outer()
    for ax in axes[len(shown) :]:
        ax.axis("off")
    sent = ring.bytes_sent()[0]
    fig.suptitle(
        f"ring all-reduce over {n} replicas: each sends {sent:,} B = 2(n-1)/n of its {ring.inputs.shape[1] * 4:,} B",
        fontsize=9,
    )
    return fig


def spread_table(syncs: Sequence[GradSync]) -> str:
    """Spread between replicas per layer and step, before -> after sync, as text."""
    lines = [f"{'step':>4}  " + "  ".join(f"{name:>22}" for name in syncs[0].layers)]
    for s in syncs:
        pairs = (f"{b:.2e} -> {a:.0e}" for b, a in zip(s.spread(), s.spread(after=True), strict=True))
        lines.append(f"{s.step:>4}  " + "  ".join(f"{p:>22}" for p in pairs))
    return "\n".join(lines)


class GradSyncExplorer(Explorer):
    """Per-replica gradients before and after sync, with a step slider and a layer slider.

    A view over a list of :class:`~parallelkit.measure.gradsync.GradSync` (from
    :func:`parallelkit.measure.gradsync.trace_gradients`): each change redraws
    :func:`parallelkit.viz.gradient_sync_figure` for the chosen step and layer. Outside a
    notebook, displaying it prints the spread table instead.
    """

    def __init__(self, syncs: Sequence[GradSync], max_elements: int = 512):
        if not syncs:
            raise ValueError("GradSyncExplorer needs at least one GradSync; capture some with trace_gradients.")
        self.syncs = list(syncs)
        self.max_elements = max_elements

    @property
    def current(self) -> tuple[int, int]:
        """(index into ``syncs``, layer index) shown now."""
        w = self.widget.children
        return w[0].children[0].value, w[0].children[1].value

    def figure(self, index: int, layer: int):
        return gradient_sync_figure(self.syncs[index], layer, self.max_elements)

    def _build(self):
        import ipywidgets as w

        steps = w.IntSlider(0, 0, len(self.syncs) - 1, description="step #").add_class("pk-step-slider")
        layers = w.IntSlider(0, 0, len(self.syncs[0].layers) - 1, description="layer").add_class("pk-layer-slider")
        label = w.HTML().add_class("pk-gradsync-label")
        image = w.Image(format="png").add_class("pk-gradsync-image")

        def redraw(_=None):
            i, k = steps.value, layers.value
            label.value = f"step {self.syncs[i].step} · layer <b>{self.syncs[i].layers[k]}</b>"
            image.value = png(self.figure(i, k))

        steps.observe(redraw, "value")
        layers.observe(redraw, "value")
        redraw()
        return w.VBox([w.HBox([steps, layers]), label, image]).add_class("pk-gradsync")

    def _text(self) -> str:
        return spread_table(self.syncs)
