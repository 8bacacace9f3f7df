"""``GradSyncExplorer``: sliders over steps and layers of captured per-replica gradients."""

from __future__ import annotations

import io
from collections.abc import Sequence

from ..measure.gradsync import GradSync
from .dashboard import in_notebook


def spread_table(syncs: Sequence[GradSync]) -> str:
    """Spread between replicas per layer and step, before -> after sync, as text."""
    lines = [f"{'step':>4}  " + "  ".join(f"{name:>22}" for name in syncs[0].layers)]
    for s in syncs:
        pairs = (f"{b:.2e} -> {a:.0e}" for b, a in zip(s.spread(), s.spread(after=True), strict=True))
        lines.append(f"{s.step:>4}  " + "  ".join(f"{p:>22}" for p in pairs))
    return "\n".join(lines)


class GradSyncExplorer:
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
        self._widgets = None

    @property
    def current(self) -> tuple[int, int]:
        """(index into ``syncs``, layer index) shown now."""
        w = self.widget.children
        return w[0].children[0].value, w[0].children[1].value

    def figure(self, index: int, layer: int):
        from ..viz.gradsync import gradient_sync_figure

        return gradient_sync_figure(self.syncs[index], layer, self.max_elements)

    @property
    def widget(self):
        if self._widgets is None:
            import ipywidgets as w

            steps = w.IntSlider(0, 0, len(self.syncs) - 1, description="step #").add_class("pk-step-slider")
            layers = w.IntSlider(0, 0, len(self.syncs[0].layers) - 1, description="layer").add_class("pk-layer-slider")
            label = w.HTML().add_class("pk-gradsync-label")
            image = w.Image(format="png").add_class("pk-gradsync-image")

            def redraw(_=None):
                i, k = steps.value, layers.value
                label.value = f"step {self.syncs[i].step} · layer <b>{self.syncs[i].layers[k]}</b>"
                buffer = io.BytesIO()
                self.figure(i, k).savefig(buffer, format="png", dpi=80)
                image.value = buffer.getvalue()

            steps.observe(redraw, "value")
            layers.observe(redraw, "value")
            redraw()
            self._widgets = w.VBox([w.HBox([steps, layers]), label, image]).add_class("pk-gradsync")
        return self._widgets

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if in_notebook():
            display(self.widget)
        else:
            print(spread_table(self.syncs))
