"""The views, by topic: figures from plain data, and the live views that redraw them.

Each ``*_figure`` function takes what the library measures and returns a
``matplotlib.figure.Figure``; a topic's live view sits beside its figure (:class:`StrategyRace`,
:class:`PipelineExplorer`, :class:`GradSyncExplorer`), and the timing views beside the data they
show (:class:`TimingDashboard` over :mod:`.live`'s :class:`LiveTimes`). Every name loads its module
when first asked for, so the timing views import no matplotlib until something draws, and
``import parallelkit`` imports neither matplotlib nor ipywidgets.

>>> import parallelkit as pk
>>> pk.viz.TimingDashboard.__module__
'parallelkit.viz.dashboard'
"""

from importlib import import_module
from typing import Any

HOMES = {  # each public name to the module it lives in
    "bench_figure": "bench",
    "TimingDashboard": "dashboard",
    "in_notebook": "dashboard",
    "alltoall_figure": "experts",
    "routing_figure": "experts",
    "GradSyncExplorer": "gradsync",
    "gradient_sync_figure": "gradsync",
    "ring_figure": "gradsync",
    "spread_figure": "gradsync",
    "LiveTimes": "live",
    "RaceRow": "live",
    "RaceStandings": "live",
    "TimingSummary": "live",
    "memory_figure": "memory",
    "PipelineExplorer": "pipeline",
    "pipeline_gantt_figure": "pipeline",
    "collectives_figure": "placement",
    "format_bytes": "placement",
    "held_fractions": "placement",
    "leaf_label": "placement",
    "memory_kinds": "placement",
    "mesh_figure": "placement",
    "partition_figure": "placement",
    "placement_figure": "placement",
    "slice_label": "placement",
    "StrategyRace": "race",
    "race_figure": "race",
    "trace_figure": "trace",
}
__all__ = sorted(HOMES)


def __getattr__(name: str) -> Any:
    if name in HOMES:
        value = globals()[name] = getattr(import_module(f"{__name__}.{HOMES[name]}"), name)  # loaded once
        return value
    if name in HOMES.values():  # a module itself, before anything imported it
        return import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *HOMES])
