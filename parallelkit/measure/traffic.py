"""Traffic accounting: the bytes one training step moves, measured, beside the textbook formulas.

Every figure is per replica (per device, where a strategy has one replica) and per
step, in bytes, on one of three kinds of link:

- ``host->device``: from host memory to a compute device (the batch slice; the pull of
  parameters kept off the devices);
- ``device->host``: from a compute device back to host memory;
- ``device<->device``: between devices (collectives; the push of gradients to the device
  that updates the state kept off the devices).

Strategies that keep the state off the devices (CentralStorage, ParameterServer) also
report the transfers at the state's owners, once per step rather than per replica: the
update programs copy the state in from host memory and write it back (``owner_flows``).

Each strategy reports its own traffic (``strategy.traffic(loss_fn, state, batch)``;
:func:`step_traffic` is the same call). Where the numbers come from:

- collectives: the compiled program's own collectives (:func:`parallelkit.measure.inspect.collectives`),
  as the *payload* each device contributes (the size of the all-reduced array, of the
  gathered result, of the scattered shard); the strategy's formulas say what the payload
  should be (:meth:`Strategy.expected_collectives <parallelkit.Strategy.expected_collectives>`);
- pulls and pushes (CentralStorage, ParameterServer): the arrays the strategy really
  moves, pulled and computed once here, measured on each device; the state's round trip:
  the host-memory arguments and results of the compiled update programs
  (:func:`parallelkit.measure.inspect.host_memory_bytes`);
- the batch: the placed batch, measured on each device.

What a collective sends over the wire depends on its algorithm. ``bus_bytes`` is a
*derived* figure, NCCL's algorithm-independent "bus bandwidth" convention applied to
the measured payloads: an all-reduce of ``S`` bytes over ``n`` devices counts
``2(n-1)/n x S``, what each device sends in a ring.

The formulas, with ``P`` the parameter bytes (a gradient has the same size) and ``n``
replicas: mirrored, an all-reduce of ``P`` (plus the scalar metrics, ``M`` bytes, which
XLA fuses into it); central storage ``P`` out to and ``P`` back from every replica, and the
state (``S``: parameters, optimizer state ``O``, counters) into and out of host memory at
the owner; parameter servers a pull and a push of ``P`` per worker, each split over the
``k`` shards, and each shard's state round trip.

:class:`TopologyModel` turns these bytes into a rough communication time per step, under
assumptions it states, to ask when central storage beats mirroring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

from ..core.backward import gradient_order
from ..core.contract import Batch, LossFn, batch_size, loss_with_aux, tree_bytes
from ..core.reports import D2D as D2D
from ..core.reports import D2H as D2H
from ..core.reports import H2D as H2D
from ..core.reports import LINKS as LINKS
from ..core.reports import ExpectedCollective as ExpectedCollective
from ..core.reports import Flow as Flow
from ..core.reports import Sizes as Sizes
from ..core.reports import StepTraffic as StepTraffic
from ..core.reports import gradient_all_reduce as gradient_all_reduce
from .costmodel import PATTERNS, Cluster, Link, Round, allreduce_rounds, alltoall_rounds
from .inspect import Collective, collectives, sent_bytes, summarize

if TYPE_CHECKING:
    from ..core.protocol import StrategyProtocol as Strategy
    from ..core.state import TrainState


def compare_table(traffics: Sequence[StepTraffic]) -> str:
    """One line per strategy: bytes per replica per step on each link, measured (formula in brackets).

    The owners' state round trip (CentralStorage, ParameterServer) is not per replica,
    so it is left out here: each strategy's :meth:`StepTraffic.table` shows it.
    """
    width = max([len("strategy"), *(len(t.strategy) for t in traffics)]) + 2
    head = f"{'strategy':<{width}}{'host->device':>20}{'device->host':>20}{'device<->device':>20}"
    lines = [head, "-" * len(head)]
    for t in traffics:
        cells = "".join(f"{f'{t.total(k):,.0f} ({t.total(k, expected=True):,.0f})':>20}" for k in LINKS)
        lines.append(f"{t.strategy:<{width}}{cells}")
    return "\n".join(lines)


def ring_factor(n: int) -> float:
    """``2(n-1)/n``: the share of an all-reduced array each replica sends in a ring all-reduce.

    >>> ring_factor(1), ring_factor(2), ring_factor(8)
    (0.0, 1.0, 1.75)
    """
    return 2 * (n - 1) / n


def _bytes_per_device(tree) -> dict[int, int]:
    """Bytes of ``tree`` on each device holding part of it."""
    held: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held


def per_replica_bytes(tree, devices: Sequence[jax.Device]) -> int:
    """Bytes of ``tree`` that each of ``devices`` holds (the same on every one, else an error)."""
    held = _bytes_per_device(tree)
    values = {held.get(d.id, 0) for d in devices}
    if len(values) != 1:
        raise RuntimeError(f"Replicas hold different amounts of one flow: {held}; expected equal shares.")
    return values.pop()


def bus_bytes(found: Sequence[Collective]) -> float:
    """Derived, not measured: NCCL's bus-bandwidth convention on each collective's payload.

    The bytes each device sends in the ring algorithms, by :func:`parallelkit.measure.inspect.sent_bytes`'s
    rule for each kind, in a group of the size the program states.

    >>> from parallelkit.measure.inspect import Collective
    >>> bus_bytes([Collective("all-reduce", ("f32[100]",), 100, 400, 4)])
    600.0
    """
    return float(sum(sent_bytes(c.op, c.bytes, c.group_size or 1) for c in found))


def sizes(strategy: Strategy, loss_fn: LossFn, state: TrainState, batch: Batch) -> Sizes:
    """The sizes the formulas use: parameter bytes, metric bytes, batch, replicas, and the gradients' order."""
    n = strategy.num_replicas
    params = strategy.unreplicate(state.params)
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype), batch)
    extras = {"model_state": strategy.unreplicate(state.model_state)} if state.model_state is not None else {}
    if state.rng is not None:
        extras["rng"] = jax.random.PRNGKey(0)
    loss, (aux, _) = jax.eval_shape(loss_with_aux(loss_fn), params, local, **extras)
    opt_leaves = jax.tree.leaves(state.opt_state)
    optimizer = sum(int(np.prod(strategy.logical_shape(x))) * x.dtype.itemsize for x in opt_leaves)
    order = gradient_order(loss_fn, params, local, **extras)
    return Sizes(tree_bytes(params), tree_bytes((loss, aux)), batch_size(batch), n, params, optimizer, order)


def batch_flow(strategy: Strategy, batch: Batch) -> Flow:
    """The batch slice each replica receives, measured after placement, beside ``B/n``."""
    placed = strategy.place_batch(batch)
    leaves = jax.tree.leaves(placed)
    if all(isinstance(x, jax.Array) for x in leaves):
        per_replica = max(_bytes_per_device(placed).values())  # devices that only split the model hold the same batch
    else:  # pmap's layout: host arrays of shape (replicas, per_replica, ...); row i goes to device i
        per_replica = sum(np.asarray(x)[0].nbytes for x in leaves)
    expected = tree_bytes(batch) / strategy.num_replicas
    return Flow(H2D, "batch slice", per_replica, expected, "B/n", "placed batch, per device")


def compiled_traffic(strategy: Strategy, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic:
    """The traffic of a step that is one compiled program: its batch slice and its collectives.

    Each collective kind the strategy expects (:meth:`~parallelkit.Strategy.expected_collectives`)
    becomes a flow whose measured payload is read from the compiled program; kinds it does
    not expect are listed as "other collectives" (expected 0, or no formula when the
    strategy has none for this model).
    """
    size = sizes(strategy, loss_fn, state, batch)
    found = collectives(strategy.step(loss_fn), state, batch)
    measured = {op: row["bytes"] for op, row in summarize(found).items()}
    expected = strategy.expected_collectives(size)
    flows = [batch_flow(strategy, batch)]
    for e in expected or ():
        flows.append(Flow(D2D, f"{e.what} ({e.op})", measured.pop(e.op, 0), e.bytes, e.formula, "compiled HLO"))
    known = expected is not None  # without formulas, what the program moves is reported as it is
    others = [Flow(D2D, f"other collectives ({op})", b, 0 if known else None, "0" if known else "no formula",
                   "compiled HLO") for op, b in measured.items()]  # fmt: skip
    flows += others or ([Flow(D2D, "other collectives", 0, 0, "0", "compiled HLO")] if known else [])
    return StepTraffic(repr(strategy), strategy.pattern, size.replicas, size.params, size.metrics,
                       tuple(flows), bus_bytes=bus_bytes(found))  # fmt: skip


def step_traffic(strategy: Strategy, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic:
    """Measure the bytes one step of ``strategy`` moves, beside the textbook formulas.

    The same as ``strategy.traffic(loss_fn, state, batch)``: every strategy reports its own.
    It compiles the step (or, for CentralStorage and ParameterServer, runs one pull and
    the workers' gradient computation, without touching ``state``); it does not train.

    Returns:
      A :class:`StepTraffic`; ``print(traffic.table())`` shows it.
    """
    return strategy.traffic(loss_fn, state, batch)


@dataclass(frozen=True)
class TopologyModel:
    """A back-of-the-envelope model of one step's communication time (latency-bandwidth, "alpha-beta").

    It is a model, not a measurement: :mod:`parallelkit.measure.costmodel`'s, for devices
    with links of their own (their collectives are its rounds over a one-machine
    :class:`~parallelkit.measure.costmodel.Cluster`), with what the cost model leaves out
    added: the host's links, which central storage and parameter servers cross, and devices
    that reach each other only through host memory. Its assumptions, all of them:

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
      all devices at once, all through the one host;
    - parameter servers: ``k`` shards, each with a host side of ``host_total_GBps`` of its
      own (separate machines), each serving its ``P/k`` to every worker;
    - expert parallelism: the all-to-alls a step's compiled program holds (their measured
      payloads ``S``), each a pairwise exchange over all ``n`` replicas in ``n - 1`` rounds
      of ``S/n`` per device, plus a ring all-reduce of every gradient ``P`` over all of them
      (with a ``data`` axis the expert groups are smaller and the expert weights' gradients
      meet only across them: then this is an upper bound);
    - compute, the optimizer update, the batch and any overlap of communication with
      compute are left out (real systems overlap: the ring can start during the backward
      pass, a pull cannot start before the previous update ends).

    >>> nvlink = TopologyModel(device_link_GBps=300, host_link_GBps=25, host_total_GBps=50, latency_us=5)
    >>> round(nvlink.mirrored_seconds(400e6, 8) * 1e3, 2), round(nvlink.central_seconds(400e6, 8) * 1e3, 1)
    (2.4, 128.0)
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

    def _per_byte(self, per_device: float, through_host: float) -> float:
        """Seconds per byte when each device moves ``per_device`` bytes and the host side ``through_host``."""
        own = per_device / (self.host_link_GBps * 1e9)
        shared = through_host / (self.host_total_GBps * 1e9) if self.host_total_GBps else 0.0
        return max(own, shared)

    def _ring_round(self, n: int) -> tuple[float, float]:
        """(latency, seconds per byte of ``P``) of one ring round: every device sends ``P/n`` to the next."""
        alpha = self.latency_us * 1e-6
        if self.device_link_GBps is None:  # up to the host and down again: n messages of P/n cross it
            return 2 * alpha, self._per_byte(1 / n, 1.0)
        return alpha, 1 / (n * self.device_link_GBps * 1e9)

    def _rounds_seconds(self, rounds: list[Round], nbytes: float, n: int) -> float:
        """``rounds`` of the ``n`` devices over their own links (the cost model's one-machine cluster), or, without
        such links, as many ring rounds through the host (:meth:`_ring_round`) of ``nbytes``."""
        if self.device_link_GBps is None:
            alpha, per_byte = self._ring_round(n)
            return len(rounds) * (alpha + nbytes * per_byte)
        cluster = Cluster(1, n, Link("device link", self.device_link_GBps, self.latency_us, "TopologyModel"))
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
        return 2 * (self.latency_us * 1e-6 + param_bytes * self._per_byte(1.0, n))

    def parameter_server_seconds(self, param_bytes: float, n: int, shards: int) -> float:
        """A pull and a push of ``P`` per worker, ``P/k`` from each shard; the ``k`` shards serve in parallel."""
        return 2 * (self.latency_us * 1e-6 + param_bytes * self._per_byte(1.0, n / shards))

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
        alpha, per_byte = self._ring_round(n)
        extra_latency = (n - 1) * alpha - self.latency_us * 1e-6  # mirrored's, beyond central's
        cheaper = self._per_byte(1.0, n) - (n - 1) * per_byte  # central's bytes cost this much more
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
        (``pk.costmodel.PATTERNS``: one vocabulary for both models).
    """
    if pattern in TOPOLOGY:
        raise ValueError(f"TopologyModel already models the pattern {pattern!r}.")
    if pattern not in PATTERNS:
        raise ValueError(f"{pattern!r} is not one of the cost model's patterns {list(PATTERNS)}: register_pattern it.")
    TOPOLOGY[pattern] = seconds


register_topology("single", lambda model, t: 0.0)
register_topology("mirrored", lambda model, t: model.mirrored_seconds(t.param_bytes, t.replicas))
register_topology("central_storage", lambda model, t: model.central_seconds(t.param_bytes, t.replicas))
register_topology(
    "expert",
    lambda model, t: (
        model.mirrored_seconds(t.param_bytes, t.replicas)
        + sum(model.alltoall_seconds(f.measured, t.replicas) for f in t.flows if "(all-to-all)" in f.what)
    ),
)
register_topology(
    "parameter_server",
    lambda model, t: model.parameter_server_seconds(t.param_bytes, t.replicas, len(t.owner_bytes)),
)
