"""Which strategy? The planner's parts so far: a model's shape and the memory each layout needs per device.

:mod:`.model` describes a transformer by its shape (:class:`Transformer`, published shapes in
:data:`MODELS`); :mod:`.memory` counts the bytes one device holds, by the ZeRO paper's
accounting of the state and Korthikanti et al.'s of the activations; :mod:`.layout` says how
a step is split (:class:`Layout`), whether it can run a model and batch, and what each device
then holds (:func:`memory_per_device`). Ranking layouts by
the cost model's step time comes next.
"""

from .layout import Layout as Layout
from .layout import check as check
from .layout import memory_per_device as memory_per_device
from .memory import Memory as Memory
from .memory import in_flight as in_flight
from .memory import layer_activation_bytes as layer_activation_bytes
from .memory import state_bytes as state_bytes
from .model import MODELS as MODELS
from .model import Transformer as Transformer
