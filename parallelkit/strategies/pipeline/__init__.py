"""Pipeline parallelism: the model's layers cut into stages, the batch into microbatches.

Design: each stage's forward and backward passes are small compiled programs
(:mod:`parallelkit.strategies.pipeline.stages`), placed on the stage's own devices and called from
the host, one thread per stage, in the order the schedule gives
(:mod:`parallelkit.strategies.pipeline.executor`). Why not one SPMD program (``jax.shard_map`` with
``lax.ppermute``)? In one program every device runs the same loop, so a schedule becomes
masks over a grid of time steps: GPipe fits, but 1F1B's per-stage warm-up, alternation
and cool-down do not fit it well, and the order in which passes really ran cannot be
observed from outside. Driven from the host, a schedule is just the list each stage works
through, any schedule runs unchanged, and the start and end of every pass can be
recorded from real execution. The price is a host round trip per pass, which small
models on CPU feel (the timeline shows it). The one-program design is here too, for a model
of repeated blocks: :func:`circular_pipeline` (:mod:`parallelkit.strategies.pipeline.circular`)
loops the blocks around a ``stage`` mesh axis inside one ``jit``, MaxText's way, and its
module docstring sets what each design can and cannot do side by side.

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
