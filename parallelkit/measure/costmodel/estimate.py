"""The cost model's answers: a step's communication, its time and its scaling efficiency."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .links import Cluster, Link
from .patterns import model_size, pattern_of
from .workload import Options, Prediction, Workload


def _communication(
    workload: Workload,
    cluster: Cluster,
    strategy: str,
    allreduce: str,
    shards: int,
    model: int | None,
    microbatches: int,
) -> tuple[float, float]:
    """(gradient communication, which overlap can hide; activation communication, which it cannot)."""
    k = model_size(cluster, strategy, model)
    if not (isinstance(microbatches, int) and microbatches >= 1):
        raise ValueError(f"microbatches={microbatches!r} must be a whole number >= 1.")
    pattern = pattern_of(strategy)
    if cluster.devices == 1 and pattern.model == "none":
        return 0.0, 0.0
    return pattern.communication(workload, cluster, Options(allreduce, shards, k, microbatches))


def communication_seconds(
    workload: Workload,
    cluster: Cluster,
    strategy: str,
    allreduce: str = "ring",
    shards: int = 1,
    *,
    model: int | None = None,
    microbatches: int = 1,
) -> float:
    """The communication one step of ``strategy`` needs, before any overlap.

    - mirrored: one all-reduce of ``P`` by ``allreduce``;
    - fully_sharded (ZeRO-3): an all-gather of ``P`` for the forward pass, another for
      the backward, a reduce-scatter of the gradients: three half-rings, 1.5 all-reduces;
    - central_storage: every device pulls ``P`` from and pushes ``P`` to the machine's host
      memory, all at once, over its own ``host`` link (``inside`` by default), all of them
      through the ``host_side`` when the cluster has one (one machine only);
    - parameter_server: ``shards`` servers on machines of their own, each sending
      ``P/shards`` to every device and receiving as much: over the ``network`` (each
      worker machine's link carrying its devices' ``P``), or in one machine over each
      device's ``host`` link, each server's ``host_side`` carrying its share (no limit without one);
    - tensor (``model`` = all devices) and hybrid (groups of ``model``): each of the
      workload's ``activation_allreduces`` over every group at once, for the group's
      ``model x batch_per_device`` samples; hybrid adds an all-reduce of each device's
      ``P/model`` gradient slice over the data groups;
    - pipeline (``model`` stages, ``microbatches``): ``2 (m + s - 1)`` sends of one
      microbatch's boundary activation between neighbouring stages (the slowest pair
      sets the pace), plus the all-reduce of each stage's ``P/s`` over its data groups;
    - expert (groups of ``model`` devices, all of them by default): each of the workload's
      ``all_to_alls`` within every group at once, for each device's own ``batch_per_device``
      samples (:func:`expert_rounds`), plus an all-reduce of the ``param_bytes - expert_bytes``
      over every device and of each device's ``expert_bytes / model`` over its data group;
    - ``context_allgather``, ``context_ring``, ``context_ring_zigzag``, ``context_ulysses``
      (``model`` devices split each sequence) and ``sequence_parallel`` (groups of ``model``):
      the activations they move, as :mod:`parallelkit.measure.costmodel.sequence` lists them.

    >>> link = Link("test", GBps=1, latency_us=0, source="by hand")
    >>> work = Workload(0, 1e-3, 8, activation_allreduces=(1e3, 1e3))  # two all-reduces of 1 kB a sample
    >>> communication_seconds(work, Cluster(1, 2, link), "tensor")  # 2 x ring of 16 kB over 2: 2 x 16 us
    3.2e-05
    """
    hideable, critical = _communication(workload, cluster, strategy, allreduce, shards, model, microbatches)
    return hideable + critical


def predict(
    workload: Workload,
    cluster: Cluster,
    strategy: str = "mirrored",
    allreduce: str = "ring",
    shards: int = 1,
    *,
    model: int | None = None,
    microbatches: int = 1,
) -> Prediction:
    """Predict one step of ``strategy`` on ``cluster``; the global batch is ``devices x batch_per_device``.

    Step time = compute + the pipeline's bubble + activation communication + the gradient
    communication beyond ``overlap x compute``; efficiency = samples/s over ``devices``
    times the samples/s of the same workload on one device. ``model``: as for
    :func:`communication_seconds` (:class:`~.workload.Pattern` says what it means for each kind).

    >>> work = Workload(param_bytes=0, seconds_per_sample=1e-3, batch_per_device=8, boundary_bytes=1e3)
    >>> link = Link("test", GBps=1, latency_us=0, source="by hand")
    >>> p = predict(work, Cluster(1, 4, link), "pipeline", microbatches=4)  # 4 stages
    >>> # bubble (s-1)/m x 8 ms = 6 ms; 2(m+s-1) = 14 sends of 1 kB x 32/4 samples: 14 x 8 us
    >>> round(p.idle_s * 1e3, 3), round(p.communication_s * 1e3, 3), round(p.efficiency, 3)
    (6.0, 0.112, 0.567)
    """
    compute = workload.compute_s
    hideable, critical = _communication(workload, cluster, strategy, allreduce, shards, model, microbatches)
    stages = model_size(cluster, strategy, model) if pattern_of(strategy).model == "stages" else 1
    idle = (stages - 1) / microbatches * compute  # the bubble: (s-1)/(m+s-1) of the pipeline's time
    exposed = critical + max(hideable - workload.overlap * compute, 0.0)
    step = compute + idle + exposed
    samples = workload.batch_per_device * cluster.devices / step
    single = workload.batch_per_device / compute if compute else math.inf
    efficiency = samples / (cluster.devices * single)
    return Prediction(strategy, cluster.devices, compute, exposed, step, samples, efficiency, idle_s=idle)


@dataclass(frozen=True)
class LocalVsDistributed:
    """The claim "it takes more than 16 distributed GPUs to equal 8 in one machine", for one setting."""

    local: Prediction  # 8 devices in one machine
    distributed: Prediction  # 16 devices over machines
    devices_to_match: int | None  # the fewest distributed devices predicted to equal `local` (None: none up to 1024)

    @property
    def holds(self) -> bool:
        """True when 16 distributed devices are predicted to be slower than 8 local ones."""
        return self.distributed.samples_per_s < self.local.samples_per_s


def local_vs_distributed(
    workload: Workload,
    inside: Link,
    network: Link,
    *,
    per_machine: int = 1,
    allreduce: str = "ring",
    local: int = 8,
    distributed: int = 16,
) -> LocalVsDistributed:
    """Mirrored training on ``local`` devices in one machine against ``distributed`` devices over machines.

    The distributed devices sit ``per_machine`` to a machine (1: one GPU per machine),
    each machine with one ``network`` link; inside a machine they use ``inside``.
    ``devices_to_match`` searches from two machines up to 1024 devices.
    """
    if distributed % per_machine:
        raise ValueError(f"{distributed} distributed devices do not fill machines of {per_machine}.")
    one_machine = predict(workload, Cluster(1, local, inside), "mirrored", allreduce)

    def over_machines(devices: int) -> Prediction:
        cluster = Cluster(devices // per_machine, per_machine, inside, network)
        return predict(workload, cluster, "mirrored", allreduce)

    target = one_machine.samples_per_s
    machines = range(2 * per_machine, 1025, per_machine)  # two machines at least: distributed
    match = next((n for n in machines if over_machines(n).samples_per_s >= target), None)
    return LocalVsDistributed(one_machine, over_machines(distributed), match)
