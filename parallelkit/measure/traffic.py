"""Traffic accounting: the bytes one training step moves, measured, beside the formulas (:func:`step_traffic`).

``TopologyModel``, ``TOPOLOGY`` and ``register_topology`` are the cost model's, importable from here too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from ..core.backward import gradient_order
from ..core.contract import batch_size, loss_with_aux, tree_bytes
from ..core.reports import D2D as D2D
from ..core.reports import D2H as D2H
from ..core.reports import H2D as H2D
from ..core.reports import LINKS as LINKS
from ..core.reports import ExpectedCollective as ExpectedCollective
from ..core.reports import Flow as Flow
from ..core.reports import Sizes as Sizes
from ..core.reports import StepTraffic as StepTraffic
from ..core.reports import gradient_all_reduce as gradient_all_reduce
from ..core.types import Batch, LossFn
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


def compiled_traffic(
    strategy: Strategy,
    loss_fn: LossFn,
    state: TrainState,
    batch: Batch,
    collective_flows: Callable[[list[Collective], Sizes], list[Flow]] | None = None,
) -> StepTraffic:
    """The traffic of a step that is one compiled program: its batch slice and its collectives.

    By default each collective kind the strategy expects (:meth:`~parallelkit.Strategy.expected_collectives`)
    becomes a flow whose measured payload is read from the compiled program; kinds it does
    not expect are listed as "other collectives" (expected 0, or no formula when the
    strategy has none for this model). ``collective_flows(found, sizes)`` lays the program's
    collectives out as flows another way (per mesh axis: :func:`parallelkit.measure.groups.axis_traffic`).
    """
    size = sizes(strategy, loss_fn, state, batch)
    found = collectives(strategy.step(loss_fn), state, batch)
    flows = [batch_flow(strategy, batch), *(collective_flows or _expected_flows(strategy))(found, size)]
    return StepTraffic(repr(strategy), strategy.pattern, size.replicas, size.params, size.metrics,
                       tuple(flows), bus_bytes=bus_bytes(found))  # fmt: skip


def _expected_flows(strategy: Strategy) -> Callable[[list[Collective], Sizes], list[Flow]]:
    """The program's collectives set against ``strategy``'s formulas, kind by kind (:func:`compiled_traffic`)."""

    def flows(found: list[Collective], size: Sizes) -> list[Flow]:
        measured = {op: row["bytes"] for op, row in summarize(found).items()}
        expected = strategy.expected_collectives(size)
        out = [Flow(D2D, f"{e.what} ({e.op})", measured.pop(e.op, 0), e.bytes, e.formula, "compiled HLO")
               for e in expected or ()]  # fmt: skip
        known = expected is not None  # without formulas, what the program moves is reported as it is
        others = [Flow(D2D, f"other collectives ({op})", b, 0 if known else None, "0" if known else "no formula",
                       "compiled HLO") for op, b in measured.items()]  # fmt: skip
        return out + (others or ([Flow(D2D, "other collectives", 0, 0, "0", "compiled HLO")] if known else []))

    return flows


def step_traffic(strategy: Strategy, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic:
    """Measure the bytes one step of ``strategy`` moves, beside the textbook formulas.

    The same as ``strategy.traffic(loss_fn, state, batch)``: every strategy reports its own.
    It compiles the step (or, for CentralStorage and ParameterServer, runs one pull and
    the workers' gradient computation, without touching ``state``); it does not train.

    Returns:
      A :class:`StepTraffic`; ``print(traffic.table())`` shows it.
    """
    return strategy.traffic(loss_fn, state, batch)


_COST_MODEL_NAMES = ("TOPOLOGY", "TopologyModel", "register_topology")  # the cost model's, once imported from here


def __getattr__(name: str) -> object:
    """The cost model's names once imported from here, loaded when asked for: measuring needs no cost model."""
    if name in _COST_MODEL_NAMES:
        from .costmodel import topology

        return getattr(topology, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
