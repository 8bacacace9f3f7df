"""Mirrored data parallelism (TensorFlow's MirroredStrategy, PyTorch's DDP): ``pk.Mirrored``, :class:`MirroredJit`."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from ..core.accumulate import accumulated_placement
from ..core.devices import resolve_devices
from ..core.mesh import make_mesh
from ..core.precision import Precision
from ..core.step import Step
from ..core.types import DATA, LossFn
from . import data_parallel
from .allreduce import AllReduce
from .pmap import MirroredPmap
from .spmd import BATCH_ON_DATA, SPMD

BACKENDS = ("jit", "pmap")


def Mirrored(  # noqa: N802 (named as the class it returns, as TensorFlow's MirroredStrategy)
    devices: int | Sequence[jax.Device] | None = None,
    backend: str = "jit",
    allreduce: str | AllReduce | None = None,
    bucket_bytes: int | None = None,
    *,
    explicit: bool = False,
) -> MirroredJit | MirroredPmap:
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
      backend: ``"jit"`` (shardings: a :class:`MirroredJit`) or ``"pmap"`` (a
        :class:`~parallelkit.strategies.pmap.MirroredPmap`).
      allreduce: the gradient all-reduce: ``None`` (the compiler's), a name from
        :data:`parallelkit.strategies.allreduce.ALGORITHMS`, or a
        :class:`~parallelkit.strategies.allreduce.AllReduce`. Gradients and metrics travel as one
        float32 vector, the mean taken after the sum.
      bucket_bytes: ``None`` (the default): every gradient in one all-reduce. A number: the
        gradients in buckets of at most that many float32 bytes, one all-reduce each, in the
        order the backward pass produces them, read from the loss when the step is traced
        (:func:`~parallelkit.core.backward.gradient_order`: the last layer's first, the
        embeddings' last; :func:`~parallelkit.strategies.allreduce.mean_tree`).
        ``strategy.gradient_buckets(loss_fn, state, batch)`` lists their bytes. PyTorch DDP's
        default is 25 MB.
      explicit: run on a mesh of Explicit axes (``backend="jit"`` only): the state and the batch carry their
        shardings in their types (``jax.typeof``), as in JAX's own documentation.

    Raises:
      ValueError: an unknown backend, a hierarchical group that does not divide the devices,
        a ``bucket_bytes`` that is not a whole number >= 1 (NumPy integers are), or ``explicit`` with ``pmap``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Mirrored(backend={backend!r}): choose one of {BACKENDS}.")
    if backend == "pmap":
        if explicit:
            raise ValueError("Mirrored(backend='pmap', explicit=True): pmap has no mesh types; use backend='jit'.")
        return MirroredPmap(devices, allreduce=allreduce, bucket_bytes=bucket_bytes)
    return MirroredJit(devices, allreduce=allreduce, bucket_bytes=bucket_bytes, explicit=explicit)


class MirroredJit(SPMD):
    """Mirrored data parallelism as one ``jax.jit``: ``Mirrored(backend="jit")``, an SPMD preset.

    The mesh has one axis, ``data``; the batch's logical axis ``batch`` maps to it and every
    parameter is replicated (the SPMD defaults). With ``allreduce`` the step is the
    per-device program under ``jax.shard_map``, so that the gradients meet where it says;
    with ``bucket_bytes`` too, so that they meet in those buckets.
    """

    backend = "jit"

    def __init__(
        self,
        devices: int | Sequence[jax.Device] | None = None,
        *,
        allreduce: str | AllReduce | None = None,
        bucket_bytes: int | None = None,
        explicit: bool = False,
    ):
        chosen = resolve_devices(devices)
        super().__init__(make_mesh(chosen, data=len(chosen), explicit=explicit), rules=BATCH_ON_DATA)
        self.allreduce, self.bucket_bytes = data_parallel.parse_sync(allreduce, bucket_bytes, len(chosen))
        if explicit and (self.allreduce is not None or self.bucket_bytes is not None):
            raise ValueError(
                f"{self!r}: a hand-written all-reduce (or buckets) runs inside jax.shard_map, which is Manual mode "
                "already. Drop allreduce= and bucket_bytes= to run on an Explicit mesh, or use explicit=False."
            )

    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step:
        if self.allreduce is None and self.bucket_bytes is None:
            return super().step(loss_fn, accumulate, precision)  # the compiler inserts the all-reduce
        body = jax.shard_map(
            data_parallel.replica_step(loss_fn, self.allreduce, accumulate, precision, self.bucket_bytes),
            mesh=self.mesh,
            in_specs=(P(), P(DATA)),
            out_specs=(P(), P()),
            check_vma=False,  # permutes leave values JAX cannot prove equal; the all-reduce makes them so
        )
        state, batch = self.replicated, self.batch_sharding
        fn = jax.jit(body, in_shardings=(state, batch), out_shardings=(state, state), donate_argnums=0)
        return Step(fn, accumulated_placement(self.place_batch, accumulate, self.num_replicas), self, precision)

    pattern = "mirrored"
    expected_collectives = data_parallel.mirrored_collectives
    gradient_buckets = data_parallel.mirrored_buckets
    __repr__ = data_parallel.mirrored_repr
