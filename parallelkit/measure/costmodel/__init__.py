"""One cost model for training steps: compute plus communication, every assumption stated.

It predicts a step's time and a strategy's scaling efficiency from three things: the
workload (parameter bytes, compute per sample as FLOPs at a peak FLOP/s or as seconds,
batch per device), the cluster (devices per machine, the links inside a machine and the
network between machines, each a :class:`Link` with a published bandwidth and its source) and the
strategy. It is the alpha-beta model of the collectives literature (Thakur,
Rabenseifner and Gropp, 2005) applied round by round. Its assumptions, all of them:

- sending ``b`` bytes over a link costs ``alpha + b / beta`` (latency, bandwidth);
  links are full duplex;
- inside a machine every device has its own link of ``inside`` bandwidth to every other
  (an NVLink switch, or PCIe peer-to-peer); messages inside a machine never contend;
- between machines, all the bytes that leave a machine in one round (and all that
  enter it) share that machine's ``network`` link: its bandwidth is the machine's
  total (all its network cards together);
- transfers to and from host memory (central storage's, and parameter servers' in one
  machine) cross each device's own ``host`` link (``inside`` unless given) and, all
  together, the ``host_side`` (no limit unless given): :meth:`Cluster.host_seconds`;
- every collective runs in rounds (:func:`allreduce_rounds`, :func:`ring_rounds`,
  :func:`alltoall_rounds`); a round lasts as long as its slowest message, and the next
  round starts when it ends;
- compute is ``flops_per_sample x batch_per_device / (efficiency x peak_flops)`` (or
  ``seconds_per_sample x batch_per_device`` when a time per sample is given instead), the
  same on every device (a model-parallel group of ``k`` devices takes ``k x
  batch_per_device`` samples and each device does ``1/k`` of the work, so the global
  batch is always ``devices x batch_per_device``); gradient communication can run during the last ``overlap`` of
  it (0 by default: nothing hidden; frameworks that all-reduce during the backward
  pass, about two thirds of the compute, hide up to that much);
- activations are on the critical path and are never hidden: tensor parallelism's
  all-reduces (the compiler's, taken to be rings), expert parallelism's all-to-alls (taken
  to be pairwise exchanges, :func:`alltoall_rounds`) and a pipeline's sends between
  stages, one send after each of the ``2 (m + s - 1)`` forward and backward slots of
  a GPipe or 1F1B schedule, whose idle share is the bubble ``(s - 1) / (m + s - 1)``;
- a model-parallel group is ``k`` neighbouring devices (device ``r k + j`` is position
  ``j`` of group ``r``), as the kit's meshes lay them out, so a group fits in a machine
  when ``k <= devices_per_machine``;
- the optimizer update, the input pipeline, stragglers and congestion from other jobs
  cost nothing. A prediction is an estimate: set it against measurements.

>>> work = Workload(param_bytes=100e6, seconds_per_sample=1e-3, batch_per_device=32)
>>> one = Cluster(machines=1, devices_per_machine=8, inside=PRESETS["nvlink3"])
>>> p = predict(work, one, "mirrored")
>>> # ring: 14 rounds x (3.4 us + 12.5 MB / 300 GB/s) = 0.631 ms beside 32 ms of compute
>>> round(p.compute_s * 1e3, 1), round(p.communication_s * 1e3, 3), round(p.efficiency, 3)
(32.0, 0.631, 0.981)

The model lives in six modules, one idea each: :mod:`.links` (a link, a cluster, the rounds
of every collective, the one alpha-beta fit), :mod:`.workload` (what a step needs and what a
pattern is), :mod:`.patterns` (how each family of strategies communicates, the sequence's
splits among them: :mod:`.sequence`), :mod:`.estimate` (a step's time and efficiency) and
:mod:`.buckets` (gradient buckets on one communication stream, hidden behind the backward pass or not);
:mod:`.topology` times a measured step's traffic on one machine's links (:class:`TopologyModel`).
Everything is importable from here.
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
