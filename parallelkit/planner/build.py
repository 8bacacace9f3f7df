"""A layout as the kit's strategy: which layouts the kit can run, and the strategy that runs each.

The kit runs one family of axes at a time beside ``data``: ``tensor`` (with sequence
parallelism, and ZeRO-3 over ``data``: :class:`~parallelkit.Hybrid`), ``context``
(:class:`~parallelkit.ContextParallel`), ``stages`` (:class:`~parallelkit.Pipeline`) or
``expert`` (:class:`~parallelkit.ExpertParallel`); ``data`` alone with any ZeRO stage
(:class:`~parallelkit.Mirrored`, :class:`~parallelkit.FullySharded`). Accumulation is the
step's (``strategy.step(loss_fn, accumulate=layout.accumulate)``). Recomputation belongs to the
model, not to a strategy (:func:`parallelkit.models.remat`), so a layout that recomputes is
planned but not built here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..core.devices import resolve_devices
from ..core.protocol import StrategyProtocol
from ..strategies import (
    ContextParallel,
    ExpertParallel,
    FullySharded,
    Hybrid,
    Mirrored,
    SingleDevice,
    TensorParallel,
)
from ..strategies.pipeline import Pipeline

MODEL_AXES = ("tensor", "context", "stages", "expert")


def unsupported(layout: Any) -> str | None:
    """Why the kit has no strategy for ``layout``; None when it has one."""
    used = [axis for axis in MODEL_AXES if getattr(layout, axis) > 1]
    if len(used) > 1:
        return f"the kit splits one of {', '.join(MODEL_AXES)} beside data at a time, not {' and '.join(used)}"
    if layout.recompute != "none":
        return "recomputation is the model's choice (pk.models.remat), not a strategy's"
    if layout.zero and used and not (used == ["tensor"] and layout.zero == 3):
        return f"ZeRO-{layout.zero} runs over data alone (or ZeRO-3 beside tensor, as Hybrid(shard_data=True))"
    return None


def kit_strategy(
    layout: Any, *, layers: Sequence[Callable] | None = None, devices: int | Sequence[jax.Device] | None = None
) -> StrategyProtocol:
    """The kit's strategy for ``layout`` on ``devices`` (the first ``layout.devices`` by default).

    ``layers``: the model's layers (``pk.models.as_layers(model).apply``), for a pipeline.
    ``devices``: exactly ``layout.devices`` of them, or that count (the first ones).

    Raises:
      ValueError: a layout the kit cannot run (:func:`unsupported` says why), too few devices,
        devices given that are not as many as the layout's axes multiply to, or a pipeline
        without its layers.
    """
    if reason := unsupported(layout):
        raise ValueError(f"{layout.name}: the kit has no strategy for it: {reason}.")
    if devices is None:
        if len(jax.devices()) < layout.devices:
            raise ValueError(
                f"{layout.name} needs {layout.devices} devices; JAX has {len(jax.devices())}. "
                f"Call pk.simulate_devices({layout.devices}) before JAX starts to try it on a CPU."
            )
        devices = jax.devices()[: layout.devices]
    devices = resolve_devices(devices)
    if len(devices) != layout.devices:
        raise ValueError(
            f"{layout.name} runs on {layout.devices} devices, but devices holds {len(devices)}. "
            f"Pass exactly {layout.devices} (devices[:{layout.devices}]), or a layout whose axes multiply to "
            f"{len(devices)}."
        )
    if layout.devices == 1:
        return SingleDevice(devices[0])
    if layout.stages > 1:
        if layers is None:
            raise ValueError(f"{layout.name} is a pipeline: pass layers=pk.models.as_layers(model).apply.")
        return Pipeline(layers, layout.stages, layout.microbatches, layout.schedule, data=layout.data, devices=devices)
    if layout.expert > 1:
        return ExpertParallel(layout.expert, layout.data, devices=devices)
    if layout.context > 1:
        return ContextParallel(layout.context, layout.context_method, layout.data, devices=devices)
    if layout.tensor > 1:
        if layout.data == 1:
            return TensorParallel(layout.tensor, sequence_parallel=layout.sequence_parallel, devices=devices)
        return Hybrid(layout.data, layout.tensor, shard_data=layout.zero == 3,
                      sequence_parallel=layout.sequence_parallel, devices=devices)  # fmt: skip
    return FullySharded(layout.zero, devices) if layout.zero else Mirrored(devices)
