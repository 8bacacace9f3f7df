"""A layout (:class:`Layout`): how a training step is cut over devices, and the memory it needs on each."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.types import is_count
from .build import kit_strategy
from .memory import (
    CONTEXT_METHODS,
    ELEMENT_BYTES,
    OP_LEVEL,
    PLANNED_RECOMPUTE,
    SCHEDULES,
    STATE_BYTES,
    Memory,
    backward_working_bytes,
    gathered_bytes,
    in_flight,
    is_zero_stage,
    layer_activation_bytes,
    loss_bytes,
    state_bytes,
    weight_pass_bytes,
    weight_passes_pending,
)
from .model import ModelShape

_REBUILT = ("full", OP_LEVEL)  # recomputations that rebuild a layer's arrays in its backward pass


@dataclass(frozen=True)
class Layout:
    """Sizes of the axes a step is split over, and what each device runs.

    Args:
      data: replicas: each takes ``1 / (data x expert)`` of the batch's sequences.
      zero: ZeRO stage over the devices that hold the same parameters (``expert x context x data``
        for the dense ones, ``context x data`` for the experts'): 1 splits
        the optimizer state, 2 the gradients too, 3 the parameters too (fully sharded).
      tensor: devices each weight is split over (Megatron); ``sequence_parallel`` splits the
        activations between the blocks over them too.
      context: devices each sequence is split over, by ``context_method``.
      stages: pipeline stages; ``schedule`` and ``microbatches`` run them (without a pipeline,
        ``microbatches > 1`` is gradient accumulation).
      virtual: chunks of layers each stage holds under ``schedule="interleaved"`` (Megatron-LM's
        interleaved 1F1B, the kit's ``pk.Pipeline(..., schedule="interleaved", virtual=)``): 2 or more
        there, 1 under every other schedule.
      expert: devices the experts are split over (MoE models); they take a share of the batch too.
      recompute: ``"none"``, ``"selective"`` (attention's scores, as FlashAttention does), ``"full"``, or
        ``"op"``: torchtitan's op-level selective recomputation (:data:`.memory.OP_LEVEL`), which the planner
        counts and times and the kit does not build.

    >>> Layout(data=2, tensor=4).devices, Layout(data=2, tensor=4).name
    (8, 'data 2 x tensor 4')
    """

    data: int = 1
    zero: int = 0
    tensor: int = 1
    sequence_parallel: bool = False
    context: int = 1
    context_method: str = "ring"
    stages: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    expert: int = 1
    recompute: str = "none"
    virtual: int = 1

    def __post_init__(self) -> None:
        for axis in ("data", "tensor", "context", "stages", "microbatches", "expert", "virtual"):
            value = getattr(self, axis)
            if not (type(value) is int and value >= 1 or is_count(value)):  # the common case first: the planner's
                raise ValueError(f"Layout({axis}={value!r}): a whole number >= 1.")
        if not (type(self.zero) is int and 0 <= self.zero <= 3 or is_zero_stage(self.zero)):
            raise ValueError(f"Layout(zero={self.zero!r}) is not a ZeRO stage: give 0 (none), 1 (the optimizer "
                             "state split), 2 (the gradients too) or 3 (the parameters too).")  # fmt: skip
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"Layout(sequence_parallel={self.sequence_parallel!r}) is not a bool: give True or False.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Layout(schedule={self.schedule!r}): one of {SCHEDULES}.")
        if self.recompute not in PLANNED_RECOMPUTE:
            raise ValueError(f"Layout(recompute={self.recompute!r}): one of {PLANNED_RECOMPUTE}.")
        if self.context_method not in CONTEXT_METHODS:
            raise ValueError(f"Layout(context_method={self.context_method!r}): one of {CONTEXT_METHODS}.")
        if (self.schedule == "interleaved") != (self.virtual > 1):
            raise ValueError(f"Layout(schedule={self.schedule!r}, virtual={self.virtual}): virtual chunks a stage "
                             "are interleaved 1F1B's: give schedule='interleaved' with virtual >= 2, or another "
                             "schedule with virtual=1.")  # fmt: skip
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("Layout(sequence_parallel=True) splits the tokens over the tensor axis: give tensor > 1.")

    @property
    def devices(self) -> int:
        return self.data * self.expert * self.tensor * self.context * self.stages

    @property
    def accumulate(self) -> int:
        """Gradient accumulation steps: the microbatches, when there is no pipeline to run them."""
        return self.microbatches if self.stages == 1 else 1

    def strategy(self, *, layers: Sequence[Callable] | None = None, devices: int | Sequence[Any] | None = None):
        """The kit's strategy for this layout (:func:`.build.kit_strategy`); step it with ``accumulate=accumulate``.

        ``devices``: exactly :attr:`devices` of them (the first ones by default).

        Raises:
          ValueError: a layout the kit has no strategy for (:func:`.build.unsupported` says why), or
            devices that are not as many as the layout's axes multiply to.
        """
        return kit_strategy(self, layers=layers, devices=devices)

    @property
    def replicas(self) -> int:
        """How many slices the batch's sequences are cut into."""
        return self.data * self.expert

    @property
    def name(self) -> str:
        """The axes larger than 1, and what else is on: ``'data 2 x tensor 4 (SP), ZeRO-3, remat full'``."""
        axes = [(n, getattr(self, n)) for n in ("data", "expert", "context", "tensor", "stages")]
        shown = " x ".join(f"{n} {s}" for n, s in axes if s > 1) or "one device"
        extras = [f"ZeRO-{self.zero}"] if self.zero else []
        if self.sequence_parallel:
            shown += " (SP)"
        if self.context > 1:
            extras.append(self.context_method)
        if self.stages > 1:
            chunks = f" v={self.virtual}" if self.virtual > 1 else ""
            extras.append(f"{self.schedule}{chunks} m={self.microbatches}")
        elif self.microbatches > 1:
            extras.append(f"accumulate {self.microbatches}")
        if self.recompute != "none":
            extras.append(f"remat {self.recompute}")
        return ", ".join([shown, *extras])


def check(model: ModelShape, layout: Layout, batch: int) -> str | None:
    """Why ``layout`` cannot train ``model`` on a global batch of ``batch`` sequences; None when it can."""
    if batch % (layout.replicas * layout.microbatches):
        return (f"the batch of {batch} sequences does not split into {layout.replicas} replicas x "
                f"{layout.microbatches} microbatches")  # fmt: skip
    if model.heads % layout.tensor or model.kv_heads_ % layout.tensor or model.ffn % layout.tensor:
        return f"tensor={layout.tensor} does not divide the heads ({model.heads}), kv heads or the MLP width"
    if model.seq % layout.context or (layout.sequence_parallel and model.seq % (layout.context * layout.tensor)):
        return f"the {model.seq} tokens do not split over context x tensor"
    if layout.context_method == "ulysses" and model.heads % (layout.context * layout.tensor):
        return f"Ulysses needs heads ({model.heads}) divisible by context x tensor"
    if layout.stages > model.layers:
        return f"{layout.stages} stages for {model.layers} layers"
    if layout.virtual > 1 and (model.layers % (layout.stages * layout.virtual) or layout.microbatches % layout.stages):
        return (f"interleaved 1F1B (Megatron-LM's) needs the {model.layers} layers in stages x virtual = "
                f"{layout.stages * layout.virtual} equal chunks and microbatches ({layout.microbatches}) a multiple "
                f"of the {layout.stages} stages")  # fmt: skip
    if layout.expert > 1 and (not model.experts or model.experts % layout.expert):
        return f"expert={layout.expert} does not divide the model's {model.experts} experts"
    return None


@dataclass(frozen=True)
class Activations:
    """The activations of the device :func:`memory_per_device` counts, part by part."""

    layers: int  # the layers its stage holds
    in_flight: float  # the microbatches whose activations it holds at once (a fraction: interleaved chunks)
    micro: int  # sequences a microbatch
    per_layer: float  # one layer of one microbatch (memory.layer_activation_bytes)
    rebuilt: float  # full recomputation: the one layer rebuilt in the backward pass (0 otherwise)
    logits: float  # the most the last stage's loss holds at once (memory.loss_bytes; 0 on another stage)
    last_stage: bool  # whether the device counted is the last stage (with the logits) rather than the first
    pending: int = 0  # ZB-H1's weight passes deferred at once (memory.weight_passes_pending)
    per_pending: float = 0.0  # what one layer's deferred weight pass keeps besides (memory.weight_pass_bytes)

    @property
    def total(self) -> float:
        """The layers' activations (and deferred weight passes' gradients), without the logits."""
        return self.layers * (self.in_flight * self.per_layer + self.pending * self.per_pending) + self.rebuilt


def activations(
    model: ModelShape, layout: Layout, batch: int, *, precision: str = "bf16", fused: bool = False,
    loss: str = "in_place",
) -> Activations:  # fmt: skip
    """The activations of the device that holds the most: the first pipeline stage's, or the last's with the logits.

    One layer's (:func:`.memory.layer_activation_bytes`) for a microbatch of ``batch / (replicas
    x microbatches)`` sequences, times the layers of a stage, times the microbatches in flight on
    that stage (:func:`.memory.in_flight`), and under full (or op-level) recomputation one layer more, rebuilt
    in the backward pass with its attention computed block by block (FlashAttention: no ``s x s``
    scores). Under ZB-H1 each weight pass a stage defers keeps its outputs' gradients too
    (:func:`.memory.weight_pass_bytes`, :func:`.memory.weight_passes_pending`). The last stage also
    holds the loss's peak over one microbatch's logits (:func:`.memory.loss_bytes` of ``loss``, one of
    :data:`.memory.LOSSES`). The first stages hold
    ``ceil(layers / stages)`` layers each, the last what is left. ``fused``: a program compiled whole
    (:func:`.memory.layer_activation_bytes`).
    """
    micro = batch // (layout.replicas * layout.microbatches)
    split = (layout.tensor, layout.sequence_parallel, layout.context, layout.context_method, ELEMENT_BYTES[precision])
    per_layer = _layer_bytes(model, micro, *split, layout.recompute, fused)
    rebuilt = _layer_bytes(model, micro, *split, "selective", fused) if layout.recompute in _REBUILT else 0.0
    logits = loss_bytes(model, micro, tensor=layout.tensor, context=layout.context, loss=loss,
                        element_bytes=ELEMENT_BYTES[precision], fused=fused)  # fmt: skip
    stage_layers = math.ceil(model.layers / layout.stages)
    if layout.stages == 1:  # one stage: the first is the last
        return Activations(model.layers, 1, micro, per_layer, rebuilt, logits, True)
    pending = _pending_bytes(model, micro, *split[:3], split[4])
    pipeline = (layout.schedule, layout.stages, layout.microbatches)
    first = Activations(stage_layers, in_flight(*pipeline, virtual=layout.virtual), micro, per_layer, rebuilt, 0.0,
                        False, weight_passes_pending(*pipeline), pending)  # fmt: skip
    last_layers = max(model.layers - (layout.stages - 1) * stage_layers, 0)
    held = in_flight(*pipeline, stage=layout.stages - 1, virtual=layout.virtual)
    deferred = weight_passes_pending(*pipeline, stage=layout.stages - 1)
    last = Activations(last_layers, held, micro, per_layer, rebuilt, logits, True, deferred, pending)
    return first if first.total >= last.total + last.logits else last


@functools.lru_cache(maxsize=65536)  # the planner counts the same layer for many layouts and microbatch counts
def _layer_bytes(model: ModelShape, micro: int, tensor: int, sequence_parallel: bool, context: int,
                 context_method: str, element_bytes: int, recompute: str, fused: bool) -> float:  # fmt: skip
    """:func:`.memory.layer_activation_bytes`, remembered."""
    return layer_activation_bytes(model, micro, tensor=tensor, sequence_parallel=sequence_parallel, context=context,
                                  context_method=context_method, recompute=recompute, element_bytes=element_bytes,
                                  fused=fused)  # fmt: skip


@functools.lru_cache(maxsize=65536)
def _pending_bytes(model: ModelShape, micro: int, tensor: int, sequence_parallel: bool, context: int,
                   element_bytes: int) -> float:  # fmt: skip
    """:func:`.memory.weight_pass_bytes`, remembered."""
    return weight_pass_bytes(model, micro, tensor=tensor, sequence_parallel=sequence_parallel, context=context,
                             element_bytes=element_bytes)  # fmt: skip


@functools.lru_cache(maxsize=65536)  # one layout's state whatever its microbatches, recomputation or schedule
def device_state(model: ModelShape, split: int, expert: int, context: int, data: int, zero: int, precision: str,
                 optimizer: str) -> tuple[float, float, float]:  # fmt: skip
    """The (parameters, gradients, optimizer state) bytes of one device: :func:`memory_per_device`'s state."""
    experts = model.routed_params
    kinds = {"zero": zero, "precision": precision, "optimizer": optimizer}
    dense = state_bytes((model.params - experts) / split, data=expert * context * data, **kinds)
    routed = state_bytes(experts / (split * expert), data=context * data, **kinds)
    return tuple(a + b for a, b in zip(dense, routed, strict=True))


def memory_per_device(
    model: ModelShape,
    layout: Layout,
    batch: int,
    *,
    precision: str = "bf16",
    optimizer: str = "adam",
    fused: bool = False,
    loss: str = "in_place",
) -> Memory:
    """The bytes one device holds while ``layout`` trains ``model`` on ``batch`` sequences a step.

    The state: the parameters over ``tensor x stages`` (the experts' over ``expert`` too), then
    ZeRO over the devices that hold the same slice (:func:`.memory.state_bytes`): ``expert x
    context x data`` for the dense parameters, ``context x data`` for the experts'. The
    activations: :func:`activations`. The parameters are split evenly over the stages. ``fused``: count
    for a program compiled whole, as the kit's steps are (the :mod:`.memory` module's "A fused program": what a
    layer keeps, one layer's backward pass in ``buffers``, gradients and activations apart, the float32 logits
    kept, ZeRO-3's gathers left to the compiler), with attention that is not fused, as the kit's (a FlashAttention
    kernel holds no ``s x s`` arrays, which this count does not model); by default, Korthikanti et al.'s accounting
    of an unfused framework, with ZeRO-3's gathered parameters at the peak (:func:`.memory.gathered_bytes`) and
    the cross-entropy ``loss`` it runs (:data:`.memory.LOSSES`: Megatron-LM's ``"in_place"``, PyTorch's
    ``"eager"``; :func:`.memory.loss_bytes`).

    Raises:
      ValueError: the layout cannot run the model on this batch (:func:`check` says why).
      TypeError: ``fused`` that is not a bool.
      ValueError: a ``loss`` not in :data:`.memory.LOSSES` (:func:`.memory.bytes_a_logit` says so).
    """
    if not isinstance(fused, bool):
        raise TypeError(f"memory_per_device got fused={fused!r}, which is not a bool. Pass True to count a program "
                        "compiled whole (the kit's steps), False for Korthikanti et al.'s accounting.")  # fmt: skip
    if reason := check(model, layout, batch):
        raise ValueError(f"{layout.name} cannot train {model.name or 'this model'}: {reason}.")
    split = layout.tensor * layout.stages
    params, grads, opt = device_state(model, split, layout.expert, layout.context, layout.data, layout.zero,
                                      precision, optimizer)  # fmt: skip
    act = activations(model, layout, batch, precision=precision, fused=fused, loss=loss)
    working = backward_working_bytes(model, act.micro, tensor=layout.tensor, context=layout.context,
                                     context_method=layout.context_method, fused=fused)  # fmt: skip
    if fused:  # the layer rebuilt by full recomputation is held while its backward pass runs, as the working set
        return Memory(params, grads, opt, act.total - act.rebuilt, act.logits, working + act.rebuilt, True)
    sharded = layout.zero == 3 and layout.expert * layout.context * layout.data > 1
    gathered = gathered_bytes(model, tensor=layout.tensor, expert=layout.expert, stages=layout.stages,
                              param_bytes=STATE_BYTES[precision, optimizer][0]) if sharded else 0.0  # fmt: skip
    return Memory(params, grads, opt, act.total, act.logits, working, gathered=gathered)
