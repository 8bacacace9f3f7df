"""Live views for notebooks: thin ipywidgets over the plain data in :mod:`parallelkit.widgets.live`.

Import it on its own (``pk.widgets`` loads on first use): ``import parallelkit`` stays free of
ipywidgets. Every view falls back to text outside a notebook. The timing views live here; the
views that draw a figure live beside it, by topic, in :mod:`parallelkit.viz` (the race, the
pipeline, the gradients' synchronisation), and are found here by name too, loaded when first
asked for so that the timing views do not import matplotlib.
"""

from importlib import import_module
from typing import Any

from .dashboard import TimingDashboard as TimingDashboard
from .dashboard import in_notebook as in_notebook
from .live import LiveTimes as LiveTimes
from .live import RaceRow as RaceRow
from .live import RaceStandings as RaceStandings
from .live import TimingSummary as TimingSummary

BESIDE_THEIR_FIGURES = {
    "StrategyRace": "parallelkit.viz.race",
    "PipelineExplorer": "parallelkit.viz.pipeline",
    "GradSyncExplorer": "parallelkit.viz.gradsync",
}


def __getattr__(name: str) -> Any:
    if name in BESIDE_THEIR_FIGURES:
        return getattr(import_module(BESIDE_THEIR_FIGURES[name]), name)
    raise AttributeError(f"module 'parallelkit.widgets' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *BESIDE_THEIR_FIGURES])
