"""Mirrored data parallelism with ``jax.pmap``: ``Mirrored(backend="pmap")`` (:class:`MirroredPmap`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import optax
from flax import jax_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.accumulate import accumulated_placement
from ..core.contract import check_divisible
from ..core.mesh import make_mesh, outside_callers_mesh
from ..core.precision import Precision
from ..core.state import TrainState, create_state
from ..core.step import Step
from ..core.types import DATA, Batch, LossFn, PyTree
from . import data_parallel
from .allreduce import AllReduce
from .base import Strategy


class MirroredPmap(Strategy):
    """Replicate the model on every device with ``jax.pmap``; gradients meet in ``lax.pmean``.

    Args:
      devices: how many devices (the first ``n``), or which; all by default.
      allreduce: as for :func:`~parallelkit.Mirrored`: ``None`` (``lax.pmean``) or a hand-written algorithm.
      bucket_bytes: as for :func:`~parallelkit.Mirrored`: ``None`` (one all-reduce) or the most bytes of a
        bucket, the buckets in the order the backward pass produces the gradients.
    """

    backend = "pmap"

    def __init__(
        self,
        devices: int | Sequence[jax.Device] | None = None,
        *,
        allreduce: str | AllReduce | None = None,
        bucket_bytes: int | None = None,
    ):
        super().__init__(devices)
        self.allreduce, self.bucket_bytes = data_parallel.parse_sync(allreduce, bucket_bytes, self.num_replicas)

    @outside_callers_mesh
    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        # pmap's convention: a leading axis of length n, one copy per device. The
        # sharding is the one pmap gives its outputs, so the second step reuses the
        # first step's compiled program.
        stacked = NamedSharding(make_mesh(self.devices, data=self.num_replicas), P(DATA))
        host = jax.device_get(create_state(params, tx, opt_state, model_state=model_state, rng=rng))
        return jax.device_put(
            jax.tree.map(lambda x: np.broadcast_to(x, (self.num_replicas, *np.shape(x))), host), stacked
        )

    def place_batch(self, batch: Batch) -> Batch:
        """Reshape each global array to ``(replicas, per_replica, ...)``; pmap sends row i to device i."""
        n = self.num_replicas
        try:
            if type(batch) is dict:  # the usual flat batch, without the tree machinery (a few us a step)
                try:
                    return {key: x.reshape(n, -1, *x.shape[1:]) for key, x in batch.items()}
                except AttributeError:  # a nested value: map over the tree below
                    pass
            return jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        except ValueError:
            check_divisible(batch, n)  # explains the error; the check is off the per-step path
            raise

    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step:
        """The pmapped step; ``accumulate=K`` scans ``K`` microbatches on each device, then one ``pmean``
        (or one all-reduce per gradient bucket);
        ``precision`` casts the passes and the gradients before it (:mod:`parallelkit.core.precision`)."""
        fn = jax.pmap(
            data_parallel.replica_step(loss_fn, self.allreduce, accumulate, precision, self.bucket_bytes),
            axis_name=DATA,
            devices=self.devices,
            out_axes=(0, None),  # metrics are equal on every device after pmean: return one copy
            donate_argnums=0,
        )
        return Step(fn, accumulated_placement(self.place_batch, accumulate, self.num_replicas), self, precision)

    @outside_callers_mesh
    def unreplicate(self, tree: PyTree) -> PyTree:
        return jax.device_get(jax_utils.unreplicate(tree))

    def logical_shape(self, leaf: jax.Array) -> tuple[int, ...]:
        return tuple(leaf.shape[1:])

    pattern = "mirrored"
    expected_collectives = data_parallel.mirrored_collectives
    gradient_buckets = data_parallel.mirrored_buckets
    __repr__ = data_parallel.mirrored_repr
