"""Live views for notebooks: thin ipywidgets over the plain data in :mod:`parallelkit.widgets.live`.

Import it on its own (``pk.widgets`` loads on first use): ``import parallelkit`` stays free of
ipywidgets. Every view falls back to text outside a notebook.
"""

from .dashboard import TimingDashboard as TimingDashboard
from .dashboard import in_notebook as in_notebook
from .explorer import GradSyncExplorer as GradSyncExplorer
from .live import LiveTimes as LiveTimes
from .live import RaceRow as RaceRow
from .live import RaceStandings as RaceStandings
from .live import TimingSummary as TimingSummary
from .pipeline import PipelineExplorer as PipelineExplorer
from .race import StrategyRace as StrategyRace
