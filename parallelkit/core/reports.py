"""What a strategy reports about one step's traffic: :class:`StepTraffic` of :class:`Flow` rows, and the collectives
its formulas expect (:class:`ExpectedCollective`, in :class:`Sizes`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

H2D, D2H, D2D = "host->device", "device->host", "device<->device"
LINKS = (H2D, D2H, D2D)


@dataclass(frozen=True)
class Flow:
    """One kind of transfer in a step: bytes per replica, measured and by the formula."""

    link: str  # one of LINKS
    what: str  # e.g. "parameters (pull)"
    measured: float  # bytes per replica per step
    expected: float | None  # the formula's value, bytes per replica per step (None: no formula known)
    formula: str  # e.g. "P + M"
    source: str  # where ``measured`` comes from


@dataclass(frozen=True)
class ExpectedCollective:
    """A collective a strategy's step needs by the book: its payload per device, and the formula."""

    op: str  # one of parallelkit.measure.inspect.COLLECTIVES
    what: str  # e.g. "gradients and metrics"
    bytes: float
    formula: str


@dataclass(frozen=True)
class Sizes:
    """What the traffic formulas are written in."""

    params: int  # P: parameter bytes
    metrics: int  # M: the scalar metrics one replica reports
    batch: int  # the global batch's examples
    replicas: int  # n
    params_tree: object = None  # the parameters themselves (host copies), for formulas that need their shapes
    optimizer: int = 0  # bytes of the optimizer state
    # the parameter leaves in the order the backward pass finishes their gradients
    # (parallelkit.core.backward.gradient_order): the order gradient buckets follow
    gradient_order: tuple[int, ...] | None = None


def gradient_all_reduce(sizes: Sizes) -> ExpectedCollective:
    """Data parallelism's collective: every gradient and the scalar metrics, all-reduced (``P + M``)."""
    return ExpectedCollective("all-reduce", "gradients and metrics", sizes.params + sizes.metrics, "P + M")


@dataclass(frozen=True)
class StepTraffic:
    """What one step of one strategy moves, flow by flow (bytes per replica).

    ``owner_bytes`` is the load on each central owner of the state (CentralStorage's
    storage, each PS shard): gradient bytes it receives per step from all replicas,
    which equals the parameter bytes it sends. ``owner_flows`` are the transfers at the
    owners, all owners together, once per step (not per replica): the state's round trip
    between host memory and the device that updates it. Replicated strategies have neither.
    """

    strategy: str
    pattern: str  # the strategy's pattern: "single", "mirrored", "central_storage", ... (pk.costmodel.PATTERNS)
    replicas: int
    param_bytes: int  # P
    metric_bytes: int  # M: the scalar metrics one replica reports
    flows: tuple[Flow, ...]
    owner_bytes: tuple[int, ...] = ()
    bus_bytes: float = 0.0  # derived: NCCL's bus-bandwidth convention on the measured collectives
    owner_flows: tuple[Flow, ...] = ()  # bytes per step at the owners, all of them together

    def total(self, link: str, expected: bool = False) -> float:
        """Bytes per replica per step on ``link`` (measured, or by the formulas; NaN where one has none)."""
        if link not in LINKS:
            raise ValueError(f"Unknown link {link!r}: choose one of {LINKS}.")
        values = [f.expected if expected else f.measured for f in self.flows if f.link == link]
        return sum(np.nan if v is None else v for v in values)

    @property
    def host_to_device(self) -> float:
        return self.total(H2D)

    @property
    def device_to_host(self) -> float:
        return self.total(D2H)

    @property
    def between_devices(self) -> float:
        return self.total(D2D)

    def flow(self, what: str) -> Flow:
        """The flow (per replica, or at the owners) whose ``what`` starts with ``what``."""
        for f in (*self.flows, *self.owner_flows):
            if f.what.startswith(what):
                return f
        known = [f.what for f in (*self.flows, *self.owner_flows)]
        raise KeyError(f"{self.strategy} has no flow {what!r}; it has {known}.")

    def table(self) -> str:
        """The flows as a text table, measured beside the formula."""

        def row(f: Flow) -> str:
            expected = "n/a" if f.expected is None else f"{f.expected:,.0f}"
            return f"  {f.link:<17}{f.what:<36}{f.measured:>11,.0f}{expected:>11}  {f.formula}  [{f.source}]"

        lines = [
            f"{self.strategy}: {self.replicas} replica(s), P = {self.param_bytes:,} B, M = {self.metric_bytes} B",
            f"  {'link':<17}{'what':<36}{'measured B':>11}{'formula B':>11}  formula  [measured from]",
            *map(row, self.flows),
        ]
        if self.owner_flows:
            lines += ["  at the owner(s), once per step (not per replica):", *map(row, self.owner_flows)]
        if self.bus_bytes:
            lines.append(f"  bus bytes per device (derived by NCCL's bus-bandwidth convention, not measured): "
                         f"{self.bus_bytes:,.0f}")  # fmt: skip
        if self.owner_bytes:
            loads = ", ".join(f"{b:,}" for b in self.owner_bytes)
            lines.append(f"  owner load (gradient bytes in = parameter bytes out, per step): {loads}")
        return "\n".join(lines)
