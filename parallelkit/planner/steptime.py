"""A layout's step time: compute at a stated efficiency, every collective on the cost model's links, the bubble.

The assumptions, all of them (each a parameter or a line here):

- **Compute** is the model's training FLOPs (:meth:`.model.Transformer.flops_per_token`: ``6 N``
  plus attention, the count of the MFU figures) spread evenly over the devices, at
  ``efficiency`` of one device's peak (:meth:`.cluster.Cluster.peak_flops`). Recomputation
  adds its forward pass: the whole layer's (``2 N`` a token more) under ``"full"``, the
  attention scores' under ``"selective"``. Splitting a matrix product over more devices does
  not lower ``efficiency`` here, though on real devices small products run further from the peak.
- **The mesh**: ``tensor`` is the innermost axis (neighbouring devices), then ``expert``,
  ``context``, ``data``, and ``stages`` outermost, so tensor groups stay inside a machine
  whenever they fit in one. Each collective is timed by the cost model along its axis
  (:func:`parallelkit.measure.costmodel.axis_seconds`), all groups at once.
- **Tensor** parallelism (Megatron): 2 all-reduces of a microbatch's activations per layer
  forward and 2 backward (with sequence parallelism each is a reduce-scatter and an all-gather:
  the same time), 2 more with full recomputation. The embedding's and the loss's FLOPs are spread
  like the rest; their own communication is not counted.
- **Context** parallelism: per layer, keys and values travel ``context - 1`` steps forward and
  their gradients ``context - 1`` back (the ring by permutes, all-gather by gathering and
  reduce-scattering: the same bytes); Ulysses: 4 all-to-alls forward (q, k, v, the output) and 4
  backward. Full recomputation repeats the forward ones.
- **Experts**: 2 all-to-alls of the routed tokens (``top_k`` copies) forward, 2 backward, 2 more
  with full recomputation.
- **Pipeline**: one send of a microbatch's activation after each of the ``2 (m + s - 1)``
  forward and backward slots; the bubble makes compute ``(m + s - 1) / m`` times longer (GPipe,
  1F1B), ``(3m + s - 1) / 3m`` under ZB-H1 (a third of the idle time, forward, backward and
  weight passes taken as equal).
- **Gradients** (data, context and expert axes, where the same parameters repeat): an all-reduce
  (ZeRO 0, 1: a reduce-scatter and an all-gather, the same time) once a step, in the
  training precision; ZeRO-2 reduce-scatters each microbatch's and all-gathers once; ZeRO-3
  gathers the parameters before each microbatch's forward and backward and reduce-scatters its
  gradients. ``overlap="full"`` hides them behind compute (a step takes the longer of the two),
  ``"none"`` adds them; every other collective is on the critical path.
- The optimizer update and the input pipeline cost nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..measure.costmodel import axis_seconds
from .cluster import Cluster
from .layout import Layout
from .memory import ELEMENT_BYTES
from .model import Transformer

OVERLAP = ("none", "full")
MESH_ORDER = ("tensor", "expert", "context", "data", "stages")  # innermost first


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds, by what takes them.

    ``compute`` is the useful work with recomputation, ``bubble`` the pipeline's idle share,
    ``communication`` each collective family's seconds (``"gradients"`` before overlap), and
    ``exposed_gradients`` what of the gradients' is not hidden.
    """

    compute: float
    bubble: float
    communication: dict[str, float] = field(default_factory=dict)
    exposed_gradients: float = 0.0

    @property
    def total(self) -> float:
        critical = sum(s for name, s in self.communication.items() if name != "gradients")
        return self.compute + self.bubble + critical + self.exposed_gradients

    @property
    def binding(self) -> str:
        """What takes the most time: ``"compute"``, ``"bubble"`` or a collective family."""
        parts = {"compute": self.compute, "bubble": self.bubble, **self.communication}
        parts["gradients"] = self.exposed_gradients
        return max(parts, key=parts.get)


def bubble_share(layout: Layout) -> float:
    """The pipeline's idle time over its compute: ``(stages - 1) / microbatches`` (GPipe, 1F1B), a third of it
    under ZB-H1; 0 without a pipeline.

    GPipe and 1F1B idle for ``stages - 1`` microbatches' forward and backward passes; ZB-H1 only for their
    forward passes (its weight passes fill the rest), for passes of equal length.

    >>> bubble_share(Layout(stages=4, microbatches=8)), bubble_share(Layout(stages=4, microbatches=8, schedule="zb-h1"))
    (0.375, 0.125)
    """
    share = (layout.stages - 1) / layout.microbatches
    return share / 3 if layout.schedule == "zb-h1" else share


def strides(layout: Layout) -> dict[str, int]:
    """How many devices apart neighbours along each axis are (:data:`MESH_ORDER`, innermost first)."""
    out, stride = {}, 1
    for axis in MESH_ORDER:
        out[axis] = stride
        stride *= getattr(layout, axis)
    return out


def step_time(
    model: Transformer,
    layout: Layout,
    cluster: Cluster,
    batch: int,
    *,
    precision: str = "bf16",
    efficiency: float = 0.5,
    overlap: str = "none",
) -> StepTime:
    """Predict one step of ``layout`` training ``model`` on ``batch`` sequences over ``cluster`` (module's assumptions).

    >>> from parallelkit.planner import MODELS
    >>> one = Cluster.published("H100 SXM", per_node=1)
    >>> t = step_time(MODELS["llama3-8b"], Layout(), one, batch=1)
    >>> t.total == MODELS["llama3-8b"].flops_per_token() * 8192 / (0.5 * 989.5e12), t.binding
    (True, 'compute')
    """
    if overlap not in OVERLAP:
        raise ValueError(f"overlap={overlap!r}: one of {OVERLAP}.")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r}: the share of the peak compute reaches, in (0, 1].")
    if layout.devices != cluster.devices:
        raise ValueError(f"{layout.name} uses {layout.devices} devices; the cluster has {cluster.devices}.")
    e = ELEMENT_BYTES[precision]
    m, stages = layout.microbatches, layout.stages
    per_token = model.flops_per_token()
    attention = per_token - 6 * model.active_params
    extra = {"none": 0.0, "selective": attention / 3, "full": per_token / 3}[layout.recompute]
    compute = (per_token + extra) * batch * model.seq / (layout.devices * efficiency * cluster.peak_flops(precision))
    bubble = compute * bubble_share(layout)

    apart = strides(layout)
    micro = batch // (layout.replicas * m)
    tokens = micro * model.seq // layout.context  # one microbatch's tokens on one device
    activation = tokens * model.d_model * e
    layers = math.ceil(model.layers / stages)
    refwd = layout.recompute == "full"

    def along(axis: str, nbytes: float, collective: str) -> float:
        return axis_seconds(cluster, getattr(layout, axis), apart[axis], nbytes, collective)

    comm: dict[str, float] = {}
    if layout.tensor > 1:
        comm["tensor"] = layers * m * (6 if refwd else 4) * along("tensor", activation, "all-reduce")
    if layout.context > 1:
        kv = 2 * tokens * model.kv_heads_ * model.head_dim * e / layout.tensor  # K and V
        if layout.context_method == "ulysses":  # q and the output, k and v: one all-to-all each
            one_way = 2 * along("context", activation / layout.tensor, "all-to-all")
            one_way += 2 * along("context", kv / 2, "all-to-all")
        else:
            one_way = (layout.context - 1) * along("context", kv, "permute")
        comm["context"] = layers * m * one_way * (3 if refwd else 2)
    if layout.expert > 1:
        routed = activation * model.top_k
        comm["experts"] = layers * m * (6 if refwd else 4) * along("expert", routed, "all-to-all")
    if stages > 1:
        sent = activation / (layout.tensor if layout.sequence_parallel else 1)
        comm["pipeline"] = 2 * (m + stages - 1) * along("stages", sent, "permute")
    grads = gradient_seconds(model, layout, cluster, e)
    if grads:
        comm["gradients"] = grads
    exposed = max(grads - compute, 0.0) if overlap == "full" else grads
    return StepTime(compute, bubble, comm, exposed)


def gradient_seconds(model: Transformer, layout: Layout, cluster: Cluster, element_bytes: int) -> float:
    """The gradients' (and ZeRO-3's parameters') collectives over the axes where the same parameters repeat.

    The dense parameters repeat over ``expert x context x data`` (contiguous in :data:`MESH_ORDER`,
    neighbours ``tensor`` apart); the experts' over ``context x data``.
    """
    apart = strides(layout)
    experts = model.routed_params
    split = layout.tensor * layout.stages
    held = [((model.params - experts) / split, layout.expert * layout.context * layout.data, apart["expert"])]
    if experts:
        held.append((experts / (split * layout.expert), layout.context * layout.data, apart["context"]))
    m, total = layout.microbatches, 0.0
    for params, size, stride in held:
        nbytes = params * element_bytes
        reduce = axis_seconds(cluster, size, stride, nbytes, "all-reduce")
        half = axis_seconds(cluster, size, stride, nbytes, "all-gather")
        total += {0: reduce, 1: reduce, 2: m * half + half, 3: 3 * m * half}[layout.zero]
    return total
