"""Mirrored data parallelism (TensorFlow's MirroredStrategy, PyTorch's DDP).

Every device holds a full copy of the parameters and optimizer state, takes its
slice of the global batch, and computes gradients; the gradients are averaged
across devices (an all-reduce) and every copy applies the same update, so the
copies never drift apart. Two backends show the two JAX idioms:

- ``"jit"``: one ``jax.jit`` with a ``data`` mesh axis: the batch is sharded on it,
  the state replicated; the compiler inserts the all-reduce. The modern path.
- ``"pmap"``: the classic per-device program with an explicit ``lax.pmean`` over
  the replica axis. Since JAX 0.8 ``pmap`` is built on ``jit`` + ``shard_map`` and is
  in maintenance mode; it is here because so much code and teaching uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from functools import cached_property

import jax
import numpy as np
import optax
from flax import jax_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..axes import DATA
from ..mesh import make_mesh
from .base import (
    Batch,
    DataParallelTraffic,
    LossFn,
    PyTree,
    Step,
    Strategy,
    TrainState,
    check_divisible,
    create_state,
    train_step,
)
from .jit import JitStrategy

BACKENDS = ("jit", "pmap")


class Mirrored(DataParallelTraffic, Strategy):
    """Replicate the model on every device and all-reduce the gradients.

    Conceptually, with ``n`` devices and a global batch ``b``::

        grads_i = grad(loss_fn)(params, b[i * len(b) // n : (i + 1) * len(b) // n])
        grads = mean(grads_i for i in range(n))  # the all-reduce
        params = update(params, grads)           # on every device, identically

    which equals the single-device step on ``b`` because the loss is a mean.

    Args:
      devices: how many devices (the first ``n``), or which; all by default.
      backend: ``"jit"`` (shardings) or ``"pmap"``.
    """

    backend: str

    def __new__(cls, devices: int | Sequence[jax.Device] | None = None, backend: str = "jit"):
        if cls is Mirrored:
            if backend not in BACKENDS:
                raise ValueError(f"Mirrored(backend={backend!r}): choose one of {BACKENDS}.")
            cls = _MirroredJit if backend == "jit" else _MirroredPmap
        return super().__new__(cls)

    def __init__(self, devices: int | Sequence[jax.Device] | None = None, backend: str = "jit"):
        super().__init__(devices)

    def __repr__(self) -> str:
        return f"Mirrored(backend={self.backend!r}, devices={self.num_replicas})"


class _MirroredJit(Mirrored, JitStrategy):
    backend = "jit"

    def __init__(self, devices=None, backend="jit"):
        super().__init__(devices)
        self.mesh = make_mesh(self.devices, data=len(self.devices))

    @cached_property
    def state_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())  # P(): every device holds the whole array

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA))  # the leading (batch) axis split over `data`


class _MirroredPmap(Mirrored):
    backend = "pmap"

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
            return jax.tree.map(lambda x: x.reshape(n, -1, *x.shape[1:]), batch)
        except ValueError:
            check_divisible(batch, n)  # explains the error; the check is off the per-step path
            raise

    def step(self, loss_fn: LossFn) -> Step:
        sync = functools.partial(jax.lax.pmean, axis_name=DATA)  # gradients, metrics and model state
        own_key = lambda key: jax.random.fold_in(key, jax.lax.axis_index(DATA))  # noqa: E731 each replica its own
        fn = jax.pmap(
            functools.partial(train_step, loss_fn, sync=sync, replica_key=own_key),
            axis_name=DATA,
            devices=self.devices,
            out_axes=(0, None),  # metrics are equal on every device after pmean: return one copy
            donate_argnums=0,
        )
        return Step(fn, self.place_batch, self)

    def unreplicate(self, tree: PyTree) -> PyTree:
        return jax.device_get(jax_utils.unreplicate(tree))

    def logical_shape(self, leaf: jax.Array) -> tuple[int, ...]:
        return tuple(leaf.shape[1:])
