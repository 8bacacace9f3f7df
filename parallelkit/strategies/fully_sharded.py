"""Fully sharded data parallelism (ZeRO stages 1-3, PyTorch FSDP): split the state over the data axis.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import PartitionSpec as P

from ..core import partition
from ..core.devices import resolve_devices
from ..core.reports import ExpectedCollective, Sizes, gradient_all_reduce
from ..core.types import DATA, PyTree
from .parallel import Parallel
from .spmd import EXPLICIT

STAGES = (1, 2, 3)


class FullySharded(Parallel):
    """ZeRO stage 1, 2 or 3 over all devices (the ``data`` axis); equal to SingleDevice.

    Conceptually, for stage 3 with ``n`` devices and a global batch ``b``::

        params = all_gather(shard_i(params))                       # before use
        grads_i = grad(loss_fn)(params, b[i * len(b) // n : (i + 1) * len(b) // n])
        shard_i(grads) = reduce_scatter(mean over i of grads_i)    # each keeps its shard
        shard_i(params), shard_i(opt) = update(shard_i(params), shard_i(grads), shard_i(opt))

    Args:
      stage: 1 (optimizer state sharded), 2 (and gradients), 3 (and parameters).
      devices: how many devices (the first ``n``), or which; all by default.
      min_size: leaves with fewer elements stay replicated
        (:data:`parallelkit.core.partition.MIN_SHARD_SIZE` by default).
      explicit: a mesh of Explicit axes: each shard is its array's type. Stage 3 gathers each parameter
        with ``jax.sharding.reshard`` where the loss uses it (the backward pass's transpose of that reshard is
        the gradients' reduce-scatter); stages 1 and 2 update in the optimizer state's layout, then gather
        the new parameters.

    Raises:
      ValueError: a stage other than 1, 2 or 3, or a ``min_size`` below 1.
    """

    def __init__(
        self,
        stage: int = 3,
        devices: int | Sequence[jax.Device] | None = None,
        *,
        min_size: int = partition.MIN_SHARD_SIZE,
        explicit: bool = False,
    ):
        if stage not in STAGES or isinstance(stage, bool):
            raise ValueError(
                f"FullySharded(stage={stage!r}): ZeRO has stages 1 (optimizer state sharded), "
                "2 (and gradients) and 3 (and parameters); choose one of 1, 2, 3."
            )
        devices = resolve_devices(devices)
        super().__init__(len(devices), zero=stage, min_size=min_size, devices=devices, explicit=explicit)
        self.stage = stage

    def sharded_specs(self, params: PyTree) -> PyTree:
        """Each leaf's spec when sharded (stage 3's parameters; every stage's optimizer state)."""
        return self.zero_specs(params)

    pattern = "fully_sharded"

    def expected_collectives(self, sizes: Sizes) -> tuple[ExpectedCollective, ...]:
        """ZeRO's collectives by the book, payloads per device (``S``: bytes of the sharded leaves).

        Stage 1: an all-reduce of every gradient (and the metrics), and an all-gather of the
        updated shards when the optimizer keeps per-parameter state (momentum, Adam: each
        device then updates only its shard); with a stateless one (SGD) every device
        updates its whole copy and nothing is gathered. Stages 2 and 3: a reduce-scatter of
        the sharded leaves' gradients (``S/n`` each device keeps), an all-reduce of the rest,
        an all-gather of ``S`` (stage 3 gathers the parameters before use; XLA may gather or
        reshuffle more, which the measured payloads show).
        """
        n = sizes.replicas
        if n == 1:
            return ()
        specs = jax.tree.leaves(self.sharded_specs(sizes.params_tree), is_leaf=lambda x: isinstance(x, P))
        leaves = jax.tree.leaves(sizes.params_tree)
        sharded = sum(x.nbytes for x, spec in zip(leaves, specs, strict=True) if DATA in spec)
        gather = ExpectedCollective("all-gather", "parameter shards", sharded, "S")
        if self.stage == 1:
            reduce = gradient_all_reduce(sizes)
            return (reduce, gather) if sizes.optimizer >= sharded else (reduce,)
        rest = sizes.params - sharded + sizes.metrics
        return (
            ExpectedCollective("reduce-scatter", "gradient shards", sharded / n, "S/n"),
            ExpectedCollective("all-reduce", "small gradients and metrics", rest, "P - S + M"),
            gather,
        )

    def __repr__(self) -> str:
        return f"FullySharded(stage={self.stage}, devices={self.num_replicas}{EXPLICIT if self.explicit else ''})"


def zero_state_bytes(stage: int, param_bytes: float, optimizer_bytes: float, n: int) -> dict[str, float]:
    """Bytes per device of parameters, gradients and optimizer state by the ZeRO paper's accounting.

    Stage 0 is mirrored training (everything whole on every device); each stage divides
    one more of them by ``n``: 1 the optimizer state, 2 also the gradients, 3 also the
    parameters. ``param_bytes`` sizes the gradients too (they have the parameters' shapes
    and dtypes).

    Per parameter, the paper counts mixed-precision Adam: float16 weights and gradients,
    2 + 2 bytes, and K = 12 bytes of optimizer state (a float32 copy of the weights, the
    momentum and the variance). Adam on the kit's float32 models is 4 + 4 + 8 bytes.
    Both make 16 bytes a parameter, but the stages divide different parts of them:

    >>> zero_state_bytes(1, 4, 8, n=8)  # float32 Adam, ZeRO-1 on 8 devices: 9 bytes a parameter
    {'parameters': 4, 'gradients': 4, 'optimizer': 1.0}
    >>> zero_state_bytes(1, 2, 12, n=8)  # mixed precision: 5.5
    {'parameters': 2, 'gradients': 2, 'optimizer': 1.5}
    >>> zero_state_bytes(3, 400, 800, 4)
    {'parameters': 100.0, 'gradients': 100.0, 'optimizer': 200.0}
    """
    if stage not in (0, *STAGES):
        raise ValueError(f"stage={stage!r}: ZeRO stages are 0 (none, mirrored) to 3.")
    return {
        "parameters": param_bytes / n if stage >= 3 else param_bytes,
        "gradients": param_bytes / n if stage >= 2 else param_bytes,
        "optimizer": optimizer_bytes / n if stage >= 1 else optimizer_bytes,
    }
