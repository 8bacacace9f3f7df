"""A cost model for training steps: compute plus communication, every assumption stated.

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
- an all-reduce runs in rounds (:func:`allreduce_rounds`); a round lasts as long as
  its slowest message, and the next round starts when it ends;
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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .collectives import ALGORITHMS, ring_pairs


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
    """Machines of ``devices_per_machine`` devices; ``inside`` links them within a machine, ``network`` between."""

    machines: int
    devices_per_machine: int
    inside: Link
    network: Link | None = None  # a machine's total network bandwidth; needed when machines > 1

    def __post_init__(self) -> None:
        if not (isinstance(self.machines, int) and self.machines >= 1):
            raise ValueError(f"Cluster(machines={self.machines!r}): a whole number >= 1.")
        if not (isinstance(self.devices_per_machine, int) and self.devices_per_machine >= 1):
            raise ValueError(f"Cluster(devices_per_machine={self.devices_per_machine!r}): a whole number >= 1.")
        if self.machines > 1 and self.network is None:
            raise ValueError(f"A cluster of {self.machines} machines needs a network link (e.g. PRESETS['25gbe']).")

    @property
    def devices(self) -> int:
        return self.machines * self.devices_per_machine

    def machine(self, device: int) -> int:
        """Devices are numbered machine by machine."""
        return device // self.devices_per_machine

    def round_seconds(self, messages: Sequence[tuple[int, int, float]]) -> float:
        """How long one round of ``(source, target, bytes)`` messages takes (see the module's assumptions)."""
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


Round = list[tuple[int, int, float]]  # (source, target, bytes) messages sent at once


def _ring_rounds(rings: Sequence[Sequence[int]], nbytes: float, phases: int = 2) -> list[Round]:
    """``phases x (g-1)`` rounds; in each, every device sends ``nbytes / g`` to the next in its ring."""
    g = len(rings[0])
    one = [(source, target, nbytes / g) for source, target in ring_pairs(rings)]
    return [one] * (phases * (g - 1))


def allreduce_rounds(algorithm: str, n: int, nbytes: float, group: int | None = None) -> list[Round]:
    """The messages of each round of an all-reduce of ``nbytes`` over devices ``0 .. n-1``.

    The same exchanges as the code in :mod:`parallelkit.measure.collectives` (``"psum"`` is
    taken to be a ring). ``group``: devices per group for ``"hierarchical"``.

    >>> [len(r) for r in allreduce_rounds("reduce_to_one", 3, 8.0)]  # one message per round
    [1, 1, 1, 1]
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Unknown all-reduce {algorithm!r}: choose one of {ALGORITHMS}.")
    if n == 1:
        return []
    if algorithm in ("ring", "psum"):
        return _ring_rounds([list(range(n))], nbytes)
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
    m = n // g
    inside = [[o * g + i for i in range(g)] for o in range(m)]
    across = [[o * g + i for o in range(m)] for i in range(g)]
    scatter = _ring_rounds(inside, nbytes, phases=1)
    middle = _ring_rounds(across, nbytes / g) if m > 1 else []
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


@dataclass(frozen=True)
class Workload:
    """What one training step needs, per device.

    Compute comes from FLOPs: ``flops_per_sample`` (one sample's forward and backward on one
    device, e.g. a single-device step's ``pk.inspect.flops(...).flops`` over its batch) at
    ``efficiency x peak_flops`` FLOP/s, with ``peak_flops`` measured (``pk.measure_ceilings()``'s
    ``matmul_f32.value``) or published (``hardware.PUBLISHED[...].bf16_flops``) and
    ``efficiency`` the share of it a step reaches: its FLOPs utilisation
    (``roofline.flops_utilisation``) by the count given as ``flops_per_sample`` and the
    peak given as ``peak_flops``; 1.0, the default, assumes the peak. It is PaLM's MFU
    (``roofline.mfu``) only for the model's FLOPs (``flops.dense_training_flops``) over a
    published peak. A compiled step's count includes its optimizer update, which divided by the
    batch becomes part of each sample's FLOPs. ``seconds_per_sample``, when given,
    overrides the FLOPs: a measured or assumed time.

    >>> Workload(4e6, batch_per_device=32, flops_per_sample=2e9, peak_flops=100e12, efficiency=0.4).compute_s
    0.0016
    >>> Workload(4e6, 1e-3, 32, flops_per_sample=2e9, peak_flops=100e12).compute_s  # the override wins
    0.032
    """

    param_bytes: float  # P: the gradient has as many bytes
    seconds_per_sample: float | None = None  # forward and backward of one sample on one device; overrides FLOPs
    batch_per_device: int = 0  # samples each device takes per step (required: >= 1)
    overlap: float = 0.0  # the fraction of compute during which gradient communication can already run
    name: str = ""
    # bytes per sample of each all-reduce tensor parallelism makes in one step (forward and
    # backward): for the kit's MLP, ``megatron_mlp_allreduces(1, widths)`` x the item size
    activation_allreduces: tuple[float, ...] = ()
    boundary_bytes: float = 0.0  # bytes per sample of the activation a pipeline stage sends the next
    # bytes per sample of each all-to-all expert parallelism makes in one step (forward and backward):
    # the dispatched slots a device holds, pk.experts.dispatch_bytes over the samples of its group
    all_to_alls: tuple[float, ...] = ()
    expert_bytes: float = 0.0  # the part of param_bytes that is expert weights (split over the expert axis)
    flops_per_sample: float | None = None  # one sample's forward and backward, the whole model on one device
    peak_flops: float | None = None  # one device's FLOP/s: measured (ceilings) or published (hardware)
    efficiency: float = 1.0  # FLOPs utilisation: flops_per_sample's FLOP/s reached over peak_flops, in (0, 1]
    # splitting the sequence (parallelkit.measure.sequence_costs): one sample's (length, dim) activation in
    # bytes (the size of its keys, or values, in one layer), and the attention layers
    sequence_bytes: float = 0.0
    layers: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"Workload(overlap={self.overlap}): a fraction between 0 and 1.")
        if not self.batch_per_device >= 1:
            raise ValueError(f"Workload(batch_per_device={self.batch_per_device!r}): the samples a device takes, >= 1.")
        if self.param_bytes < 0 or (self.seconds_per_sample is not None and self.seconds_per_sample < 0):
            raise ValueError("Workload: param_bytes and seconds_per_sample >= 0, batch_per_device >= 1.")
        if self.boundary_bytes < 0 or any(b < 0 for b in (*self.activation_allreduces, *self.all_to_alls)):
            raise ValueError("Workload: activation_allreduces, all_to_alls and boundary_bytes are byte counts >= 0.")
        if not 0 <= self.expert_bytes <= self.param_bytes:
            raise ValueError(
                f"Workload(expert_bytes={self.expert_bytes!r}): the expert weights' share of param_bytes="
                f"{self.param_bytes!r}, between 0 and param_bytes."
            )
        if self.sequence_bytes < 0 or not (isinstance(self.layers, int) and self.layers >= 0):
            raise ValueError("Workload: sequence_bytes is a byte count >= 0 and layers a whole number >= 0.")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"Workload(efficiency={self.efficiency}): the share of the peak reached, in (0, 1].")
        if self.seconds_per_sample is None:
            self._check_flops()

    def _check_flops(self) -> None:
        if self.flops_per_sample is None or self.peak_flops is None:
            raise ValueError(
                "Workload needs its compute: give flops_per_sample and peak_flops (e.g. pk.inspect.flops(...) over "
                "the batch, and pk.measure_ceilings().matmul_f32.value), or seconds_per_sample."
            )
        if self.flops_per_sample < 0 or not self.peak_flops > 0:
            raise ValueError(
                f"Workload(flops_per_sample={self.flops_per_sample}, peak_flops={self.peak_flops}): "
                "FLOPs >= 0 and a peak > 0 FLOP/s."
            )

    @property
    def sample_seconds(self) -> float:
        """One sample's compute on one device: ``seconds_per_sample``, else FLOPs over the FLOP/s reached."""
        if self.seconds_per_sample is not None:
            return self.seconds_per_sample
        return self.flops_per_sample / (self.efficiency * self.peak_flops)

    @property
    def compute_s(self) -> float:
        """One device's compute for one step: ``sample_seconds x batch_per_device``."""
        return self.sample_seconds * self.batch_per_device


@dataclass(frozen=True)
class Prediction:
    """A predicted step: its parts, its throughput, and its efficiency against one device."""

    strategy: str
    devices: int
    compute_s: float
    communication_s: float  # the part not hidden behind compute
    step_s: float
    samples_per_s: float
    efficiency: float  # samples/s over (devices x one device's samples/s): 1.0 is perfect scaling
    idle_s: float = 0.0  # a pipeline's bubble: devices waiting for their neighbours


@dataclass(frozen=True)
class Options:
    """What a pattern's communication depends on beyond the workload and the cluster."""

    allreduce: str  # the all-reduce algorithm of data parallelism
    shards: int  # parameter servers
    model: int  # devices per model-parallel group (stages for a pipeline); 1 for data parallelism
    microbatches: int


@dataclass(frozen=True)
class Pattern:
    """How one step of a family of strategies communicates.

    ``communication(workload, cluster, options)`` returns (gradient seconds, which overlap can
    hide; activation seconds, which it cannot). ``model`` says what ``model=`` means:
    ``"none"`` (data parallelism: no model groups), ``"all"`` (one group of every device),
    ``"given"`` (groups of ``model``, which must be given), ``"any"`` (groups of ``model``,
    every device by default: the expert axis) or ``"stages"`` (pipeline stages, every device
    by default, with the bubble in the step's time).
    """

    communication: Callable[[Workload, Cluster, Options], tuple[float, float]]
    model: str = "none"


PATTERNS: dict[str, Pattern] = {}  # by name; see register_pattern
KINDS = ("none", "all", "given", "any", "stages")  # what a pattern's model= means (Pattern.model)


def register_pattern(name: str, pattern: Pattern) -> Pattern:
    """Let :func:`predict` take ``name``: a strategy family whose step communicates as ``pattern`` says.

    A strategy in :mod:`parallelkit.strategies.catalog` names its pattern (``cost_pattern``).

    Raises:
      ValueError: a pattern of that name exists.
    """
    if name in PATTERNS:
        raise ValueError(f"The cost model already has a pattern {name!r}.")
    if pattern.model not in KINDS:
        raise ValueError(f"Pattern(model={pattern.model!r}): choose one of {KINDS}.")
    PATTERNS[name] = pattern
    return pattern


STRATEGY_PATTERNS: dict[str, str] = {}  # a strategy's name (the catalog's) -> the name of its pattern


def name_strategy(strategy: str, pattern: str | None) -> None:
    """Let :func:`predict` take ``strategy`` (a catalog name) for ``pattern``; None forgets the name.

    :func:`parallelkit.strategies.catalog.register` calls it for every entry, so the cost
    model never imports the strategies.

    Raises:
      ValueError: ``pattern`` is not a registered pattern.
    """
    if pattern is None:
        STRATEGY_PATTERNS.pop(strategy, None)
        return
    if pattern not in PATTERNS:
        raise ValueError(f"{strategy!r} names the cost pattern {pattern!r}, which is not one of {list(PATTERNS)}.")
    STRATEGY_PATTERNS[strategy] = pattern


def _pattern(strategy: str) -> Pattern:
    """The pattern ``strategy`` names: a pattern's own name, or a named strategy's (the catalog's ``cost_pattern``)."""
    return PATTERNS[pattern_name(strategy)]


def pattern_name(strategy: str) -> str:
    """The name of the pattern ``strategy`` names: a pattern's own name, or a catalog name's ``cost_pattern``.

    >>> pattern_name("Mirrored(jit)"), pattern_name("mirrored")
    ('mirrored', 'mirrored')

    Raises:
      ValueError: neither a pattern nor a named strategy.
    """
    if strategy in PATTERNS:
        return strategy
    if strategy in STRATEGY_PATTERNS:
        return STRATEGY_PATTERNS[strategy]
    raise ValueError(f"Unknown strategy {strategy!r}: choose one of {list(PATTERNS)} or {list(STRATEGY_PATTERNS)}.")


def _model_size(cluster: Cluster, strategy: str, model: int | None) -> int:
    """Devices per model-parallel group (stages for a pipeline), checked; 1 for data-parallel strategies."""
    n, kind = cluster.devices, _pattern(strategy).model
    if kind == "none":
        if model not in (None, 1):
            parallel = [name for name, p in PATTERNS.items() if p.model != "none"]
            raise ValueError(f"{strategy} does not split the model; model={model} is for {parallel}.")
        return 1
    k = n if model is None else model
    if kind == "given" and model is None:
        raise ValueError(
            f"{strategy} needs model=k: the devices per group that splits the model or the sequence "
            "(the model axis for tensor parallelism, seq for context parallelism)."
        )
    if kind == "all" and k != n:
        raise ValueError(f"{strategy} splits every weight over all {n} devices; use hybrid for model={k} groups.")
    if not (isinstance(k, int) and k >= 1 and n % k == 0):
        raise ValueError(f"model={k!r} must be a whole number >= 1 that divides the {n} devices.")
    return k


def _groups(n: int, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """The model groups (``k`` neighbours each) and the data groups (one position of every model group)."""
    along = [[r * k + j for j in range(k)] for r in range(n // k)]
    across = [[r * k + j for r in range(n // k)] for j in range(k)]
    return along, across


def _rings_seconds(cluster: Cluster, rings: list[list[int]], nbytes: float) -> float:
    """Concurrent ring all-reduces of ``nbytes`` over each of ``rings``."""
    if len(rings[0]) == 1:
        return 0.0
    return sum(cluster.round_seconds(r) for r in _ring_rounds(rings, nbytes))


def gradient_groups_seconds(workload: Workload, cluster: Cluster, k: int) -> float:
    """The all-reduce of each device's ``1/k`` gradient slice over its data group."""
    _, across = _groups(cluster.devices, k)
    return _rings_seconds(cluster, across, workload.param_bytes / k)


def _tensor(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    """Each of the workload's activation all-reduces over every model group at once, and the gradient slices."""
    k = options.model
    gradients = gradient_groups_seconds(workload, cluster, k)
    if k == 1:
        return gradients, 0.0
    if not workload.activation_allreduces:
        raise ValueError(
            "Tensor parallelism all-reduces activations: give Workload(activation_allreduces=...), "
            "bytes per sample of each (for the kit's MLP, megatron_mlp_allreduces(1, widths) x item size)."
        )
    along, _ = _groups(cluster.devices, k)
    replica_batch = k * workload.batch_per_device
    activations = sum(_rings_seconds(cluster, along, replica_batch * b) for b in workload.activation_allreduces)
    return gradients, activations


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


def expert_rounds(workload: Workload, cluster: Cluster, expert: int) -> list[Round]:
    """Every round of the all-to-alls of one expert-parallel step: each of ``workload.all_to_alls`` within
    every group of ``expert`` neighbouring devices at once, each device's batch its own tokens.

    >>> work = Workload(0, 1e-3, 2, all_to_alls=(100.0,) * 4)  # one MoE layer: 4 all-to-alls of 200 B a device
    >>> rounds = expert_rounds(work, Cluster(1, 4, Link("test", 1, 0, "by hand")), expert=2)
    >>> len(rounds), sum(b for r in rounds for source, _, b in r if source == 0)  # device 0 sends 4 x 100 B
    (4, 400.0)
    """
    along, _ = _groups(cluster.devices, expert)
    return [r for each in workload.all_to_alls for r in alltoall_rounds(along, each * workload.batch_per_device)]


def _expert(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    """The all-to-alls of the dispatch within each expert group; the gradients: the expert weights' slices
    over the data groups, every other parameter over all the devices."""
    k, n = options.model, cluster.devices
    dense = _rings_seconds(cluster, [list(range(n))], workload.param_bytes - workload.expert_bytes)
    _, across = _groups(n, k)
    gradients = dense + _rings_seconds(cluster, across, workload.expert_bytes / k)
    if k == 1:
        return gradients, 0.0
    if not workload.all_to_alls:
        raise ValueError(
            "Expert parallelism sends tokens to their experts by all-to-all: give Workload(all_to_alls=...), bytes "
            "per sample of each (4 per MoE layer: pk.experts.dispatch_bytes over the samples of a group)."
        )
    return gradients, sum(cluster.round_seconds(r) for r in expert_rounds(workload, cluster, k))


def _pipeline(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    """``2 (m + s - 1)`` sends of one microbatch's boundary activation, and each stage's gradient slice."""
    k = options.model
    gradients = gradient_groups_seconds(workload, cluster, k)
    if k == 1:
        return gradients, 0.0
    if not workload.boundary_bytes:
        raise ValueError("A pipeline sends activations between stages: give Workload(boundary_bytes=...) per sample.")
    along, _ = _groups(cluster.devices, k)
    sent = workload.boundary_bytes * k * workload.batch_per_device / options.microbatches  # one device, one slot
    one_slot = max(cluster.round_seconds([(g[s], g[s + 1], sent) for g in along]) for s in range(k - 1))
    return gradients, 2 * (options.microbatches + k - 1) * one_slot


def _single(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    return 0.0, 0.0


def _mirrored(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    return allreduce_seconds(cluster, workload.param_bytes, options.allreduce), 0.0


def _fully_sharded(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    return 1.5 * allreduce_seconds(cluster, workload.param_bytes, "ring"), 0.0


def _central_storage(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    if cluster.machines > 1:
        raise ValueError("central_storage keeps the parameters in one machine's memory: use machines=1.")
    return 2 * cluster.inside.seconds(workload.param_bytes), 0.0  # pull then push, every device on its own link


def _parameter_server(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
    link, p = cluster.network or cluster.inside, workload.param_bytes
    server = cluster.devices * p / options.shards  # each server's link carries its share for every device
    worker_machine = cluster.devices_per_machine * p if cluster.machines > 1 else p
    return 2 * link.seconds(max(server, worker_machine)), 0.0


for _name, _built_in in (
    ("single", Pattern(_single)),
    ("mirrored", Pattern(_mirrored)),
    ("fully_sharded", Pattern(_fully_sharded)),
    ("central_storage", Pattern(_central_storage)),
    ("parameter_server", Pattern(_parameter_server)),
    ("tensor", Pattern(_tensor, model="all")),
    ("hybrid", Pattern(_tensor, model="given")),
    ("pipeline", Pattern(_pipeline, model="stages")),
    ("expert", Pattern(_expert, model="any")),
):
    register_pattern(_name, _built_in)
STRATEGIES = PATTERNS  # the names predict takes besides the catalog's (kept under its earlier name)


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
    k = _model_size(cluster, strategy, model)
    if not (isinstance(microbatches, int) and microbatches >= 1):
        raise ValueError(f"microbatches={microbatches!r} must be a whole number >= 1.")
    pattern = _pattern(strategy)
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
    - central_storage: every device pulls ``P`` from and pushes ``P`` to the first
      machine's host memory over its ``inside`` link (one machine only);
    - parameter_server: ``shards`` servers on machines of their own, each with a
      ``network`` link, each sending ``P/shards`` to every device and receiving as much;
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
      the activations they move, as :mod:`parallelkit.measure.sequence_costs` lists them.

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
    times the samples/s of the same workload on one device. ``model``: devices per
    model-parallel group for tensor (all of them) and hybrid, stages for pipeline, devices per
    expert group for expert (all of them by default).

    >>> work = Workload(param_bytes=0, seconds_per_sample=1e-3, batch_per_device=8, boundary_bytes=1e3)
    >>> link = Link("test", GBps=1, latency_us=0, source="by hand")
    >>> p = predict(work, Cluster(1, 4, link), "pipeline", microbatches=4)  # 4 stages
    >>> # bubble (s-1)/m x 8 ms = 6 ms; 2(m+s-1) = 14 sends of 1 kB x 32/4 samples: 14 x 8 us
    >>> round(p.idle_s * 1e3, 3), round(p.communication_s * 1e3, 3), round(p.efficiency, 3)
    (6.0, 0.112, 0.567)
    """
    compute = workload.compute_s
    hideable, critical = _communication(workload, cluster, strategy, allreduce, shards, model, microbatches)
    stages = _model_size(cluster, strategy, model) if _pattern(strategy).model == "stages" else 1
    idle = (stages - 1) / microbatches * compute  # the bubble: (s-1)/(m+s-1) of the pipeline's time
    exposed = critical + max(hideable - workload.overlap * compute, 0.0)
    step = compute + idle + exposed
    samples = workload.batch_per_device * cluster.devices / step
    single = workload.batch_per_device / compute if compute else math.inf
    efficiency = samples / (cluster.devices * single)
    return Prediction(strategy, cluster.devices, compute, exposed, step, samples, efficiency, idle_s=idle)


def fit_link(devices: int, nbytes: Sequence[float], seconds: Sequence[float], name: str = "fitted") -> Link:
    """The link whose ring all-reduce over ``devices`` best fits measured times (least squares).

    A ring of ``P`` bytes takes ``2(n-1) alpha + 2(n-1)/n x P / beta``: a straight line in
    ``P``; its intercept gives ``alpha`` and its slope ``beta``. Whatever algorithm the
    measured all-reduce really ran, the fit gives the ring-equivalent latency and bandwidth.

    >>> true = Link("true", GBps=2.0, latency_us=50.0, source="by hand")
    >>> sizes = [1e3, 1e5, 1e7]
    >>> times = [allreduce_seconds(Cluster(1, 4, true), s) for s in sizes]
    >>> fit = fit_link(4, sizes, times)
    >>> round(fit.GBps, 6), round(fit.latency_us, 6)
    (2.0, 50.0)
    """
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError("fit_link needs times for at least two different sizes, one time per size.")
    if not (isinstance(devices, int) and devices >= 2):
        raise ValueError(f"fit_link(devices={devices!r}): an all-reduce needs 2 or more devices.")
    n = len(nbytes)
    mean_p, mean_t = sum(nbytes) / n, sum(seconds) / n
    slope = sum((p - mean_p) * (t - mean_t) for p, t in zip(nbytes, seconds, strict=True))
    slope /= sum((p - mean_p) ** 2 for p in nbytes)
    intercept = mean_t - slope * mean_p
    if slope <= 0:
        raise ValueError("The measured times do not grow with the size: no bandwidth can be fitted.")
    rounds = 2 * (devices - 1)
    beta = rounds / devices / slope
    alpha = max(intercept / rounds, 0.0)
    return Link(name, beta / 1e9, alpha * 1e6, f"fitted to ring all-reduces over {devices} devices")


def scaled(link: Link, cards: int) -> Link:
    """``cards`` links side by side (a machine with several network cards): ``cards`` times the bandwidth."""
    return Link(f"{cards} x {link.name}", link.GBps * cards, link.latency_us, link.source)


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
