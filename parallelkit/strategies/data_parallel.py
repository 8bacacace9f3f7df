"""What every replicated data-parallel strategy shares: how gradients meet, and what that moves."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from ..core.accumulate import Accumulation, check_accumulate
from ..core.backward import gradient_order
from ..core.precision import Precision, check_precision
from ..core.reports import ExpectedCollective, Sizes, gradient_all_reduce
from ..core.state import TrainState
from ..core.step import train_step
from ..core.types import DATA, Batch, LossFn, PyTree, is_count
from ..measure import traffic
from .allreduce import AllReduce, bucket_plan, mean_tree


def parse_sync(
    allreduce: str | AllReduce | None, bucket_bytes: int | None, replicas: int
) -> tuple[AllReduce | None, int | None]:
    """How the gradients of ``pk.Mirrored`` over ``replicas`` devices meet, checked: ``allreduce`` as an
    :class:`~parallelkit.strategies.allreduce.AllReduce` (None: the compiler's), and ``bucket_bytes``
    (:func:`_check_bucket_bytes`).

    Raises:
      TypeError: an ``allreduce`` that is neither a name nor an ``AllReduce``.
      ValueError: a hierarchical group that does not divide ``replicas``; any other ``bucket_bytes``.
    """
    chosen = AllReduce(allreduce) if isinstance(allreduce, str) else allreduce
    if chosen is not None and not isinstance(chosen, AllReduce):
        raise TypeError(f"Mirrored(allreduce={allreduce!r}): pass a name or a pk.collectives.AllReduce.")
    if chosen is not None and chosen.group and replicas % chosen.group:
        raise ValueError(
            f"Mirrored(allreduce={chosen!r}) groups {chosen.group} devices, which does not divide "
            f"{replicas} devices: choose a group size that does."
        )
    return chosen, _check_bucket_bytes(bucket_bytes)


def _check_bucket_bytes(bucket_bytes: int | None, caller: str = "Mirrored") -> int | None:
    """``bucket_bytes`` as a Python int, or None (one all-reduce); ``caller`` names the call in the error.

    Raises:
      ValueError: anything but None or a whole number >= 1 (NumPy integers are whole numbers).
    """
    if bucket_bytes is None:
        return None
    if not is_count(bucket_bytes):
        raise ValueError(
            f"{caller}(bucket_bytes={bucket_bytes!r}): give the most bytes one gradient bucket may hold, a whole "
            "number >= 1 (PyTorch DDP's default is 25 MB: bucket_bytes=25 * 2**20), or None for one all-reduce."
        )
    return int(bucket_bytes)


def _replica_sync(allreduce: AllReduce | None, bucket_bytes: int | None = None, order: Sequence[int] = ()) -> Callable:
    """How gradients, metrics and model state meet inside a per-device program (``pmap``, ``shard_map``):
    ``lax.pmean``, one hand-written all-reduce, or one all-reduce per gradient bucket, the buckets
    filled in ``order`` (the gradient leaves in the order the backward pass produces them)."""
    if allreduce is None and bucket_bytes is None:
        return functools.partial(jax.lax.pmean, axis_name=DATA)

    def sync(tree: tuple) -> tuple:
        grads, *rest = tree  # (gradients, metrics, model state): the rest rides in the first bucket
        nbytes = [4 * x.size for x in jax.tree.leaves(grads)]
        plan = bucket_plan(nbytes, bucket_bytes, order) if bucket_bytes is not None else [list(range(len(nbytes)))]
        plan[0] = [*plan[0], *range(len(nbytes), len(nbytes) + len(jax.tree.leaves(rest)))]
        return mean_tree(tree, DATA, allreduce, plan)

    return sync


def replica_step(
    loss_fn: LossFn,
    allreduce: AllReduce | None,
    accumulate: int = 1,
    precision: Precision | None = None,
    bucket_bytes: int | None = None,
) -> Callable:
    """The per-device training step (``pmap``, ``shard_map``): this replica's slice, then one sync.

    With ``accumulate > 1`` the slice runs as that many microbatches in a scan on the
    device, and the gradients meet once, after it. With ``precision`` the gradients are
    cast to its ``params`` dtype before they meet (:mod:`parallelkit.core.precision`).
    With ``bucket_bytes`` they meet in buckets of at most that many bytes, one all-reduce each,
    filled in the order the backward pass produces the gradients: read from the loss while the
    step is traced (:func:`~parallelkit.core.backward.gradient_order`), so it costs the steps nothing.
    """
    extra = {} if check_accumulate(accumulate) == 1 else {"accumulate": Accumulation(accumulate)}
    if check_precision(precision) is not None:
        extra["precision"] = precision
    step = functools.partial(train_step, loss_fn, replica_key=_own_key, **extra)
    if bucket_bytes is None:
        return functools.partial(step, sync=_replica_sync(allreduce))

    def bucketed(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        order = gradient_order(loss_fn, state.params, batch, **_loss_extras(state))
        return step(state, batch, sync=_replica_sync(allreduce, bucket_bytes, order))

    return bucketed


def _loss_extras(state: TrainState) -> dict:
    """What a step passes the loss besides the parameters and the batch: its ``rng`` and ``model_state``, if any."""
    extras = {} if state.rng is None else {"rng": state.rng}
    return extras if state.model_state is None else {**extras, "model_state": state.model_state}


def gradient_buckets(
    params: PyTree, bucket_bytes: int | None, order: Sequence[int], metric_bytes: int = 0
) -> list[int]:
    """The bytes of each gradient bucket, in the order they are reduced (the last layer's first).

    The plan of :func:`~parallelkit.strategies.allreduce.bucket_plan` over the parameters'
    leaves (float32 bytes), taken in ``order``: indices into ``jax.tree.leaves(params)`` in the
    order the backward pass produces their gradients (:func:`~parallelkit.core.backward.gradient_order`).
    The metrics' ``metric_bytes`` travel in the first bucket.

    >>> import numpy as np
    >>> gradient_buckets({"a": np.zeros(100), "b": np.zeros(300)}, 1000, order=[1, 0])  # 1,200 + 400 bytes
    [1200, 400]
    >>> gradient_buckets({"a": np.zeros(100), "b": np.zeros(300)}, 1000, order=[0, 1], metric_bytes=8)
    [408, 1200]

    Raises:
      ValueError: a ``bucket_bytes`` that is not None or a whole number >= 1, parameters that hold
        no arrays, or an ``order`` that does not name each leaf once.
    """
    bucket_bytes = _check_bucket_bytes(bucket_bytes, "gradient_buckets")
    nbytes = [4 * int(np.size(x)) for x in jax.tree.leaves(params)]
    if not nbytes:
        raise ValueError(
            f"gradient_buckets(params={params!r}): the parameters hold no arrays, so there are no gradients to "
            "put in buckets. Pass the model's parameters (a pytree of arrays)."
        )
    sizes = [sum(nbytes[i] for i in bucket) for bucket in bucket_plan(nbytes, bucket_bytes, order)]
    return [sizes[0] + metric_bytes, *sizes[1:]]


def _own_key(key: jax.Array) -> jax.Array:
    """Each replica its own key (dropout masks differ between replicas, as under pmap)."""
    return jax.random.fold_in(key, jax.lax.axis_index(DATA))


def expected_collectives(
    sizes: Sizes, allreduce: AllReduce | None = None, bucket_bytes: int | None = None
) -> tuple[ExpectedCollective, ...]:
    """One step's collectives by the book: the compiler's all-reduce of ``P + M``, or the hand-written one's permutes.

    A hand-written all-reduce is ``collective-permute`` instructions; their arrays add
    up to the bytes through the busiest device's link (:attr:`Cost.wire_bytes
    <parallelkit.strategies.allreduce.Cost.wire_bytes>`), of ``P + M`` padded to whole chunks.
    In ``k`` buckets (:func:`gradient_buckets`, in ``sizes.gradient_order``) the all-reduces carry
    ``P + M + 4(k - 1)`` bytes: each bucket after the first carries one float of the one before.
    One replica needs none.
    """
    if sizes.replicas == 1:
        return ()
    if allreduce is None and bucket_bytes is None:
        return (gradient_all_reduce(sizes),)
    buckets = (
        [sizes.params + sizes.metrics]
        if bucket_bytes is None
        else gradient_buckets(sizes.params_tree, bucket_bytes, sizes.gradient_order, sizes.metrics)
    )
    carried = [nbytes + 4 * (i > 0) for i, nbytes in enumerate(buckets)]  # each later one carries 4 bytes more
    if allreduce is None:
        k = len(buckets)
        return (ExpectedCollective("all-reduce", f"gradients and metrics, {k} bucket{'s' * (k > 1)}", sum(carried),
                                   "P + M + 4(k-1)"),)  # fmt: skip
    n = sizes.replicas
    multiple = 1 if allreduce.algorithm == "reduce_to_one" else n  # the chunks it cuts
    elements = [-(-nbytes // 4 // multiple) * multiple for nbytes in carried]  # float32, padded
    wire = sum(c.wire_bytes for e in elements for c in allreduce.cost(n, 4 * e).values())
    what = f"gradients and metrics, {allreduce.algorithm} all-reduce"
    what += f", {len(buckets)} buckets" if len(buckets) > 1 else ""
    return (ExpectedCollective("collective-permute", what, wire, "wire bytes of P + M (padded)"),)


# The methods both backends of pk.Mirrored share, written once: each class names them as its own
# (``expected_collectives = data_parallel.mirrored_collectives``), ``self`` a MirroredJit or a MirroredPmap.


def mirrored_collectives(self, sizes: Sizes) -> tuple[ExpectedCollective, ...]:
    """The compiler's all-reduce of ``P + M`` (in buckets, if any), or the hand-written one's permutes
    (:func:`parallelkit.strategies.data_parallel.expected_collectives`)."""
    return expected_collectives(sizes, self.allreduce, self.bucket_bytes)


def mirrored_buckets(self, loss_fn: LossFn, state: TrainState | None = None, batch: Batch | None = None) -> list[int]:
    """The float32 bytes of each gradient bucket of ``state``'s parameters, in the order they are reduced.

    The buckets follow the order the backward pass of ``loss_fn`` on ``batch`` produces the
    gradients, as the step's do (:func:`~parallelkit.strategies.data_parallel.gradient_buckets`;
    the metrics ride in the first, and are not counted here).

    Raises:
      TypeError: a loss that is not callable, or a ``state`` that is not the one ``strategy.init`` returns.
      ValueError: no batch.
    """
    if not callable(loss_fn) or not isinstance(state, TrainState):
        given = ", ".join(type(x).__name__ for x in (loss_fn, state, batch) if x is not None)
        raise TypeError(
            f"{self!r}.gradient_buckets(loss_fn, state, batch) got ({given}): the buckets follow the order the "
            "backward pass produces the gradients, read from the loss. Pass the loss, the state strategy.init "
            "returned and a batch."
        )
    if batch is None:
        raise ValueError(
            f"{self!r}.gradient_buckets(loss_fn, state) needs a batch as well: the order the backward pass "
            "produces the gradients is read from the loss on it. Pass one global batch."
        )
    found = traffic.sizes(self, loss_fn, state, batch)
    return gradient_buckets(found.params_tree, self.bucket_bytes, found.gradient_order)


def mirrored_repr(self) -> str:
    """How ``pk.Mirrored`` prints, whichever backend: ``Mirrored(backend='jit', devices=2)``."""
    how = f", allreduce={self.allreduce.algorithm!r}" if self.allreduce else ""
    how += f", bucket_bytes={self.bucket_bytes}" if self.bucket_bytes is not None else ""
    how += ", explicit=True" if getattr(self, "explicit", False) else ""  # a MirroredPmap has no mesh types
    return f"Mirrored(backend={self.backend!r}, devices={self.num_replicas}{how})"
