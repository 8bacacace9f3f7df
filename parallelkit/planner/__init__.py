"""Which strategy? The planner ranks every layout the kit can run for a model and cluster (:func:`plan`)."""

from ..core.renamed import renamed
from .build import unsupported as unsupported
from .cluster import Cluster as Cluster
from .layout import Layout as Layout
from .layout import check as check
from .layout import memory_per_device as memory_per_device
from .memory import Memory as Memory
from .memory import in_flight as in_flight
from .memory import layer_activation_bytes as layer_activation_bytes
from .memory import state_bytes as state_bytes
from .model import MODELS as MODELS
from .model import ModelShape as ModelShape
from .plan import Plan as Plan
from .plan import plan as plan
from .search import Candidate as Candidate
from .steptime import StepTime as StepTime
from .steptime import step_time as step_time

__getattr__ = renamed(__name__, {"Transformer": "parallelkit.planner:ModelShape"})  # a shape, not a model
