"""Which strategy? The planner: every layout the kit can run for a model and a cluster, ranked with why.

:mod:`.model` describes a transformer by its shape (:class:`ModelShape`, published shapes in
:data:`MODELS`); :mod:`.cluster` a cluster's links and devices (:class:`Cluster`, from a
datasheet or measured here); :mod:`.memory` counts the bytes one device holds, by the ZeRO
paper's accounting of the state and Korthikanti et al.'s of the activations; :mod:`.layout`
says how a step is split (:class:`Layout`), whether it can run a model and batch, and what each
device then holds; :mod:`.steptime` predicts a layout's step on the cost model
(:mod:`parallelkit.measure.costmodel`); :mod:`.search` weighs every layout and :mod:`.plan`
ranks them (:func:`plan`: an example there); :mod:`.build` turns a layout into the kit's strategy.
"""

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
