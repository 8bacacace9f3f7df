"""The cost model's patterns that split the sequence (context parallelism, Megatron's SP): :func:`plan`."""

from __future__ import annotations

from dataclasses import dataclass

from ...models.layers.attention import METHODS
from ..inspect import sent_bytes
from .links import Cluster, allreduce_seconds, alltoall_rounds, gradient_groups_seconds, groups, ring_pairs
from .workload import Options, Pattern, Workload

CONTEXT_METHODS = METHODS  # the kit's context methods (pk.models.layers.attention), each one the cost model times


@dataclass(frozen=True)
class Planned:
    """``count`` collectives ``op`` over ``devices`` in one device's step, each of ``payload`` bytes (pk.inspect's
    convention)."""

    op: str
    count: int
    payload: float
    devices: int

    @property
    def bytes(self) -> float:
        """All their payloads: what the compiled program's collectives state, to set beside them."""
        return self.count * self.payload

    @property
    def sent_bytes(self) -> float:
        """The bytes one device sends for all of them, one way (:func:`parallelkit.measure.sent_bytes`)."""
        return self.count * sent_bytes(self.op, self.payload, self.devices)


def plan(workload: Workload, name: str, n: int) -> list[Planned]:
    """What one device's training step sends to split the sequence over ``n`` devices, by ``name``.

    ``name``: one of :data:`PLANS` (``costmodel.sequence_collectives`` takes a catalog name for one too).
    The gradients' all-reduce is left out (it is data parallelism's).

    Raises:
      ValueError: a strategy that does not split the sequence, or a workload without
        ``sequence_bytes`` and ``layers``.

    Example:
      >>> work = Workload(0, 1e-3, batch_per_device=2, sequence_bytes=1024, layers=3)
      >>> [(c.op, c.count, c.payload) for c in plan(work, "context_ring", 4)]
      [('collective-permute', 36, 2048)]
      >>> [(c.op, c.payload, c.sent_bytes) for c in plan(work, "context_allgather", 4)]
      [('all-gather', 8192, 36864.0), ('reduce-scatter', 2048, 36864.0)]
    """
    if name not in PLANS:
        raise ValueError(f"{name!r} does not split the sequence: choose one of {list(PLANS)}.")
    if not (workload.sequence_bytes > 0 and workload.layers >= 1):
        raise ValueError(
            "Splitting the sequence moves activations: give Workload(sequence_bytes=..., layers=...), the bytes of "
            "one sample's (length, dim) activation (length x dim x item size) and the attention layers."
        )
    if n == 1:
        return []
    b, layers = workload.batch_per_device * workload.sequence_bytes, workload.layers
    return [Planned(op, count * layers, payload, n) for op, count, payload in PLANS[name](n, b) if count]


PLANS = {  # per layer: (op, count, payload) for n devices and a block of b bytes
    "context_allgather": lambda n, b: [("all-gather", 2, n * b), ("reduce-scatter", 2, b)],
    "context_ring": lambda n, b: [("collective-permute", 4 * (n - 1), b)],
    "context_ring_zigzag": lambda n, b: [("collective-permute", 4 * (n - 1), b), ("collective-permute", 16, b / 2)],
    "context_ulysses": lambda n, b: [("all-to-all", 8, b)],
    "sequence_parallel": lambda n, b: [("reduce-scatter", 4, b), ("all-gather", 4, n * b)],
}


def _rounds_seconds(cluster: Cluster, along: list[list[int]], planned: Planned) -> float:
    """``planned`` run over every group at once, in the cost model's rounds."""
    n, ring = len(along[0]), ring_pairs(along)
    if planned.op == "collective-permute":  # one round: every device sends its array to the next
        return planned.count * cluster.round_seconds([(s, t, planned.payload) for s, t in ring])
    if planned.op == "all-to-all":  # the pairwise exchange: n - 1 rounds of b/n to one peer each
        return planned.count * sum(cluster.round_seconds(r) for r in alltoall_rounds(along, planned.payload))
    share = planned.payload / n if planned.op == "all-gather" else planned.payload  # a ring's piece per round
    return planned.count * (n - 1) * cluster.round_seconds([(s, t, share) for s, t in ring])


def _splitting(name: str):
    def communication(workload: Workload, cluster: Cluster, options: Options) -> tuple[float, float]:
        n = options.model
        along, _ = groups(cluster.devices, n)
        critical = sum(_rounds_seconds(cluster, along, p) for p in plan(workload, name, n))
        if name == "sequence_parallel":  # each device's 1/n of the weights, over its data group
            return gradient_groups_seconds(cluster, workload.param_bytes, n), critical
        return allreduce_seconds(cluster, workload.param_bytes, options.allreduce), critical

    return communication


SEQUENCE_PATTERNS = {name: Pattern(_splitting(name), model="given") for name in PLANS}
