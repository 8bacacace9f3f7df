"""How gradients meet: per-replica gradients before the all-reduce, and after it.

Off the training path: a strategy's compiled step never returns its per-replica
gradients (that would cost memory and time on every step). On request, a
:class:`GradientProbe` recomputes them for one batch, slicing the global batch the
way data-parallel strategies do (replica ``i`` takes rows ``i*b/n`` to ``(i+1)*b/n``)
and averaging with a real ``lax.pmean`` under ``jax.shard_map``.

Conceptually, for ``n`` replicas and a global batch ``b``::

    before[i] = grad(loss_fn)(params, b[i * len(b) // n : (i + 1) * len(b) // n])
    after[i] = mean(before)  # what every replica holds once the all-reduce is done

:func:`ring_allreduce_trace` replays the same average as a ring all-reduce, recording
every chunk that moves, for a step-through figure.

>>> import numpy as np
>>> ring = ring_allreduce_trace(np.arange(6.0).reshape(3, 2))  # 3 replicas, 2 numbers each
>>> ring.result[0].tolist(), len(ring.steps)
([2.0, 3.0], 4)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ..core.contract import check_divisible, loss_with_aux
from ..core.mesh import make_mesh
from ..core.partition import path_label
from ..core.renamed import renamed
from ..core.state import TrainState
from ..core.types import DATA, Batch, LossFn, PyTree

if TYPE_CHECKING:
    from ..core.protocol import StrategyProtocol as Strategy


@dataclass(frozen=True)
class GradSync:
    """One step's gradients, per layer (leaf), on every replica, before and after sync."""

    layers: tuple[str, ...]
    before: tuple[np.ndarray, ...]  # per layer [replicas, *shape]: replica i's gradient on its slice
    after: tuple[np.ndarray, ...]  # per layer [replicas, *shape]: what replica i holds after the all-reduce
    losses: np.ndarray  # [replicas]: each replica's loss on its slice
    step: int = 0

    @property
    def replicas(self) -> int:
        return len(self.losses)

    @property
    def synced(self) -> tuple[np.ndarray, ...]:
        """The synchronised gradient (replica 0's copy; every copy is the same)."""
        return tuple(a[0] for a in self.after)

    def grads(self, after: bool = False) -> tuple[np.ndarray, ...]:
        return self.after if after else self.before

    def replica_norms(self, after: bool = False) -> np.ndarray:
        """``[replicas, layers]``: the L2 norm of each replica's gradient of each layer."""
        return np.stack([np.linalg.norm(g.reshape(g.shape[0], -1), axis=1) for g in self.grads(after)], axis=1)

    def spread(self, after: bool = False) -> np.ndarray:
        """``[layers]``: how far the replicas disagree, as the RMS of ``g_i - mean_j g_j``.

        Before sync each replica saw different examples, so this is positive; after
        the all-reduce every replica holds the same average, so it is exactly 0.
        """
        # float64: the mean of n equal float32 numbers is then exactly that number
        grads = [g.astype(np.float64) for g in self.grads(after)]
        return np.array([np.sqrt(np.mean((g - g.mean(axis=0)) ** 2)) for g in grads])


class GradientProbe:
    """Per-replica gradients of ``loss_fn`` before and after the all-reduce, for one batch.

    Compiled once per probe (reuse it across steps). Replicas are the strategy's
    first ``num_replicas`` devices.

    Args:
      strategy: a data-parallel strategy (its ``devices`` and ``num_replicas`` are used).
      loss_fn: the same ``loss_fn(params, batch)`` given to ``strategy.step``.
    """

    def __init__(self, strategy: Strategy, loss_fn: LossFn):
        self.strategy = strategy
        devices = list(strategy.devices)[: strategy.num_replicas]
        self.mesh = make_mesh(devices, data=len(devices))
        grad_fn = jax.value_and_grad(loss_with_aux(loss_fn), has_aux=True)

        def per_replica(params, local_batch):
            # Mark the replicated parameters as per-replica ("varying") first: otherwise
            # shard_map's autodiff transposes their implicit broadcast into a psum, and
            # each replica's gradient would already be the synced one.
            params = jax.tree.map(lambda x: jax.lax.pcast(x, DATA, to="varying"), params)
            (loss, _), grads = grad_fn(params, local_batch)
            synced = jax.lax.pmean(grads, DATA)  # the all-reduce a mirrored step performs
            lead = functools.partial(jax.tree.map, lambda x: x[None])
            return lead(grads), lead(synced), loss[None]

        self._fn = jax.jit(jax.shard_map(per_replica, mesh=self.mesh, in_specs=(P(), P(DATA)), out_specs=P(DATA)))

    def __call__(self, params: PyTree, batch: Batch, step: int = 0) -> GradSync:
        """``params``: host parameters, or a placed :class:`TrainState` of the strategy."""
        if isinstance(params, TrainState):
            params = self.strategy.unreplicate(params.params)
        check_divisible(batch, self.strategy.num_replicas)
        before, after, losses = jax.device_get(self._fn(params, batch))
        leaves = jax.tree_util.tree_flatten_with_path(before)[0]
        return GradSync(
            layers=tuple(path_label(p) for p, _ in leaves),
            before=tuple(np.asarray(x) for _, x in leaves),
            after=tuple(np.asarray(x) for x in jax.tree.leaves(after)),
            losses=np.asarray(losses),
            step=step,
        )


def trace_gradients(
    strategy: Strategy,
    loss_fn: LossFn,
    params: PyTree,
    tx: optax.GradientTransformation,
    batches: Iterable[Batch],
) -> list[GradSync]:
    """Train with ``strategy`` as usual, probing the gradients before each step (step numbers from 1).

    The strategy's own compiled step does the training; the probe runs beside it,
    so the parameters each probe sees are the ones that step trained from.
    """
    probe = GradientProbe(strategy, loss_fn)
    state, train = strategy.init(params, tx), strategy.step(loss_fn)
    syncs = []
    for i, batch in enumerate(batches, start=1):
        syncs.append(probe(strategy.unreplicate(state.params), batch, step=i))
        state, _ = train(state, batch)
    return syncs


@dataclass(frozen=True)
class _Transfer:
    """One chunk sent from ``src`` to its ring neighbour ``dst`` in one ring step."""

    src: int
    dst: int
    chunk: int
    values: np.ndarray


@dataclass(frozen=True)
class _RingStep:
    phase: str  # "reduce-scatter" (dst adds what it receives) or "all-gather" (dst keeps it)
    transfers: tuple[_Transfer, ...]
    buffers: np.ndarray  # [replicas, elements]: every replica's buffer after this step
    contributions: np.ndarray  # [replicas, chunks]: how many replicas' gradients each chunk holds


@dataclass(frozen=True)
class RingTrace:
    """A ring all-reduce of ``inputs`` (one row per replica), step by step."""

    inputs: np.ndarray  # [replicas, elements]
    bounds: tuple[int, ...]  # chunk c is elements bounds[c]:bounds[c+1]
    steps: tuple[_RingStep, ...]
    result: np.ndarray  # [replicas, elements]: the mean, on every replica

    def bytes_sent(self, itemsize: int = 4) -> np.ndarray:
        """``[replicas]``: bytes each replica sends; 2(n-1)/n of its gradient, whatever n is."""
        sent = np.zeros(len(self.inputs), dtype=np.int64)
        for step in self.steps:
            for t in step.transfers:
                sent[t.src] += t.values.size * itemsize
        return sent


def ring_allreduce_trace(inputs: np.ndarray) -> RingTrace:
    """Average ``inputs[i]`` (replica i's flattened gradient) over replicas with a ring.

    Each vector is cut into ``n`` chunks. Reduce-scatter: in each of ``n - 1`` steps,
    replica ``i`` sends one chunk to ``i + 1``, which adds it to its own; afterwards
    replica ``i`` holds the full sum of chunk ``i + 1``. All-gather: ``n - 1`` more steps
    pass the finished chunks around. Each replica sends ``2(n-1)/n`` of its gradient.
    """
    inputs = np.asarray(inputs, dtype=np.float64)
    n, size = inputs.shape
    bounds = tuple(int(b) for b in np.linspace(0, size, n + 1).round())
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(n)]
    buffers = inputs.copy()
    counts = np.ones((n, n), dtype=int)
    steps = []
    for phase in ("reduce-scatter", "all-gather"):
        for s in range(n - 1):
            # reduce-scatter step s: replica i sends chunk (i - s); all-gather: chunk (i + 1 - s)
            sends = [(i, (i - s + (phase == "all-gather")) % n) for i in range(n)]
            transfers = tuple(_Transfer(i, (i + 1) % n, c, buffers[i, chunk[c]].copy()) for i, c in sends)
            new, new_counts = buffers.copy(), counts.copy()
            for t in transfers:
                if phase == "reduce-scatter":
                    new[t.dst, chunk[t.chunk]] += t.values
                    new_counts[t.dst, t.chunk] += counts[t.src, t.chunk]
                else:
                    new[t.dst, chunk[t.chunk]] = t.values
                    new_counts[t.dst, t.chunk] = counts[t.src, t.chunk]
            buffers, counts = new, new_counts
            steps.append(_RingStep(phase, transfers, buffers.copy(), counts.copy()))
    return RingTrace(inputs, bounds, tuple(steps), buffers / n)


__getattr__ = renamed(__name__, {"ring_allreduce": f"{__name__}:ring_allreduce_trace"})  # a trace, not the all-reduce
