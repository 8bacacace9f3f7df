"""parallelkit: multi-device training strategies in JAX, small enough to read.

>>> import parallelkit as pk
>>> pk.SingleDevice().num_replicas
1
"""

from . import axes as axes
from . import checkpoint as checkpoint
from . import collectives as collectives
from . import costmodel as costmodel
from . import data as data
from . import distributed as distributed
from . import gradsync as gradsync
from . import inspect as inspect
from . import lesson as lesson
from . import mesh as mesh
from . import models as models
from . import partition as partition
from . import pipeline as pipeline
from . import schedules as schedules
from . import traffic as traffic
from .axes import DATA as DATA
from .axes import EXPERT as EXPERT
from .axes import FSDP as FSDP
from .axes import MODEL as MODEL
from .axes import SEQ as SEQ
from .axes import STAGE as STAGE
from .axes import AxisRules as AxisRules
from .axes import constrain as constrain
from .devices import DeviceCountError as DeviceCountError
from .devices import DeviceSubsetWarning as DeviceSubsetWarning
from .devices import device_summary as device_summary
from .devices import simulate_devices as simulate_devices
from .pipeline import Pipeline as Pipeline
from .prefetch import Placed as Placed
from .prefetch import prefetch as prefetch
from .strategies import SPMD as SPMD
from .strategies import CentralStorage as CentralStorage
from .strategies import FullySharded as FullySharded
from .strategies import Hybrid as Hybrid
from .strategies import LeafPlacement as LeafPlacement
from .strategies import Mirrored as Mirrored
from .strategies import MultiWorkerMirrored as MultiWorkerMirrored
from .strategies import ParameterServer as ParameterServer
from .strategies import SingleDevice as SingleDevice
from .strategies import Step as Step
from .strategies import Strategy as Strategy
from .strategies import TensorParallel as TensorParallel
from .strategies import TrainState as TrainState
from .timing import StepTimes as StepTimes
from .timing import scaling_efficiency as scaling_efficiency
from .training import Callback as Callback
from .training import FitResult as FitResult
from .training import History as History
from .training import NonFiniteLossError as NonFiniteLossError
from .training import StepRecord as StepRecord
from .training import fit as fit

__version__ = "0.1.0"


def __getattr__(name: str):
    # Views import matplotlib/ipywidgets: load them only when first used, keeping
    # `import parallelkit` fast and headless-safe.
    if name in ("viz", "widgets", "tour"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
