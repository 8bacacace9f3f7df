"""Figures from plain data, by topic: each function takes what the library measures and returns a
``matplotlib.figure.Figure``; a topic's live widget sits beside its figure (:class:`StrategyRace`,
:class:`PipelineExplorer`, :class:`GradSyncExplorer`, also found as ``pk.widgets.*``).

Import it on its own (``import parallelkit.viz``): ``import parallelkit`` stays free of
matplotlib, so it is fast and headless-safe.
"""

from .bench import bench_figure as bench_figure
from .experts import alltoall_figure as alltoall_figure
from .experts import routing_figure as routing_figure
from .gradsync import GradSyncExplorer as GradSyncExplorer
from .gradsync import gradient_sync_figure as gradient_sync_figure
from .gradsync import ring_figure as ring_figure
from .gradsync import spread_figure as spread_figure
from .memory import memory_figure as memory_figure
from .pipeline import PipelineExplorer as PipelineExplorer
from .pipeline import pipeline_gantt_figure as pipeline_gantt_figure
from .placement import collectives_figure as collectives_figure
from .placement import format_bytes as format_bytes
from .placement import held_fractions as held_fractions
from .placement import leaf_label as leaf_label
from .placement import memory_kinds as memory_kinds
from .placement import mesh_figure as mesh_figure
from .placement import partition_figure as partition_figure
from .placement import placement_figure as placement_figure
from .placement import slice_label as slice_label
from .race import StrategyRace as StrategyRace
from .race import race_figure as race_figure
from .trace import trace_figure as trace_figure
