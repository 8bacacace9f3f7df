"""One cost model for training steps: compute plus communication, every assumption stated (docs/cost_model.md).

Everything is importable from here: :mod:`.links`, :mod:`.workload`, :mod:`.patterns`, :mod:`.sequence`,
:mod:`.estimate`, :mod:`.buckets` and :mod:`.topology`.

References:
  Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication Operations in MPICH", 2005.

>>> work = Workload(param_bytes=100e6, seconds_per_sample=1e-3, batch_per_device=32)
>>> one = Cluster(machines=1, devices_per_machine=8, inside=PRESETS["nvlink3"])
>>> p = predict(work, one, "mirrored")
>>> # ring: 14 rounds x (3.4 us + 12.5 MB / 300 GB/s) = 0.631 ms beside 32 ms of compute
>>> round(p.compute_s * 1e3, 1), round(p.communication_s * 1e3, 3), round(p.efficiency, 3)
(32.0, 0.631, 0.981)
"""

from __future__ import annotations

from .buckets import BucketTimeline as BucketTimeline
from .buckets import bucket_timeline as bucket_timeline
from .estimate import LocalVsDistributed as LocalVsDistributed
from .estimate import communication_seconds as communication_seconds
from .estimate import local_vs_distributed as local_vs_distributed
from .estimate import predict as predict
from .links import ALGORITHMS as ALGORITHMS
from .links import PRESETS as PRESETS
from .links import Cluster as Cluster
from .links import Link as Link
from .links import Round as Round
from .links import allreduce_rounds as allreduce_rounds
from .links import allreduce_seconds as allreduce_seconds
from .links import alltoall_rounds as alltoall_rounds
from .links import axis_groups as axis_groups
from .links import axis_seconds as axis_seconds
from .links import fit_alpha_beta as fit_alpha_beta
from .links import fit_link as fit_link
from .links import gradient_groups_seconds as gradient_groups_seconds
from .links import groups as groups
from .links import ring_pairs as ring_pairs
from .links import ring_rounds as ring_rounds
from .links import rings_seconds as rings_seconds
from .links import scaled as scaled
from .patterns import PATTERNS as PATTERNS
from .patterns import STRATEGY_PATTERNS as STRATEGY_PATTERNS
from .patterns import expert_rounds as expert_rounds
from .patterns import model_size as model_size
from .patterns import name_strategy as name_strategy
from .patterns import pattern_name as pattern_name
from .patterns import pattern_of as pattern_of
from .patterns import register_pattern as register_pattern
from .patterns import sequence_collectives as sequence_collectives
from .sequence import CONTEXT_METHODS as CONTEXT_METHODS
from .sequence import PLANS as PLANS
from .sequence import Planned as Planned
from .topology import TOPOLOGY as TOPOLOGY
from .topology import TopologyModel as TopologyModel
from .topology import register_topology as register_topology
from .workload import KINDS as KINDS
from .workload import Options as Options
from .workload import Pattern as Pattern
from .workload import Prediction as Prediction
from .workload import Workload as Workload
