"""The narrow protocol every strategy keeps (:class:`StrategyProtocol`): every method and attribute the tools call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import optax

from .placement import LeafPlacement
from .reports import ExpectedCollective, Sizes, StepTraffic
from .state import TrainState
from .types import Batch, LossFn, PyTree

if TYPE_CHECKING:
    from .precision import Precision
    from .step import Step


@runtime_checkable
class StrategyProtocol(Protocol):
    """Every method and attribute the tools call on a strategy.

    - ``devices``, ``num_replicas``: the devices it uses, and how many slices the global batch is cut into;
    - ``init(params, tx, opt_state=None, *, model_state=None, rng=None)``: a placed :class:`TrainState`;
    - ``step(loss_fn, accumulate=1, precision=None)``: a compiled :class:`Step`, ``state, metrics = step(state, batch)``
      (``accumulate=K``: ``K`` microbatches, the gradients synchronised once, where the strategy can;
      ``precision``: a :class:`~parallelkit.core.precision.Precision` policy, where the strategy can);
    - ``place_batch(batch)``: the global host batch, placed as the step takes it;
    - ``unreplicate(tree)``: one host copy; ``logical_shape(leaf)``: a leaf's single-device shape;
    - ``describe(state)``: where every leaf lives;
    - ``traffic(loss_fn, state, batch)``, ``expected_collectives(sizes)``: the bytes one step moves and
      the collectives its formulas expect;
    - ``pattern``: how it communicates, in the cost model's names (a key of ``pk.costmodel.PATTERNS``,
      by which :func:`~parallelkit.measure.costmodel.predict` and
      :class:`~parallelkit.measure.costmodel.TopologyModel` time it);
    - ``checkpoint_refusal()``: why a checkpoint could not resume its run exactly (None: it can).
    """

    devices: Sequence[jax.Device]
    pattern: str

    @property
    def num_replicas(self) -> int: ...

    def init(
        self,
        params: PyTree,
        tx: optax.GradientTransformation,
        opt_state: PyTree = None,
        *,
        model_state: PyTree = None,
        rng: int | jax.Array | None = None,
    ) -> TrainState: ...

    def step(self, loss_fn: LossFn, accumulate: int = 1, precision: Precision | None = None) -> Step: ...

    def place_batch(self, batch: Batch) -> Any: ...

    def unreplicate(self, tree: PyTree) -> PyTree: ...

    def logical_shape(self, leaf: jax.Array) -> tuple[int, ...]: ...

    def describe(self, state: PyTree) -> list[LeafPlacement]: ...

    def traffic(self, loss_fn: LossFn, state: TrainState, batch: Batch) -> StepTraffic: ...

    def expected_collectives(self, sizes: Sizes) -> Sequence[ExpectedCollective] | None: ...

    def checkpoint_refusal(self) -> str | None: ...
