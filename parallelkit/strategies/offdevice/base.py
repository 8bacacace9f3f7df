"""The family base of the strategies that keep the state off the compute devices."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from functools import cached_property

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ...core.contract import put_batch, tree_bytes
from ...core.mesh import make_mesh, outside_callers_mesh
from ...core.reports import D2D, D2H, H2D, Flow, StepTraffic
from ...core.state import TrainState
from ...core.types import DATA, Batch, LossFn
from ...measure.inspect import collectives, host_memory_bytes
from ...measure.traffic import batch_flow, bus_bytes, per_replica_bytes, sizes
from ..base import Strategy
from .rows import ReplicaRows

# Why central storage and parameter servers run Auto mode only (refuse_explicit's sentence).
NOT_EXPLICIT = (
    "Its state lives in host memory and each step is several programs on different devices (the pull, the workers' "
    "gradients, the update where the state lives), not one program over a mesh whose types could carry the shardings."
)


class OffDeviceStrategy(Strategy):
    """Shared base: workers on a ``data`` mesh compute, the state lives elsewhere."""

    def __init__(self, devices: int | Sequence[jax.Device] | None = None):
        super().__init__(devices)
        self.mesh = make_mesh(self.devices, data=len(self.devices))

    @cached_property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA))

    def place_batch(self, batch: Batch) -> Batch:
        """Send each slice of the global batch to its worker (a clear error when it does not split)."""
        return put_batch(batch, self.batch_sharding, self.num_replicas)

    def pull(self, state: TrainState) -> tuple:
        """The pull: the parameters (every shard of them), the key, the model state and the loss scale,
        copied to every worker."""
        return jax.device_put((state.params, state.rng, state.model_state, state.loss_scale), self.replicated)

    pattern = "central_storage"
    pull_label, push_label, formula = "parameters (pull)", "gradients (push to the storage device)", "P"

    def owner_loads(self, rows: ReplicaRows) -> tuple[int, ...]:
        """Gradient bytes each owner of the state receives per step (all replicas' rows)."""
        return (tree_bytes(rows.grads),)

    def round_trip_bytes(self, state: TrainState) -> tuple[int, str]:
        """(bytes, formula) of the state its update programs copy in from host memory, and back, per step."""
        return tree_bytes(state), "S = P + O + step, key, model state"

    @outside_callers_mesh
    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch, accumulate: int = 1) -> StepTraffic:
        """Every transfer of a step, measured on the arrays and programs this strategy really runs.

        Runs one pull and the workers' gradient computation (real copies; ``state`` is
        left as it is) and measures what lands on each worker; reads the workers'
        compiled program for collectives (none, unless the model adds its own) and the
        update programs for the state they copy in from host memory and write back.
        Per replica: the batch slice, the pull (host memory to each worker), the push
        (each worker's rows to the owner's device; the owner's own row stays where it
        is). At the owners, once per step: the state's round trip. ``accumulate``: measure the
        step that runs ``K`` microbatches (each worker averages their gradients before its one push).
        """
        step = self.step(loss_fn, accumulate)
        size = sizes(self, loss_fn, state, batch)
        params, *rest = step.fn.pull(state)  # real copies, host memory -> every worker
        placed = step.place_batch(batch)
        rows = step.fn.compute(params, placed, *rest)  # rows stay on their workers
        found = collectives(step.fn.compute, params, placed, *rest)
        measure = functools.partial(per_replica_bytes, devices=self.devices)
        flows = (
            batch_flow(self, batch),
            Flow(H2D, self.pull_label, measure(params), size.params, self.formula, "pulled arrays, per device"),
            Flow(D2D, self.push_label, measure(rows.grads), size.params, self.formula, "pushed gradient rows"),
            Flow(D2D, "metrics (push)", measure(rows.metrics), size.metrics, "M", "pushed metric rows"),
            Flow(D2D, "collectives", sum(c.bytes for c in found), 0, "0", "compiled HLO of the workers"),
        )
        moved = [host_memory_bytes(u.compile().as_text()) for u in step.fn.push_update.lowered(state, rows)]
        expected, formula = self.round_trip_bytes(state)
        source = "host-memory {} of the update program(s)"
        owner_flows = (
            Flow(H2D, "state in (host memory -> owner)", sum(m[0] for m in moved), expected, formula,
                 source.format("arguments")),
            Flow(D2H, "state out (owner -> host memory)", sum(m[1] for m in moved), expected, formula,
                 source.format("results")),
        )  # fmt: skip
        return StepTraffic(repr(self), self.pattern, size.replicas, size.params, size.metrics, flows,
                           self.owner_loads(rows), bus_bytes(found), owner_flows)  # fmt: skip
