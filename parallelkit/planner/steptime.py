"""A layout's step time: every operation of a layer on its own, every collective on the cost model's links, the bubble.

Its assumptions, each with its source, are set out in ``docs/planner.md`` (under this module's name); the
coefficients are constants of the code, each with its source beside it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from ..core.types import is_number
from ..measure.costmodel import axis_seconds
from ..measure.hardware import PUBLISHED
from .cluster import Cluster
from .kernels import Passes, compute_seconds, optimizer_seconds
from .layout import Layout
from .memory import ELEMENT_BYTES
from .model import ModelShape

OVERLAP = ("none", "full")  # presets: nothing hides; the gradients hide ("full" is HIDEABLE's first)
HIDEABLE = ("gradients", "tensor", "context", "experts")  # the families that can hide, each behind its window
ATTENTION = ("flash", "unfused")
# The share of a link's datasheet bandwidth a collective reaches, inside a machine (NVLink, ICI) and across machines
# (the network): calculon's A100 and H100 system files ("networks" "efficiency": 0.65 and 0.9), for every chip of
# hardware.PUBLISHED (a measured cluster's links are what they measured). Isaev et al. set them beside the same
# Korthikanti et al. runs this planner is checked on: not an independent measurement.
LINK_SHARE = {"inside": 0.65, "network": 0.9}
_MESH_ORDER = ("tensor", "expert", "context", "data", "stages")  # innermost first


@dataclass(frozen=True)
class StepTime:
    """One step's predicted seconds, by what takes them.

    ``compute`` is the useful work with recomputation, ``bubble`` the pipeline's idle share,
    ``communication`` each collective family's seconds (before overlap), and ``exposed`` what of each family
    is on the critical path (the rest hides behind compute, :func:`exposed_seconds`).
    """

    compute: float
    bubble: float
    communication: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)
    efficiency: float = 0.0  # the share of the peak the compute ran at

    @property
    def total(self) -> float:
        return self.compute + self.bubble + sum(self.exposed.values())

    @property
    def hidden(self) -> dict[str, float]:
        """Each family's seconds hidden behind compute."""
        return {name: seconds - self.exposed[name] for name, seconds in self.communication.items()}

    @property
    def exposed_gradients(self) -> float:
        return self.exposed.get("gradients", 0.0)

    @property
    def binding(self) -> str:
        """What takes the most time: ``"compute"``, ``"bubble"`` or a collective family (its exposed seconds)."""
        parts = {"compute": self.compute, "bubble": self.bubble, **self.exposed}
        return max(parts, key=parts.get)


def hidden_families(overlap: str | Collection[str]) -> tuple[str, ...]:
    """The collective families ``overlap`` lets hide: ``"none"``, ``"full"`` (the gradients: what every framework
    overlaps by default) or a collection of :data:`HIDEABLE` names.

    >>> hidden_families("full"), hidden_families(("tensor", "gradients"))
    (('gradients',), ('gradients', 'tensor'))
    """
    if isinstance(overlap, str):
        if overlap in OVERLAP:
            return () if overlap == "none" else ("gradients",)
    elif isinstance(overlap, Collection) and all(isinstance(name, str) and name in HIDEABLE for name in overlap):
        return tuple(name for name in HIDEABLE if name in overlap)
    raise ValueError(f"overlap={overlap!r} is not an overlap the planner times: give one of {OVERLAP} or a "
                     f"collection of the families that hide, from {HIDEABLE}.")  # fmt: skip


def bubble_share(layout: Layout, passes: Passes | None = None) -> float:
    """The pipeline's idle time over its compute: ``(stages - 1) / microbatches`` (GPipe, 1F1B), over ``virtual``
    under interleaved 1F1B, ``(F + B - W) / (F + B + W)`` of it under ZB-H1; 0 without a pipeline.

    GPipe and 1F1B idle for ``stages - 1`` microbatches' forward and backward passes; interleaved 1F1B for as
    many chunks' passes, each ``1 / virtual`` of a stage's; ZB-H1 for ``(stages - 1) (F + B - W)`` (Qi et al.,
    "Zero Bubble Pipeline Parallelism", 2023, section 3.1: its deferred weight passes ``W`` fill the rest) with
    ``passes``' forward ``F``, backward ``B`` (recomputation in it) and weight ``W`` seconds; a third when the
    passes are equal (``passes`` None).

    >>> bubble_share(Layout(stages=4, microbatches=8)), bubble_share(Layout(stages=4, microbatches=8, schedule="zb-h1"))
    (0.375, 0.125)
    >>> bubble_share(Layout(stages=4, microbatches=8, schedule="interleaved", virtual=3))
    0.125
    """
    share = (layout.stages - 1) / (layout.microbatches * layout.virtual)
    if layout.schedule != "zb-h1":
        return share
    if passes is None:
        return share / 3
    return share * (passes.forward + passes.backward - passes.weight) / passes.total


def strides(layout: Layout) -> dict[str, int]:
    """How many devices apart neighbours along each axis are (:data:`_MESH_ORDER`, innermost first)."""
    out, stride = {}, 1
    for axis in _MESH_ORDER:
        out[axis] = stride
        stride *= getattr(layout, axis)
    return out


def step_time(
    model: ModelShape,
    layout: Layout,
    cluster: Cluster,
    batch: int,
    *,
    precision: str = "bf16",
    efficiency: float | None = None,
    overlap: str | Collection[str] = "none",
    attention: str = "flash",
) -> StepTime:
    """Predict one step of ``layout`` training ``model`` on ``batch`` sequences over ``cluster`` (module's assumptions).

    ``efficiency``: None for each operation's own time (:func:`layer_passes`), or the share of the peak every FLOP
    reaches. ``overlap``: what communication may hide behind compute (:func:`hidden_families`). ``attention``:
    ``"flash"`` (one fused kernel: the scores never reach memory) or ``"unfused"`` (the scores written, softmax and
    dropout passes over them: Megatron-LM before FlashAttention).

    >>> from parallelkit.planner import MODELS
    >>> one = Cluster.published("H100 SXM", per_node=1)
    >>> t = step_time(MODELS["llama3-8b"], Layout(), one, batch=1, efficiency=0.5)
    >>> t.total == MODELS["llama3-8b"].flops_per_token() * 8192 / (0.5 * 989.5e12), t.binding
    (True, 'compute')
    >>> round(step_time(MODELS["llama3-8b"], Layout(), one, batch=1).efficiency, 3)  # each operation's own time
    0.601
    """
    hides = hidden_families(overlap)
    if efficiency is not None and not (is_number(efficiency) and 0 < efficiency <= 1):
        raise ValueError(f"efficiency={efficiency!r}: the share of the peak compute reaches, in (0, 1], or None for "
                         "each operation's own time (steptime.layer_passes).")  # fmt: skip
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not an attention kernel the planner times: give one of "
                         f"{ATTENTION}.")  # fmt: skip
    if layout.devices != cluster.devices:
        raise ValueError(f"{layout.name} uses {layout.devices} devices; the cluster has {cluster.devices}.")
    cluster.peak_flops(precision)  # a precision the planner knows, and a chip that has its peak, or a clear error
    # the optimizer's step, in the compute when each operation is timed: nothing hides behind it (the parameters
    # it updates are what ZeRO-3 gathers next)
    update = optimizer_seconds(model, layout, cluster, precision) if efficiency is None else 0.0
    compute, passes, efficiency = compute_seconds(model, layout, cluster, batch, precision, efficiency, attention)
    bubble = compute * bubble_share(layout, passes)
    micro = batch // (layout.replicas * layout.microbatches)
    comm = communication_seconds(model, layout, cluster, micro, ELEMENT_BYTES[precision])
    exposed = exposed_seconds(comm, hides, layout, math.ceil(model.layers / layout.stages), passes, compute - update)
    return StepTime(compute, bubble, comm, exposed, efficiency)


@functools.lru_cache(maxsize=256)
def achieved(cluster: Cluster) -> Cluster:
    """``cluster`` with the bandwidths its collectives reach: a datasheet's (a chip of ``hardware.PUBLISHED``) at
    :data:`LINK_SHARE`, a measured cluster's as measured."""
    if cluster.chip not in PUBLISHED:
        return cluster
    inside = replace(cluster.inside, GBps=cluster.inside.GBps * LINK_SHARE["inside"])
    network = cluster.network and replace(cluster.network, GBps=cluster.network.GBps * LINK_SHARE["network"])
    return replace(cluster, inside=inside, network=network)


def communication_seconds(model: ModelShape, layout: Layout, cluster: Cluster, micro: int, e: int) -> dict:
    """Each collective family's seconds in one step, before any hides (the module's assumptions)."""
    datasheet, cluster = cluster, achieved(cluster)
    apart, m, stages = strides(layout), layout.microbatches, layout.stages
    tokens = micro * model.seq // layout.context  # one microbatch's tokens on one device
    activation = tokens * model.d_model * e
    layers = math.ceil(model.layers / stages)
    refwd = layout.recompute == "full"

    def along(axis: str, nbytes: float, collective: str) -> float:
        return _axis_seconds(cluster, getattr(layout, axis), apart[axis], nbytes, collective)

    comm: dict[str, float] = {}
    if layout.tensor > 1:
        comm["tensor"] = layers * m * (6 if refwd else 4) * along("tensor", activation, "all-reduce")
        if layout.sequence_parallel:  # the backward pass gathers the two products' inputs again
            comm["tensor"] += layers * m * 2 * along("tensor", activation, "all-gather")
        comm["tensor"] += m * vocabulary_ends(layout, tokens, activation, along)
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
    if stages > 1:  # each tensor rank sends its share (module's assumptions: Megatron-LM's scatter/gather)
        slots = 2 * (layout.virtual * m + stages - 1)
        comm["pipeline"] = slots * along("stages", activation / layout.tensor, "permute")
        if layout.tensor > 1 and not layout.sequence_parallel:  # the receiving stage gathers the whole activation
            comm["pipeline"] += slots * along("tensor", activation, "all-gather")
    if grads := gradient_seconds(model, layout, datasheet, e):  # it takes the link share once itself
        comm["gradients"] = grads
    return comm


def vocabulary_ends(layout: Layout, tokens: int, activation: float, along: Callable[[str, float, str], float]) -> float:
    """One microbatch's seconds of the vocabulary-parallel ends' collectives over ``tensor`` (Megatron-LM's
    ``VocabParallelEmbedding``, ``parallel_lm_logits`` and ``vocab_parallel_cross_entropy``): the output layer's
    input gathered forward and its gradient reduced backward (an all-reduce's time, with sequence parallelism or
    without), the loss's three all-reduces of a float a token (the logits' maximum, the target's logit, the sum of
    the exponentials), and without a pipeline the embedding's output reduced forward (its gradient gathered
    backward under sequence parallelism) on the same device; with one, the embedding is on the first stage and the
    output layer on the last, and only the last's are counted."""
    seconds = along("tensor", activation, "all-reduce") + 3 * along("tensor", tokens * 4, "all-reduce")
    if layout.stages == 1:
        seconds += along("tensor", activation, "all-reduce")
    return seconds


@functools.lru_cache(maxsize=65536)  # layouts of one mesh repeat their collectives
def _axis_seconds(cluster: Cluster, size: int, stride: int, nbytes: float, collective: str) -> float:
    return axis_seconds(cluster, size, stride, nbytes, collective)


def exposed_seconds(
    comm: dict[str, float], hides: Sequence[str], layout: Layout, layers: int, passes: Passes, compute: float
) -> dict[str, float]:
    """What of each family's seconds is on the critical path, each hidden family behind its window of compute:

    - ``"gradients"`` behind the backward passes they follow: ZeRO 0 and 1 reduce once, after the last
      microbatch's backward pass begins (its ``layers`` backward and weight passes); ZeRO-2 reduce-scatters behind
      every microbatch's backward; ZeRO-3 gathers behind the previous layer's work, forward and backward (the
      whole ``compute`` it is given: :func:`step_time` leaves the optimizer's step out). The last layer's share
      (``1 / layers``) is always exposed: nothing follows it.
    - ``"tensor"`` (async tensor parallelism) behind the linear layers' products;
    - ``"context"`` behind the attention's products (the ring's permutes behind each block's);
    - ``"experts"`` behind the other microbatch's compute (DualPipe's pairing): the whole ``compute``.

    Families not in ``hides``, and the pipeline's sends, are exposed whole.
    """
    m = layout.microbatches
    window = {
        "gradients": {0: layers * (passes.backward + passes.weight), 1: layers * (passes.backward + passes.weight),
                      2: layers * m * (passes.backward + passes.weight), 3: compute}[layout.zero],
        "tensor": layers * m * passes.products,
        "context": layers * m * passes.core,
        "experts": compute,
    }  # fmt: skip
    out = {}
    for name, seconds in comm.items():
        if name not in hides:
            out[name] = seconds
        else:
            floor = seconds / layers if name == "gradients" else 0.0
            out[name] = max(seconds - window[name], floor)
    return out


def gradient_seconds(model: ModelShape, layout: Layout, cluster: Cluster, element_bytes: int) -> float:
    """The gradients' (and ZeRO-3's parameters') collectives over the axes where the same parameters repeat.

    The dense parameters repeat over ``expert x context x data`` (contiguous in :data:`_MESH_ORDER`,
    neighbours ``tensor`` apart); the experts' over ``context x data``. ZeRO-1 keeps whole gradients: an
    all-reduce, then an all-gather of the updated shards (the kit's ``Parallel(zero=1)`` compiles to both);
    ZeRO-2 reduce-scatters each microbatch's gradients; ZeRO-3 also gathers the parameters twice a microbatch.
    """
    apart, cluster = strides(layout), achieved(cluster)
    experts = model.routed_params
    split = layout.tensor * layout.stages
    held = [((model.params - experts) / split, layout.expert * layout.context * layout.data, apart["expert"])]
    if experts:
        held.append((experts / (split * layout.expert), layout.context * layout.data, apart["context"]))
    m, total = layout.microbatches, 0.0
    for params, size, stride in held:
        nbytes = params * element_bytes
        reduce = _axis_seconds(cluster, size, stride, nbytes, "all-reduce")
        half = _axis_seconds(cluster, size, stride, nbytes, "all-gather")
        total += {0: reduce, 1: reduce + half, 2: m * half + half, 3: 3 * m * half}[layout.zero]
    return total
