"""What every replicated data-parallel strategy shares: how gradients meet, and what that moves.

:class:`~parallelkit.strategies.mirrored.MirroredJit`, :class:`~parallelkit.strategies.pmap.MirroredPmap`,
:class:`~parallelkit.MultiWorkerMirrored` and :class:`~parallelkit.SingleDevice` (one replica)
hold a full copy of the state on every device and average the gradients once a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from ..core.accumulate import Accumulation, check_accumulate
from ..core.axes import DATA
from ..core.contract import LossFn
from ..core.precision import Precision, check_precision
from ..core.reports import ExpectedCollective, Sizes, gradient_all_reduce
from ..core.step import train_step
from .allreduce import AllReduce, mean_tree


def parse_allreduce(allreduce: str | AllReduce | None, replicas: int, who: str) -> AllReduce | None:
    """``allreduce`` as an :class:`~parallelkit.strategies.allreduce.AllReduce` (None: the compiler's), checked.

    Raises:
      TypeError: neither a name nor an ``AllReduce``.
      ValueError: a hierarchical group that does not divide ``replicas``.
    """
    chosen = AllReduce(allreduce) if isinstance(allreduce, str) else allreduce
    if chosen is not None and not isinstance(chosen, AllReduce):
        raise TypeError(f"{who}(allreduce={allreduce!r}): pass a name or a pk.collectives.AllReduce.")
    if chosen is not None and chosen.group and replicas % chosen.group:
        raise ValueError(
            f"{who}(allreduce={chosen!r}) groups {chosen.group} devices, which does not divide "
            f"{replicas} devices: choose a group size that does."
        )
    return chosen


def replica_sync(allreduce: AllReduce | None) -> Callable:
    """How gradients, metrics and model state meet inside a per-device program (``pmap``, ``shard_map``)."""
    if allreduce is None:
        return functools.partial(jax.lax.pmean, axis_name=DATA)
    return functools.partial(mean_tree, axis=DATA, allreduce=allreduce)


def replica_step(
    loss_fn: LossFn, allreduce: AllReduce | None, accumulate: int = 1, precision: Precision | None = None
) -> Callable:
    """The per-device training step (``pmap``, ``shard_map``): this replica's slice, then one sync.

    With ``accumulate > 1`` the slice runs as that many microbatches in a scan on the
    device, and the gradients meet once, after it. With ``precision`` the gradients are
    cast to its ``params`` dtype before they meet (:mod:`parallelkit.core.precision`).
    """
    extra = {} if check_accumulate(accumulate) == 1 else {"accumulate": Accumulation(accumulate)}
    if check_precision(precision) is not None:
        extra["precision"] = precision
    return functools.partial(train_step, loss_fn, sync=replica_sync(allreduce), replica_key=own_key, **extra)


def own_key(key: jax.Array) -> jax.Array:
    """Each replica its own key (dropout masks differ between replicas, as under pmap)."""
    return jax.random.fold_in(key, jax.lax.axis_index(DATA))


def mirrored_repr(backend: str, replicas: int, allreduce: AllReduce | None) -> str:
    """How ``pk.Mirrored`` prints, whichever backend: ``Mirrored(backend='jit', devices=2)``."""
    how = f", allreduce={allreduce.algorithm!r}" if allreduce else ""
    return f"Mirrored(backend={backend!r}, devices={replicas}{how})"


def traffic_pattern(replicas: int) -> str:
    """The traffic pattern of replicated data parallelism: an all-reduce, or nothing on one device."""
    return "all-reduce" if replicas > 1 else "local"


def expected_collectives(sizes: Sizes, allreduce: AllReduce | None = None) -> tuple[ExpectedCollective, ...]:
    """One step's collectives by the book: the compiler's all-reduce of ``P + M``, or the hand-written one's permutes.

    A hand-written all-reduce is ``collective-permute`` instructions; their arrays add
    up to the bytes through the busiest device's link (:attr:`Cost.wire_bytes
    <parallelkit.strategies.allreduce.Cost.wire_bytes>`), of ``P + M`` padded to whole chunks.
    One replica needs none.
    """
    if sizes.replicas == 1:
        return ()
    if allreduce is None:
        return (gradient_all_reduce(sizes),)
    n = sizes.replicas
    multiple = 1 if allreduce.algorithm == "reduce_to_one" else n  # the chunks it cuts
    elements = -(-(sizes.params + sizes.metrics) // 4 // multiple) * multiple  # float32, padded
    wire = sum(c.wire_bytes for c in allreduce.cost(n, 4 * elements).values())
    what = f"gradients and metrics, {allreduce.algorithm} all-reduce"
    return (ExpectedCollective("collective-permute", what, wire, "wire bytes of P + M (padded)"),)
