"""Pipeline parallelism: the model's layers cut into stages, the batch into microbatches.

>>> import parallelkit as pk
>>> loss_fn = pk.pipeline.sequential_loss([lambda p, b: b["x"] * p], lambda y, b: y)
>>> loss_fn([2.0], {"x": 3.0})
6.0
"""

from .circular import circular_pipeline as circular_pipeline
from .executor import Timeline as Timeline
from .executor import execute as execute
from .stages import run_layers as run_layers
from .stages import sequential_loss as sequential_loss
from .stages import split_layers as split_layers
from .step import PipelineStep as PipelineStep
from .strategy import Pipeline as Pipeline
