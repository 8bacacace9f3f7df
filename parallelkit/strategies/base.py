"""The base class of strategies (:class:`Strategy`): the protocol's defaults."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax

from ..core.devices import resolve_devices
from ..core.placement import LeafPlacement
from ..core.precision import Precision
from ..core.reports import ExpectedCollective, Sizes, StepTraffic
from ..core.state import TrainState
from ..core.step import Step
from ..core.types import Batch, LossFn, PyTree

# Where Explicit mode runs: the strategies whose step is one jax.jit over a mesh (pk.SPMD and its presets).
_EXPLICIT_STRATEGIES = (
    "pk.SPMD and its presets (SingleDevice, Mirrored with backend='jit', MultiWorkerMirrored, FullySharded, "
    "TensorParallel, Hybrid, ContextParallel, ExpertParallel)"
)


def refuse_explicit(who: str, explicit: object, why: str) -> None:
    """Accept ``explicit=False`` (Auto mode, the only one ``who`` runs); refuse anything else, saying ``why``.

    >>> refuse_explicit("CentralStorage", False, "its programs run on separate devices")
    >>> refuse_explicit("CentralStorage", True, "Its programs run on separate devices.")
    Traceback (most recent call last):
    ...
    ValueError: CentralStorage(explicit=True): Explicit mode is not supported here. Its programs run on separate ...

    Raises:
      ValueError: ``explicit=True`` (the sentence names the strategies that run Explicit mode), or not a bool.
    """
    if explicit is False:
        return
    if explicit is not True:
        raise ValueError(f"{who}(explicit={explicit!r}): explicit is a bool, and {who} runs only explicit=False.")
    raise ValueError(
        f"{who}(explicit=True): Explicit mode is not supported here. {why} Explicit mode runs in "
        f"{_EXPLICIT_STRATEGIES}: use one of those, or leave explicit=False."
    )


class Strategy(abc.ABC):
    """Base of every strategy: holds configuration (the devices), never training state.

    It keeps :class:`~parallelkit.core.protocol.StrategyProtocol`: a subclass writes
    ``init``, ``step`` and ``place_batch``, and inherits the rest.
    """

    def __init__(self, devices: int | Sequence[jax.Device] | None = None):
        self.devices = resolve_devices(devices)

    @property
    def num_replicas(self) -> int:
        """How many copies of the model compute on separate slices of the batch."""
        return len(self.devices)

    @abc.abstractmethod
    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState:
        """Place parameters and optimizer state (a given ``opt_state`` is checked and placed).

        ``model_state`` (BatchNorm statistics, from :func:`parallelkit.models.from_nnx`)
        and ``rng`` (a seed or key, for dropout) ride in the state when given.
        """

    @abc.abstractmethod
    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step:
        """Compile-once training step for ``loss_fn(params, batch) -> loss or (loss, aux)``.

        ``accumulate=K`` runs each replica's slice of the batch as ``K`` microbatches and
        synchronises the gradients once (:mod:`parallelkit.core.accumulate`), where the
        strategy can; 1 (the default) is one pass over the batch. ``precision`` (a
        :class:`~parallelkit.Precision`) runs the passes in its compute dtype with the gradients
        cast back before they meet, and scales the loss (:mod:`parallelkit.core.precision`),
        where the strategy can; None (the default): the parameters' own dtype.
        """

    @abc.abstractmethod
    def place_batch(self, batch: Batch) -> Any:
        """The global host batch, placed as this strategy's step takes it (see :func:`parallelkit.run.prefetch`)."""

    def unreplicate(self, tree: PyTree) -> PyTree:
        """One host (NumPy) copy of ``tree``."""
        return jax.device_get(tree)

    def logical_shape(self, leaf: jax.Array) -> tuple[int, ...]:
        return tuple(leaf.shape)

    def checkpoint_refusal(self) -> str | None:
        """Why a checkpoint of this strategy's state could not resume its run exactly (None: it can)."""
        return None

    # How it communicates, in the cost model's names (a key of pk.costmodel.PATTERNS): the catalog
    # names it for pk.costmodel.predict, StepTraffic.pattern carries it, and TopologyModel times the
    # patterns of pk.costmodel.TOPOLOGY.
    pattern = "single"

    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic:
        """The bytes one step moves (per replica), measured, beside this strategy's formulas.

        By default: the batch slice, and the collectives read from the compiled step set
        against :meth:`expected_collectives`. Strategies that move state between memories
        outside one program (central storage, parameter servers) measure those copies.
        It compiles (or pulls and computes once) but does not train: ``state`` is left as it is.
        """
        from ..measure.traffic import compiled_traffic  # loaded when asked: training needs no traffic accounting

        return compiled_traffic(self, loss_fn, state, batch)

    def expected_collectives(self, sizes: Sizes) -> Sequence[ExpectedCollective] | None:
        """The collectives one step needs by the book (None: no formula for this model).

        The default is none: one device, or devices that never talk to each other.
        """
        return ()

    def describe(self, state: PyTree) -> list[LeafPlacement]:
        """Where every leaf of ``state`` lives: devices, memory kind, partition spec, copies."""
        rows = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            shape = self.logical_shape(leaf)
            logical_bytes = int(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize
            per_device = max(s.data.nbytes for s in leaf.addressable_shards)
            on_devices = sum(s.data.nbytes for s in leaf.addressable_shards)
            sharding = leaf.sharding
            rows.append(
                LeafPlacement(
                    path=jax.tree_util.keystr(path),
                    shape=shape,
                    dtype=str(leaf.dtype),
                    devices=tuple(sorted(d.id for d in sharding.device_set)),
                    memory_kind=sharding.memory_kind,
                    spec=str(getattr(sharding, "spec", type(sharding).__name__)),
                    copies=on_devices // logical_bytes if logical_bytes else len(sharding.device_set),
                    bytes_per_device=per_device,
                )
            )
        return rows

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.num_replicas})"
