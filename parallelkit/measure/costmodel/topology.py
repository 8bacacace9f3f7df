"""``TopologyModel``: a measured step's communication time on one machine's links, host links included.

>>> nvlink = TopologyModel(device_link_GBps=300, host_link_GBps=25, host_total_GBps=50, latency_us=5)
>>> round(nvlink.mirrored_seconds(400e6, 8) * 1e3, 2), round(nvlink.central_seconds(400e6, 8) * 1e3, 1)
(2.4, 128.0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...core.reports import StepTraffic
from .estimate import communication_seconds
from .links import Cluster, Link, Round, allreduce_rounds, alltoall_rounds
from .patterns import PATTERNS
from .workload import Workload


@dataclass(frozen=True)
class TopologyModel:
    """A back-of-the-envelope model of one step's communication time (latency-bandwidth, "alpha-beta").

    It is a model, not a measurement: the cost model's (:mod:`parallelkit.measure.costmodel`), on
    the one-machine :class:`~parallelkit.measure.costmodel.Cluster` of :meth:`cluster`, whose host
    links (``host``, ``host_side``) central storage and parameter servers cross, read from a measured
    step's traffic (:meth:`seconds`). Its assumptions, all of them:

    - sending ``b`` bytes over a link costs ``latency + b / bandwidth``; links are full
      duplex (sending and receiving at once do not slow each other);
    - each device has its own link of ``host_link_GBps`` (one direction) to host memory
      (PCIe); the host side that every device's transfers cross (its PCIe root, its
      memory) carries at most ``host_total_GBps`` in each direction (``None``: no limit);
    - devices talk to each other over links of ``device_link_GBps`` (NVLink, PCIe
      peer-to-peer), or, with ``device_link_GBps=None``, not directly at all: a message
      then goes up to host memory and down again, costing two latencies and crossing
      the shared host side;
    - mirrored: a ring all-reduce of ``P`` bytes over ``n`` devices runs ``2(n-1)`` rounds,
      in each of which every device sends ``P/n`` bytes to the next, all at once;
    - central storage: every device pulls ``P`` before it computes and pushes ``P`` after,
      all devices at once, all through the one host (the cost model's ``"central_storage"``);
    - parameter servers: ``k`` shards, each with a host side of ``host_total_GBps`` of its
      own (separate machines), each serving its ``P/k`` to every worker (the cost model's
      ``"parameter_server"`` in one machine);
    - expert parallelism: the all-to-alls a step's compiled program holds (their measured
      payloads ``S``), each a pairwise exchange over all ``n`` replicas in ``n - 1`` rounds
      of ``S/n`` per device, plus a ring all-reduce of every gradient ``P`` over all of them
      (with a ``data`` axis the expert groups are smaller and the expert weights' gradients
      meet only across them: then this is an upper bound);
    - compute, the optimizer update, the batch and any overlap of communication with
      compute are left out (real systems overlap: the ring can start during the backward
      pass, a pull cannot start before the previous update ends).
    """

    device_link_GBps: float | None
    host_link_GBps: float
    host_total_GBps: float | None = None
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        for name in ("device_link_GBps", "host_link_GBps", "host_total_GBps"):
            value = getattr(self, name)
            if (value is not None or name == "host_link_GBps") and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"TopologyModel({name}={value!r}): a bandwidth must be a number > 0 (GB/s).")
        if self.latency_us < 0:
            raise ValueError(f"TopologyModel(latency_us={self.latency_us!r}): a latency must be >= 0 (microseconds).")

    def cluster(self, n: int) -> Cluster:
        """``n`` devices in one machine on this model's links: the device link between them (without one, the host
        link, which :meth:`mirrored_seconds` and :meth:`alltoall_seconds` then cross twice), each device's host link,
        and the host side they share.

        >>> TopologyModel(300, 25, 50, latency_us=5).cluster(8).host_side
        Link(name='host side', GBps=50, latency_us=5, source='TopologyModel')
        """
        host = self._link("host link", self.host_link_GBps)
        side = None if self.host_total_GBps is None else self._link("host side", self.host_total_GBps)
        inside = host if self.device_link_GBps is None else self._link("device link", self.device_link_GBps)
        return Cluster(1, n, inside, host=host, host_side=side)

    def _link(self, name: str, GBps: float) -> Link:
        return Link(name, GBps, self.latency_us, "TopologyModel")

    def _rounds_seconds(self, rounds: list[Round], nbytes: float, n: int) -> float:
        """``rounds`` of the ``n`` devices over their own links or, without such links, as many rounds through host
        memory, in each of which the ``n`` devices' messages of ``nbytes / n`` go up and down again."""
        cluster = self.cluster(n)
        if self.device_link_GBps is None:  # up to host memory (the round's n messages cross the host side) and down
            return len(rounds) * (cluster.host.alpha + cluster.host_seconds(nbytes / n, nbytes))
        return sum(cluster.round_seconds(r) for r in rounds)

    def mirrored_seconds(self, param_bytes: float, n: int) -> float:
        """Ring all-reduce: ``2(n-1)`` rounds, each moving ``P/n`` per device (the cost model's rounds)."""
        return self._rounds_seconds(allreduce_rounds("ring", n, param_bytes), param_bytes, n) if n > 1 else 0.0

    def alltoall_seconds(self, nbytes: float, n: int) -> float:
        """Pairwise exchange: ``n-1`` rounds, in each of which every device sends ``nbytes/n`` to another.

        >>> TopologyModel(device_link_GBps=1, host_link_GBps=1).alltoall_seconds(4e6, 4)  # 3 x 1 MB at 1 GB/s
        0.003
        """
        return self._rounds_seconds(alltoall_rounds([list(range(n))], nbytes), nbytes, n) if n > 1 else 0.0

    def central_seconds(self, param_bytes: float, n: int) -> float:
        """A pull of ``P`` to every device, then a push of ``P`` from every device, all through one host."""
        return communication_seconds(Workload(param_bytes, 0.0, 1), self.cluster(n), "central_storage")

    def parameter_server_seconds(self, param_bytes: float, n: int, shards: int) -> float:
        """A pull and a push of ``P`` per worker, ``P/k`` from each shard; the ``k`` shards serve in parallel."""
        work = Workload(param_bytes, 0.0, 1)
        return communication_seconds(work, self.cluster(n), "parameter_server", shards=shards)

    def seconds(self, traffic: StepTraffic) -> float:
        """The model's communication time for a measured step, by its traffic pattern (see :data:`TOPOLOGY`)."""
        if traffic.pattern not in TOPOLOGY:
            raise ValueError(
                f"TopologyModel has no model for {traffic.strategy}'s traffic (pattern {traffic.pattern!r}); it models "
                f"the patterns {list(TOPOLOGY)}. Use the measured bytes in traffic.flows, or register_topology one."
            )
        return TOPOLOGY[traffic.pattern](self, traffic)

    def crossover_bytes(self, n: int) -> float:
        """The parameter bytes below which central storage is faster than mirrored (0: never; inf: always).

        Both times are ``latency terms + P x per-byte cost``, so they cross at most once:
        mirrored pays ``2(n-1)`` round latencies, central storage 2.
        """
        if n <= 1:
            return 0.0  # one device: mirrored sends nothing

        def lead(p: float) -> float:  # how much sooner central storage ends than mirrored, for p parameter bytes
            return self.mirrored_seconds(p, n) - self.central_seconds(p, n)

        extra_latency, gigabyte = lead(0.0), 1e9
        cheaper = (extra_latency - lead(gigabyte)) / gigabyte  # central storage's bytes cost this much more
        if cheaper <= 0:
            return float("inf") if extra_latency >= 0 else 0.0
        return max(extra_latency / cheaper, 0.0)


# How TopologyModel times each pattern (a strategy's ``pattern``, one of the cost model's names): from a
# measured step's parameter bytes, replicas and owners.
TOPOLOGY: dict[str, Callable[[TopologyModel, StepTraffic], float]] = {}


def register_topology(pattern: str, seconds: Callable[[TopologyModel, StepTraffic], float]) -> None:
    """Let :meth:`TopologyModel.seconds` time steps of ``pattern`` as ``seconds(model, traffic)`` says.

    Raises:
      ValueError: ``pattern`` has a model already, or is not one of the cost model's patterns
        (:data:`~parallelkit.measure.costmodel.PATTERNS`: one vocabulary for both).
    """
    if pattern in TOPOLOGY:
        raise ValueError(f"TopologyModel already models the pattern {pattern!r}.")
    if pattern not in PATTERNS:
        raise ValueError(f"{pattern!r} is not one of the cost model's patterns {list(PATTERNS)}: register_pattern it.")
    TOPOLOGY[pattern] = seconds


def _expert_seconds(model: TopologyModel, traffic: StepTraffic) -> float:
    """Every gradient's ring all-reduce, and each measured all-to-all as a pairwise exchange over the replicas."""
    exchanged = [f.measured for f in traffic.flows if "(all-to-all)" in f.what]
    ring = model.mirrored_seconds(traffic.param_bytes, traffic.replicas)
    return ring + sum(model.alltoall_seconds(b, traffic.replicas) for b in exchanged)


register_topology("single", lambda model, t: 0.0)
register_topology("mirrored", lambda model, t: model.mirrored_seconds(t.param_bytes, t.replicas))
register_topology("central_storage", lambda model, t: model.central_seconds(t.param_bytes, t.replicas))
register_topology("expert", _expert_seconds)
register_topology(
    "parameter_server",
    lambda model, t: model.parameter_server_seconds(t.param_bytes, t.replicas, len(t.owner_bytes)),
)
