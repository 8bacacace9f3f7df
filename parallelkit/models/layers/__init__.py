"""The layers the kit's models call, those that communicate among them.

- :mod:`.basic`: dense and layer-norm layers that declare their logical axes, and dropout;
- :mod:`.attention`: attention, dense on one device and split over ``seq`` by the context-parallel
  methods (all-gather, ring, zig-zag ring, Ulysses);
- :mod:`.experts`: a mixture-of-experts layer, its router and capacity, and its expert-parallel
  all-to-alls;
- :mod:`.sequence`: the column- and row-split edges of Megatron's sequence parallelism.

``pk.attention`` and ``pk.experts`` are the two modules a notebook reaches most.
"""

from . import attention as attention
from . import basic as basic
from . import experts as experts
from . import sequence as sequence
