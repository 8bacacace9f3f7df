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

``allreduce`` picks how the gradients meet, as TensorFlow's ``cross_device_ops``
does: by default the compiler's own all-reduce (``lax.psum``); ``"ring"``,
``"tree"``, ``"reduce_to_one"`` or ``AllReduce("hierarchical", group=g)`` run the
hand-written algorithms of :mod:`parallelkit.collectives` instead, inside
``jax.shard_map`` (backend ``"jit"``) or ``pmap``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from functools import cached_property
from typing import TYPE_CHECKING

import jax
import numpy as np
import optax
from flax import jax_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..axes import DATA
from ..collectives import AllReduce, mean_tree
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

if TYPE_CHECKING:
    from ..traffic import ExpectedCollective, Sizes

BACKENDS = ("jit", "pmap")


class Mirrored(DataParallelTraffic, Strategy):
    """Replicate the model on every device and all-reduce the gradients.

    Conceptually, with ``n`` devices and a global batch ``b``::

        grads_i = grad(loss_fn)(params, b[i * len(b) // n : (i + 1) * len(b) // n])
        grads = mean(grads_i for i in range(n))  # the all-reduce
        params = update(params, grads)           # on every device, identically

    which equals the single-device step on ``b`` because the loss is a mean over the
    examples (an unweighted one: a loss divided by a per-replica count, such as unmasked
    tokens, averages differently).

    Args:
      devices: how many devices (the first ``n``), or which; all by default.
      backend: ``"jit"`` (shardings) or ``"pmap"``.
      allreduce: the gradient all-reduce: ``None`` (the compiler's), a name from
        :data:`parallelkit.collectives.ALGORITHMS`, or a
        :class:`~parallelkit.collectives.AllReduce`. Gradients and metrics travel as one
        float32 vector, the mean taken after the sum.
    """

    backend: str
    allreduce: AllReduce | None

    def __new__(
        cls,
        devices: int | Sequence[jax.Device] | None = None,
        backend: str = "jit",
        allreduce: str | AllReduce | None = None,
    ):
        if cls is Mirrored:
            if backend not in BACKENDS:
                raise ValueError(f"Mirrored(backend={backend!r}): choose one of {BACKENDS}.")
            cls = _MirroredJit if backend == "jit" else _MirroredPmap
        return super().__new__(cls)

    def __init__(
        self,
        devices: int | Sequence[jax.Device] | None = None,
        backend: str = "jit",
        allreduce: str | AllReduce | None = None,
    ):
        super().__init__(devices)
        self.allreduce = AllReduce(allreduce) if isinstance(allreduce, str) else allreduce
        if self.allreduce is not None and not isinstance(self.allreduce, AllReduce):
            raise TypeError(f"Mirrored(allreduce={allreduce!r}): pass a name or a pk.collectives.AllReduce.")
        group = self.allreduce.group if self.allreduce else None
        if group and self.num_replicas % group:
            raise ValueError(
                f"Mirrored(allreduce={self.allreduce!r}) groups {group} devices, which does not divide "
                f"{self.num_replicas} devices: choose a group size that does."
            )

    def __repr__(self) -> str:
        how = f", allreduce={self.allreduce.algorithm!r}" if self.allreduce else ""
        return f"Mirrored(backend={self.backend!r}, devices={self.num_replicas}{how})"

    def _sync(self):
        """How gradients, metrics and model state meet inside the per-device program."""
        if self.allreduce is None:
            return functools.partial(jax.lax.pmean, axis_name=DATA)
        return functools.partial(mean_tree, axis=DATA, allreduce=self.allreduce)

    def expected_collectives(self, sizes: Sizes) -> tuple[ExpectedCollective, ...]:
        """The compiler's all-reduce of ``P + M``, or the hand-written one's permutes.

        A hand-written all-reduce is ``collective-permute`` instructions; their arrays add
        up to the bytes through the busiest device's link (:attr:`Cost.wire_bytes
        <parallelkit.collectives.Cost.wire_bytes>`), of ``P + M`` padded to whole chunks.
        """
        from ..traffic import ExpectedCollective  # the traffic module builds on the strategies

        if self.allreduce is None or sizes.replicas == 1:
            return super().expected_collectives(sizes)
        n = sizes.replicas
        multiple = 1 if self.allreduce.algorithm == "reduce_to_one" else n  # the chunks it cuts
        elements = -(-(sizes.params + sizes.metrics) // 4 // multiple) * multiple  # float32, padded
        cost = self.allreduce.cost(n, 4 * elements)
        wire = sum(c.wire_bytes for c in cost.values())
        what = f"gradients and metrics, {self.allreduce.algorithm} all-reduce"
        return (ExpectedCollective("collective-permute", what, wire, "wire bytes of P + M (padded)"),)


def _own_key(key: jax.Array) -> jax.Array:
    """Each replica its own key (dropout masks differ between replicas, as under pmap)."""
    return jax.random.fold_in(key, jax.lax.axis_index(DATA))


class _MirroredJit(Mirrored, JitStrategy):
    backend = "jit"

    def __init__(self, devices=None, backend="jit", allreduce=None):
        super().__init__(devices, allreduce=allreduce)
        self.mesh = make_mesh(self.devices, data=len(self.devices))

    def step(self, loss_fn: LossFn) -> Step:
        if self.allreduce is None:
            return super().step(loss_fn)  # the compiler inserts the all-reduce
        # The per-device program, as under pmap, so that the gradients meet where we say.
        body = jax.shard_map(
            functools.partial(train_step, loss_fn, sync=self._sync(), replica_key=_own_key),
            mesh=self.mesh,
            in_specs=(P(), P(DATA)),
            out_specs=(P(), P()),
            check_vma=False,  # permutes leave values JAX cannot prove equal; the all-reduce makes them so
        )
        state, batch = self.state_sharding, self.batch_sharding
        fn = jax.jit(body, in_shardings=(state, batch), out_shardings=(state, state), donate_argnums=0)
        return Step(fn, self.place_batch, self)

    @cached_property
    def state_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())  # P(): every device holds the whole array

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(DATA))  # the leading (batch) axis split over `data`


class _MirroredPmap(Mirrored):
    backend = "pmap"

    def __init__(self, devices=None, backend="pmap", allreduce=None):
        super().__init__(devices, allreduce=allreduce)

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
        fn = jax.pmap(
            functools.partial(train_step, loss_fn, sync=self._sync(), replica_key=_own_key),
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
