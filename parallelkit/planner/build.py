"""A layout as the kit's strategy: which layouts the kit can run, and the strategy that runs each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from ..core.devices import resolve_devices
from ..core.protocol import StrategyProtocol
from ..models.recompute import RECOMPUTE
from ..strategies import Mirrored, Parallel, SingleDevice
from ..strategies.pipeline import Pipeline


def unsupported(layout: Any) -> str | None:
    """Why the kit has no strategy for ``layout``; None when it has one."""
    if layout.recompute not in RECOMPUTE:
        return (
            f"its transformers recompute {', '.join(RECOMPUTE)}, not {layout.recompute!r} (torchtitan's op-level "
            "recomputation, which the planner only counts and times): choose 'selective' or 'full' to build it"
        )
    if layout.stages > 1 and layout.expert > 1:
        return "the kit's MoE GPT is not a list of layers (its blocks return the router's aux), so it has no pipeline"
    return None


def stage_axes(layout: Any) -> dict[str, Any]:
    """The :class:`~parallelkit.Parallel` keywords of each of ``layout``'s pipeline stages (the pipeline runs a
    stage that splits over nothing but data, and recomputes nothing, as its plain one)."""
    return dict(tensor=layout.tensor, sequence_parallel=layout.sequence_parallel, context=layout.context,
                context_method=layout.context_method, expert=layout.expert, zero=layout.zero,
                recompute=layout.recompute)  # fmt: skip


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
        return Pipeline(layers, layout.stages, layout.microbatches, layout.schedule, virtual=layout.virtual,
                        data=layout.data, stage_axes=stage_axes(layout), devices=devices)  # fmt: skip
    if layout.devices == layout.data and not layout.zero and layout.recompute == "none":
        return Mirrored(devices)
    return Parallel(
        layout.data,
        zero=layout.zero,
        tensor=layout.tensor,
        sequence_parallel=layout.sequence_parallel,
        context=layout.context,
        context_method=layout.context_method,
        expert=layout.expert,
        recompute=layout.recompute,
        devices=devices,
    )
