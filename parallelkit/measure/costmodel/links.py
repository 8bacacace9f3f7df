"""Links, clusters and the rounds of every collective, and the one alpha-beta fit (:func:`fit_alpha_beta`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...core.types import is_count

ALGORITHMS = ("psum", "ring", "tree", "reduce_to_one", "hierarchical")  # the all-reduces the kit runs and times


def ring_pairs(rings: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``(device, next device)`` around every ring: one ring round's messages.

    >>> ring_pairs([[0, 1, 2]])
    [(0, 1), (1, 2), (2, 0)]
    """
    return [(ring[k], ring[(k + 1) % len(ring)]) for ring in rings for k in range(len(ring))]


@dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in one direction and latency, with where the figures come from."""

    name: str
    GBps: float  # one direction, 1e9 bytes per second
    latency_us: float
    source: str  # where the bandwidth comes from

    def __post_init__(self) -> None:
        if not self.GBps > 0 or self.latency_us < 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be > 0 GB/s and latency >= 0 us.")

    @property
    def alpha(self) -> float:
        """Latency in seconds."""
        return self.latency_us * 1e-6

    @property
    def beta(self) -> float:
        """Bandwidth in bytes per second."""
        return self.GBps * 1e9

    def seconds(self, nbytes: float) -> float:
        """One message: ``alpha + nbytes / beta``."""
        return self.alpha + nbytes / self.beta


# Bandwidths are published peak figures, one direction; latencies are NCCL's per-hop
# constants for its "Simple" protocol (NVIDIA/nccl src/graph/tuning.cc, hwLat: NVLink
# 3.4 us, PCIe 5.7 us, network about 10 us), the same for every network: an assumption.
_PCIE = "Wikipedia, PCI Express, bandwidth table (x16, per direction): https://en.wikipedia.org/wiki/PCI_Express"
_NVLINK = "NVIDIA, NVLink: https://www.nvidia.com/en-us/data-center/nvlink/ (total per GPU both ways, halved here)"
_P100 = "NVIDIA Tesla P100 whitepaper: 4 NVLinks, 160 GB/s bidirectional per GPU (halved here)"
_ETHERNET = "IEEE 802.3 line rate (bits / 8)"
_HDR = "NVIDIA ConnectX-6 docs: https://docs.nvidia.com/networking/display/ConnectX6EN/Introduction (200 Gb/s)"
_NDR = "NVIDIA ConnectX-7 docs: https://docs.nvidia.com/networking/display/ConnectX7VPI/Introduction (400 Gb/s)"
PRESETS: dict[str, Link] = {
    "pcie3": Link("PCIe 3.0 x16", 15.75, 5.7, _PCIE),
    "pcie4": Link("PCIe 4.0 x16", 31.5, 5.7, _PCIE),
    "pcie5": Link("PCIe 5.0 x16", 63.0, 5.7, _PCIE),
    "nvlink1": Link("NVLink 1 (P100)", 80.0, 3.4, _P100),
    "nvlink2": Link("NVLink 2 (V100)", 150.0, 3.4, _NVLINK),
    "nvlink3": Link("NVLink 3 (A100)", 300.0, 3.4, _NVLINK),
    "nvlink4": Link("NVLink 4 (H100)", 450.0, 3.4, _NVLINK),
    "1gbe": Link("1 Gbit/s Ethernet", 0.125, 10.0, _ETHERNET),
    "10gbe": Link("10 Gbit/s Ethernet", 1.25, 10.0, _ETHERNET),
    "25gbe": Link("25 Gbit/s Ethernet", 3.125, 10.0, _ETHERNET),
    "100gbe": Link("100 Gbit/s Ethernet", 12.5, 10.0, _ETHERNET),
    "ib-hdr": Link("InfiniBand HDR", 25.0, 10.0, _HDR),
    "ib-ndr": Link("InfiniBand NDR", 50.0, 10.0, _NDR),
}


@dataclass(frozen=True)
class Cluster:
    """Machines of ``devices_per_machine`` devices; ``inside`` links them within a machine, ``network`` between.

    The host's links, which central storage and parameter servers cross (keywords only): ``host``, each
    device's own link to host memory (PCIe; the ``inside`` link when None), and ``host_side``, what
    every device's transfers to host memory cross together in each direction (the host's PCIe root and
    memory; a parameter server's shard, a machine of its own, has one of these; no limit when None).
    """

    machines: int
    devices_per_machine: int
    inside: Link
    network: Link | None = None  # a machine's total network bandwidth; needed when machines > 1
    host: Link | None = field(default=None, kw_only=True)
    host_side: Link | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for name in ("machines", "devices_per_machine"):
            value = getattr(self, name)
            if not is_count(value):
                raise ValueError(f"Cluster({name}={value!r}): a whole number >= 1.")
            object.__setattr__(self, name, int(value))  # a NumPy integer is stored as a plain int
        if self.machines > 1 and self.network is None:
            raise ValueError(f"A cluster of {self.machines} machines needs a network link (e.g. PRESETS['25gbe']).")

    @property
    def devices(self) -> int:
        return self.machines * self.devices_per_machine

    def machine(self, device: int) -> int:
        """Devices are numbered machine by machine."""
        return device // self.devices_per_machine

    def round_seconds(self, messages: Sequence[tuple[int, int, float]]) -> float:
        """How long one round of ``(source, target, bytes)`` messages takes (the cost model's assumptions)."""
        slowest, leaving, entering = 0.0, {}, {}
        for source, target, nbytes in messages:
            a, b = self.machine(source), self.machine(target)
            if a == b:
                slowest = max(slowest, self.inside.seconds(nbytes))
            else:
                leaving[a] = leaving.get(a, 0.0) + nbytes
                entering[b] = entering.get(b, 0.0) + nbytes
        for shared in (*leaving.values(), *entering.values()):
            slowest = max(slowest, self.network.seconds(shared))
        return slowest

    def host_seconds(self, per_device: float, through_host: float) -> float:
        """One round of transfers to or from host memory: each device moves ``per_device`` bytes over its own
        ``host`` link while the ``host_side`` carries ``through_host`` bytes; the slower of the two.

        >>> pcie = Link("PCIe", 25, 5, "by hand")
        >>> c = Cluster(1, 8, pcie, host=pcie, host_side=Link("host", 50, 5, "by hand"))
        >>> round(c.host_seconds(1e6, 8e6) * 1e6, 6)  # 8 devices' 1 MB share 50 GB/s: 5 us + 160 us
        165.0
        """
        own = (self.host or self.inside).seconds(per_device)
        return max(own, self.host_side.seconds(through_host)) if self.host_side else own


Round = list[tuple[int, int, float]]  # (source, target, bytes) messages sent at once


def ring_rounds(rings: Sequence[Sequence[int]], nbytes: float, phases: int = 2) -> list[Round]:
    """``phases x (g-1)`` rounds; in each, every device sends ``nbytes / g`` to the next in its ring.

    >>> [len(r) for r in ring_rounds([[0, 1, 2]], 6.0)], ring_rounds([[0, 1]], 4.0, phases=1)
    ([3, 3, 3, 3], [[(0, 1, 2.0), (1, 0, 2.0)]])
    """
    g = len(rings[0])
    one = [(source, target, nbytes / g) for source, target in ring_pairs(rings)]
    return [one] * (phases * (g - 1))


def allreduce_rounds(algorithm: str, n: int, nbytes: float, group: int | None = None) -> list[Round]:
    """The messages of each round of an all-reduce of ``nbytes`` over devices ``0 .. n-1``.

    The same exchanges as the code in :mod:`parallelkit.strategies.allreduce` (``"psum"`` is
    taken to be a ring). ``group``: devices per group for ``"hierarchical"``.

    >>> [len(r) for r in allreduce_rounds("reduce_to_one", 3, 8.0)]  # one message per round
    [1, 1, 1, 1]
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Unknown all-reduce {algorithm!r}: choose one of {ALGORITHMS}.")
    if n == 1:
        return []
    if algorithm in ("ring", "psum"):
        return ring_rounds([list(range(n))], nbytes)
    if algorithm == "reduce_to_one":
        return [[(j, 0, nbytes)] for j in range(1, n)] + [[(0, j, nbytes)] for j in range(1, n)]
    if algorithm == "tree":
        if n & (n - 1):
            raise ValueError(f"The tree all-reduce needs a power-of-two device count; got {n}.")
        halving = [(n >> k, nbytes / 2**k) for k in range(1, int(math.log2(n)) + 1)]
        return [[(i, i ^ d, size) for i in range(n)] for d, size in (*halving, *reversed(halving))]
    g = group or n
    if n % g:
        raise ValueError(f"A hierarchical all-reduce over {n} devices needs a group size that divides it; got {g}.")
    inside, across = groups(n, g)
    scatter = ring_rounds(inside, nbytes, phases=1)
    middle = ring_rounds(across, nbytes / g) if n > g else []
    return scatter + middle + scatter  # reduce-scatter, all-reduce one slice across groups, all-gather


def allreduce_seconds(cluster: Cluster, nbytes: float, algorithm: str = "ring") -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` over every device of ``cluster``.

    ``"hierarchical"`` groups the devices by machine.

    >>> fast = Cluster(1, 4, Link("test", GBps=10, latency_us=5, source="by hand"))
    >>> allreduce_seconds(fast, 1e6)  # 2(n-1) x (alpha + P/n / beta) = 6 x (5 us + 25 us)
    0.00018
    """
    rounds = allreduce_rounds(algorithm, cluster.devices, nbytes, group=cluster.devices_per_machine)
    return sum(cluster.round_seconds(r) for r in rounds)


def groups(n: int, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """The model groups (``k`` neighbours each) and the data groups (one position of every model group): the
    :func:`axis_groups` of ``k`` devices 1 apart and of ``n // k`` devices ``k`` apart.

    >>> groups(4, 2)
    ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    return axis_groups(n, k, 1), axis_groups(n, n // k, k)


def rings_seconds(cluster: Cluster, rings: list[list[int]], nbytes: float) -> float:
    """Concurrent ring all-reduces of ``nbytes`` over each of ``rings``."""
    if len(rings[0]) == 1:
        return 0.0
    return sum(cluster.round_seconds(r) for r in ring_rounds(rings, nbytes))


def gradient_groups_seconds(cluster: Cluster, param_bytes: float, k: int) -> float:
    """The all-reduce of each device's ``1/k`` slice of ``param_bytes`` over its data group, all groups at once."""
    _, across = groups(cluster.devices, k)
    return rings_seconds(cluster, across, param_bytes / k)


def alltoall_rounds(groups: Sequence[Sequence[int]], nbytes: float) -> list[Round]:
    """The messages of each round of an all-to-all of ``nbytes`` per device within each of ``groups`` at once.

    The pairwise exchange (Thakur, Rabenseifner and Gropp, 2005): ``g - 1`` rounds; in round
    ``r`` the device at position ``j`` of its group sends the ``nbytes / g`` meant for position
    ``j + r`` (mod ``g``). Each device sends ``(g-1)/g`` of its ``nbytes`` in all and keeps
    its own share.

    >>> alltoall_rounds([[0, 1, 2]], 3.0)
    [[(0, 1, 1.0), (1, 2, 1.0), (2, 0, 1.0)], [(0, 2, 1.0), (1, 0, 1.0), (2, 1, 1.0)]]
    """
    g = len(groups[0])
    return [[(group[j], group[(j + r) % g], nbytes / g) for group in groups for j in range(g)] for r in range(1, g)]


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` of ``seconds = alpha + beta x bytes``, residuals relative to each time.

    The sizes span several orders of magnitude; plain least squares would let the largest
    times decide everything and leave ``alpha``, set by the smallest, to noise. Weighting
    each residual by ``1 / seconds`` fits every size to the same relative precision.

    >>> alpha, beta = fit_alpha_beta([1e3, 1e6, 2e6], [1e-5 + 1e3 / 1e9, 1e-5 + 1e6 / 1e9, 1e-5 + 2e6 / 1e9])
    >>> round(alpha * 1e6, 6), round(1 / beta / 1e9, 6)  # 10 us and 1 GB/s
    (10.0, 1.0)
    """
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError("The alpha-beta fit needs one time per size and at least two different sizes.")
    times = np.asarray(seconds, float)
    beta, alpha = np.polyfit(np.asarray(nbytes, float), times, 1, w=1 / times)
    return float(alpha), float(beta)


def fit_link(devices: int, nbytes: Sequence[float], seconds: Sequence[float], name: str = "fitted") -> Link:
    """The link whose ring all-reduce over ``devices`` best fits measured times (least squares).

    A ring of ``P`` bytes takes ``2(n-1) alpha + 2(n-1)/n x P / beta``: a straight line in
    ``P``; its intercept gives ``alpha`` and its slope ``beta`` (:func:`fit_alpha_beta`, the
    same fit that :mod:`parallelkit.measure.ceilings` makes). Whatever algorithm the measured
    all-reduce really ran, the fit gives the ring-equivalent latency and bandwidth.

    >>> true = Link("true", GBps=2.0, latency_us=50.0, source="by hand")
    >>> sizes = [1e3, 1e5, 1e7]
    >>> times = [allreduce_seconds(Cluster(1, 4, true), s) for s in sizes]
    >>> fit = fit_link(4, sizes, times)
    >>> round(fit.GBps, 6), round(fit.latency_us, 6)
    (2.0, 50.0)
    """
    if not (isinstance(devices, int) and devices >= 2):
        raise ValueError(f"fit_link(devices={devices!r}): an all-reduce needs 2 or more devices.")
    intercept, slope = fit_alpha_beta(nbytes, seconds)
    if slope <= 0:
        raise ValueError("The measured times do not grow with the size: no bandwidth can be fitted.")
    rounds = 2 * (devices - 1)
    beta = rounds / devices / slope
    alpha = max(intercept / rounds, 0.0)
    return Link(name, beta / 1e9, alpha * 1e6, f"fitted to ring all-reduces over {devices} devices")


def scaled(link: Link, cards: int) -> Link:
    """``cards`` links side by side (a machine with several network cards): ``cards`` times the bandwidth."""
    return Link(f"{cards} x {link.name}", link.GBps * cards, link.latency_us, link.source)


def axis_groups(devices: int, size: int, stride: int) -> list[list[int]]:
    """The groups of one mesh axis of ``size`` whose neighbours are ``stride`` devices apart.

    Devices are numbered with the innermost axis fastest: on a ``(outer, size, inner)`` mesh,
    ``stride = inner``.

    >>> axis_groups(8, 2, 2)
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    """
    if size < 1 or stride < 1 or devices % (size * stride):
        raise ValueError(f"An axis of {size} devices {stride} apart does not tile {devices} devices.")
    block = size * stride
    return [[start + offset + j * stride for j in range(size)] for start in range(0, devices, block)
            for offset in range(stride)]  # fmt: skip


@functools.lru_cache(maxsize=4096)
def shifted_round(cluster: Cluster, size: int, stride: int, shift: int) -> tuple[bool, int]:
    """One round in which every device sends a message to the one ``shift`` places on along its axis group.

    Returns (whether any message stays inside a machine, the most messages that leave or enter
    one machine): with every message of ``b`` bytes the round lasts the longer of
    ``inside.seconds(b)`` and ``network.seconds(count x b)``, as :meth:`Cluster.round_seconds`
    times it; :func:`axis_seconds` uses this so that timing an axis of a thousand devices
    costs one pass over them per cluster and axis, not one per message size.

    The pass covers one period of the numbering, the first ``lcm(size x stride, devices per
    machine)`` devices: the axis's groups and the machines both tile that period, so every later
    period repeats its messages on other machines, with the same counts.
    """
    per_machine, block = cluster.devices_per_machine, size * stride
    if stride % per_machine == 0:  # each group's devices on distinct machines: every message leaves
        return False, per_machine
    if per_machine % stride == 0 and block % per_machine == 0:
        # every machine holds the same share of each of its groups, and a turn of the groups carries one machine's
        # messages onto the next's: one machine's count is every machine's (entering too, by that symmetry)
        leaving = sum((d // stride + shift) % size * stride + d % stride >= per_machine for d in range(per_machine))
        return leaving < per_machine, leaving
    period = math.lcm(block, per_machine)
    inside, leaving, entering = False, {}, {}
    for group in axis_groups(min(period, cluster.devices), size, stride):
        for j, source in enumerate(group):
            target = group[(j + shift) % size]
            a, b = cluster.machine(source), cluster.machine(target)
            if a == b:
                inside = True
            else:
                leaving[a] = leaving.get(a, 0) + 1
                entering[b] = entering.get(b, 0) + 1
    return inside, max([*leaving.values(), *entering.values()], default=0)


def axis_seconds(cluster: Cluster, size: int, stride: int, nbytes: float, collective: str) -> float:
    """Seconds of one collective of ``nbytes`` per device along a mesh axis, all its groups at once.

    ``collective``: ``"all-reduce"`` (a ring: ``2 (k-1)`` rounds of ``nbytes / k``),
    ``"all-gather"`` or ``"reduce-scatter"`` (``k - 1`` such rounds; ``nbytes`` is the whole
    gathered array), ``"all-to-all"`` (the pairwise exchange: ``k - 1`` rounds of ``nbytes / k``,
    each to another peer), ``"permute"`` (one round: ``nbytes`` to the next device on the ring).
    The same rounds as :func:`ring_rounds` and :func:`alltoall_rounds`, timed as
    :meth:`Cluster.round_seconds` times them.

    >>> c = Cluster(2, 4, Link("in", 100, 0, "by hand"), Link("net", 10, 0, "by hand"))
    >>> round(axis_seconds(c, 4, 1, 4e6, "all-reduce") * 1e6, 6)  # inside: 6 rounds of 1 MB at 100 GB/s
    60.0
    >>> axis_seconds(c, 2, 4, 4e6, "all-reduce") * 1e6  # across: 2 rounds, 4 x 2 MB share 10 GB/s each way
    1600.0
    """
    if size == 1:
        return 0.0

    def round_s(shift: int, message: float) -> float:
        inside, crossing = shifted_round(cluster, size, stride, shift)
        near = cluster.inside.seconds(message) if inside else 0.0
        return max(near, cluster.network.seconds(crossing * message) if crossing else 0.0)

    if collective == "permute":
        return round_s(1, nbytes)
    if collective == "all-to-all":
        return sum(round_s(shift, nbytes / size) for shift in range(1, size))
    phases = {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 1}.get(collective)
    if phases is None:
        raise ValueError(f"axis_seconds(collective={collective!r}): all-reduce, all-gather, reduce-scatter, "
                         "all-to-all or permute.")  # fmt: skip
    return phases * (size - 1) * round_s(1, nbytes / size)
