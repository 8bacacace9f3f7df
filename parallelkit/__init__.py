"""parallelkit: multi-device training strategies in JAX, small enough to read.

>>> import parallelkit as pk
>>> pk.SingleDevice().num_replicas
1
"""

from . import data as data
from . import models as models
from . import planner as planner
from .core import axes as axes
from .core import mesh as mesh
from .core import partition as partition
from .core.axes import DATA as DATA
from .core.axes import EXPERT as EXPERT
from .core.axes import FSDP as FSDP
from .core.axes import MODEL as MODEL
from .core.axes import SEQ as SEQ
from .core.axes import STAGE as STAGE
from .core.axes import AxisRules as AxisRules
from .core.axes import constrain as constrain
from .core.devices import DeviceCountError as DeviceCountError
from .core.devices import DeviceSubsetWarning as DeviceSubsetWarning
from .core.devices import device_summary as device_summary
from .core.devices import simulate_devices as simulate_devices
from .core.precision import Precision as Precision
from .core.precision import PrecisionWarning as PrecisionWarning
from .core.renamed import renamed as _renamed
from .core.skipped import NonFiniteGradientsError as NonFiniteGradientsError
from .core.skipped import SkippedStepsWarning as SkippedStepsWarning
from .course import lesson as lesson
from .measure import aot as aot
from .measure import costmodel as costmodel
from .measure import gradsync as gradsync
from .measure import inspect as inspect
from .measure import traffic as traffic
from .measure.ceilings import measure_ceilings as measure_ceilings
from .measure.profile import profile as profile
from .measure.timing import StepTimes as StepTimes
from .measure.timing import scaling_efficiency as scaling_efficiency
from .models.layers import attention as attention
from .models.layers import experts as experts
from .run import checkpoint as checkpoint
from .run import distributed as distributed
from .run.compare import Run as Run
from .run.compare import run_side_by_side as run_side_by_side
from .run.prefetch import Placed as Placed
from .run.prefetch import prefetch as prefetch
from .run.training import Callback as Callback
from .run.training import FitResult as FitResult
from .run.training import History as History
from .run.training import NonFiniteLossError as NonFiniteLossError
from .run.training import ShortRunWarning as ShortRunWarning
from .run.training import StepRecord as StepRecord
from .run.training import fit as fit
from .strategies import SPMD as SPMD
from .strategies import CentralStorage as CentralStorage
from .strategies import ContextParallel as ContextParallel
from .strategies import ExpertParallel as ExpertParallel
from .strategies import FullySharded as FullySharded
from .strategies import Hybrid as Hybrid
from .strategies import LeafPlacement as LeafPlacement
from .strategies import Mirrored as Mirrored
from .strategies import MultiWorkerMirrored as MultiWorkerMirrored
from .strategies import Parallel as Parallel
from .strategies import ParameterServer as ParameterServer
from .strategies import SingleDevice as SingleDevice
from .strategies import Step as Step
from .strategies import Strategy as Strategy
from .strategies import TensorParallel as TensorParallel
from .strategies import TrainState as TrainState
from .strategies import allreduce as collectives  # noqa: F401  (the all-reduces by hand, by the course's name)
from .strategies import pipeline as pipeline
from .strategies.pipeline import Pipeline as Pipeline
from .strategies.pipeline import schedules as schedules

__version__ = "0.1.0"


_LAZY = {"viz": "viz", "widgets": "widgets", "tour": "course.tour"}  # their modules, below this package
# pk.allreduce: pk.collectives, the name the course teaches; LAZY: the table above, private now
_OLD_NAMES = _renamed(__name__, {"allreduce": "parallelkit:collectives", "LAZY": "parallelkit:_LAZY"})


def __getattr__(name: str):
    # Views import matplotlib/ipywidgets: load them only when first used, keeping
    # `import parallelkit` fast and headless-safe. (pk.widgets, their old home, warns as it loads.)
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{_LAZY[name]}")
    return _OLD_NAMES(name)
