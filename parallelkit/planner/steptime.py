"""A layout's step time: compute on its products' roofline, every collective on the cost model's links, the bubble.

The assumptions, all of them (each a parameter or a line here):

- **Compute** is the model's training FLOPs (:meth:`.model.ModelShape.flops_per_token`: ``6 N``
  plus attention, the count of the MFU figures) spread evenly over the devices, at the
  efficiency of one layer's matrix products on one device (:func:`matmul_efficiency`), or at
  ``efficiency`` of one device's peak (:meth:`.cluster.Cluster.peak_flops`) when a number is
  given. Recomputation adds its forward pass: the whole layer's (``2 N`` a token more) under
  ``"full"``, the attention scores' under ``"selective"``.
- **A matrix product** of ``m x k`` by ``k x n`` takes the longer of its FLOPs, ``2 m k n``, at
  :data:`ACHIEVABLE` of the peak (S. Bekman's measured best over shapes: 80.3 % on an H100,
  86.9 % on an A100; other chips take the H100's), and its bytes, ``(m k + k n + m n)``
  elements, at the device's memory bandwidth (the peak and the bandwidth: the datasheets of
  :data:`parallelkit.measure.hardware.PUBLISHED`): a roofline (:func:`matmul_seconds`; FLOPs
  alone where the cluster has no bandwidth). The products of a layer, forward, for one microbatch on one device: the
  query, key and value projection, the attention's output projection, the MLP's up (and gate)
  and down projections (each routed expert's, over the tokens routed to it), split over
  ``tensor`` as Megatron splits them, on the microbatch's tokens (over ``context``); and the
  attention's two products per head (queries by keys, scores by values: FlashAttention's).
  Their backward passes (``dX = dY W^T``, ``dW = X^T dY``) are the same three sizes in another
  order, so they take as long. The model's other FLOPs (the embedding, norms, the softmax) run at
  the products' efficiency.
- **FP8** (``precision="fp8"``), as Transformer Engine runs it: each linear layer's matrix product
  at the chip's dense FP8 peak (:attr:`.cluster.Cluster.fp8_flops`; a chip without one refuses
  it), at the same achievable share as bf16's (an assumption: the measured shares are bf16's),
  reading 1-byte inputs and writing a bf16 output; the attention's products stay in bf16 at the
  bf16 peak (FP8 attention is an option of the recipes, off by default); and the scaling's cost:
  before each FP8 product its two inputs are quantized in a pass of their own over the memory,
  :data:`FP8_CAST_BYTES` bytes an element (delayed scaling reads the bf16 tensor once and writes
  its FP8 copy; current scaling reads it twice, one more for its amax: Transformer Engine's
  "FP8 Delayed Scaling" page). Everything else (norms, activations, communication, the stored
  activations) is bf16's. MFU under ``"fp8"`` is against the FP8 peak.
- **The other operations** (norms, activations, dropout, residual additions) move, at the
  memory's bandwidth, the arrays Korthikanti et al. count a layer keeps (without the attention's
  scores: a fused attention never writes them): written forward, read and their gradients
  written backward, written again by a recomputed forward (:func:`_elementwise_seconds`).
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
  forward and backward slots (``2 (v m + s - 1)`` under interleaved 1F1B: each microbatch crosses
  ``v`` times as many stage boundaries); the bubble makes compute ``(m + s - 1) / m`` times longer
  (GPipe, 1F1B), ``(v m + s - 1) / (v m)`` under interleaved 1F1B with ``v`` chunks a stage
  (Narayanan et al., 2021, section 2.2.2), ``(3m + s - 1) / 3m`` under ZB-H1 (a third of the idle
  time, forward, backward and weight passes taken as equal; its price is memory, :mod:`.memory`).
- **Gradients** (data, context and expert axes, where the same parameters repeat): an all-reduce
  (ZeRO 0, 1: a reduce-scatter and an all-gather, the same time) once a step, in the
  training precision; ZeRO-2 reduce-scatters each microbatch's and all-gathers once; ZeRO-3
  gathers the parameters before each microbatch's forward and backward and reduce-scatters its
  gradients. ``overlap="full"`` hides them behind compute (a step takes the longer of the two),
  ``"none"`` adds them; every other collective is on the critical path.
- The optimizer update and the input pipeline cost nothing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..core.types import is_number
from ..measure.costmodel import axis_seconds
from .cluster import Cluster
from .layout import Layout
from .memory import ELEMENT_BYTES, layer_activation_bytes
from .model import ModelShape

OVERLAP = ("none", "full")
# The share of the peak a large matrix product reaches: the best of a brute-force search over shapes of BF16 matmuls
# (S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table": H100 SXM 794.5 of 989 TFLOP/s, A100 SXM 271.2 of 312). A chip this dict does not hold (the TPUs,
# the B200) takes the H100's share, and FP8 products the bf16 share of the FP8 peak: assumptions.
ACHIEVABLE = {"H100 SXM": 794.5 / 989, "A100 SXM 80GB": 271.2 / 312}
_ACHIEVABLE_ELSE = ACHIEVABLE["H100 SXM"]
# FP8's scaling cost, bytes per element of a product's input: Transformer Engine's default delayed scaling reads the
# bf16 tensor once (2 bytes) and writes its FP8 copy (1 byte); its current scaling reads it once more for the amax
# (https://nvidia.github.io/TransformerEngine/features/low_precision_training/fp8_delayed_scaling/fp8_delayed_scaling.html).
FP8_CAST_BYTES = 2 + 1
_MESH_ORDER = ("tensor", "expert", "context", "data", "stages")  # innermost first


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
    efficiency: float = 0.0  # the share of the peak the compute ran at

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
    """The pipeline's idle time over its compute: ``(stages - 1) / microbatches`` (GPipe, 1F1B), over ``virtual``
    under interleaved 1F1B, a third of it under ZB-H1; 0 without a pipeline.

    GPipe and 1F1B idle for ``stages - 1`` microbatches' forward and backward passes; interleaved 1F1B for as
    many chunks' passes, each ``1 / virtual`` of a stage's; ZB-H1 only for their forward passes (its weight
    passes fill the rest), for passes of equal length.

    >>> bubble_share(Layout(stages=4, microbatches=8)), bubble_share(Layout(stages=4, microbatches=8, schedule="zb-h1"))
    (0.375, 0.125)
    >>> bubble_share(Layout(stages=4, microbatches=8, schedule="interleaved", virtual=3))
    0.125
    """
    share = (layout.stages - 1) / (layout.microbatches * layout.virtual)
    return share / 3 if layout.schedule == "zb-h1" else share


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
    overlap: str = "none",
) -> StepTime:
    """Predict one step of ``layout`` training ``model`` on ``batch`` sequences over ``cluster`` (module's assumptions).

    ``efficiency``: None for each matrix product's own (:func:`matmul_efficiency`), or the share of the peak
    every FLOP reaches.

    >>> from parallelkit.planner import MODELS
    >>> one = Cluster.published("H100 SXM", per_node=1)
    >>> t = step_time(MODELS["llama3-8b"], Layout(), one, batch=1, efficiency=0.5)
    >>> t.total == MODELS["llama3-8b"].flops_per_token() * 8192 / (0.5 * 989.5e12), t.binding
    (True, 'compute')
    >>> round(step_time(MODELS["llama3-8b"], Layout(), one, batch=1).efficiency, 3)  # roofline, other operations
    0.629
    """
    if overlap not in OVERLAP:
        raise ValueError(f"overlap={overlap!r}: one of {OVERLAP}.")
    if efficiency is not None and not (is_number(efficiency) and 0 < efficiency <= 1):
        raise ValueError(f"efficiency={efficiency!r}: the share of the peak compute reaches, in (0, 1], or None for "
                         "each matrix product's own (steptime.matmul_efficiency).")  # fmt: skip
    if layout.devices != cluster.devices:
        raise ValueError(f"{layout.name} uses {layout.devices} devices; the cluster has {cluster.devices}.")
    cluster.peak_flops(precision)  # a precision the planner knows, and a chip that has its peak, or a clear error
    e = ELEMENT_BYTES[precision]
    m, stages = layout.microbatches, layout.stages
    per_token = model.flops_per_token()
    attention = per_token - 6 * model.active_params
    extra = {"none": 0.0, "selective": attention / 3, "full": per_token / 3}[layout.recompute]
    flops = (per_token + extra) * batch * model.seq / layout.devices  # one device's
    if efficiency is None:
        micro = batch // (layout.replicas * m)
        products = flops / (matmul_efficiency(model, layout, cluster, micro, precision) * cluster.peak_flops(precision))
        compute = products + _elementwise_seconds(model, layout, cluster, micro, precision)
        efficiency = flops / (compute * cluster.peak_flops(precision))
    else:
        compute = flops / (efficiency * cluster.peak_flops(precision))
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
        comm["pipeline"] = 2 * (layout.virtual * m + stages - 1) * along("stages", sent, "permute")
    grads = gradient_seconds(model, layout, cluster, e)
    if grads:
        comm["gradients"] = grads
    exposed = max(grads - compute, 0.0) if overlap == "full" else grads
    return StepTime(compute, bubble, comm, exposed, efficiency)


def matmul_seconds(m: float, k: float, n: float, cluster: Cluster, precision: str) -> float:
    """One ``m x k`` by ``k x n`` product on one device: the longer of its FLOPs at :data:`ACHIEVABLE` of the peak
    and its bytes at the memory's bandwidth (FLOPs alone where ``cluster.hbm_bytes_per_s`` is None). Under ``"fp8"``
    its inputs are 1 byte an element and its output bf16, and quantizing the inputs first adds
    :data:`FP8_CAST_BYTES` an input element at the memory's bandwidth.

    >>> h100 = Cluster.published("H100 SXM", per_node=1)
    >>> big, thin = matmul_seconds(8192, 8192, 8192, h100, "bf16"), matmul_seconds(8192, 8192, 16, h100, "bf16")
    >>> round(2 * 8192**3 / big / 989.5e12, 3), round(2 * 8192**2 * 16 / thin / 989.5e12, 3)  # share of the peak
    (0.803, 0.054)
    >>> fp8 = matmul_seconds(8192, 8192, 8192, h100, "fp8")  # FP8's peak, less the quantization of the inputs
    >>> round(2 * 8192**3 / fp8 / 1979e12, 3)
    0.684
    """
    flops = 2 * m * k * n / (ACHIEVABLE.get(cluster.chip, _ACHIEVABLE_ELSE) * cluster.peak_flops(precision))
    if cluster.hbm_bytes_per_s is None:
        return flops
    if precision != "fp8":
        return max(flops, ELEMENT_BYTES[precision] * (m * k + k * n + m * n) / cluster.hbm_bytes_per_s)
    inputs = m * k + k * n  # quantized to 1 byte each by a pass of their own, then read by the product
    cast = FP8_CAST_BYTES * inputs / cluster.hbm_bytes_per_s
    return cast + max(flops, (inputs + ELEMENT_BYTES["bf16"] * m * n) / cluster.hbm_bytes_per_s)


def _elementwise_seconds(model: ModelShape, layout: Layout, cluster: Cluster, micro: int, precision: str) -> float:
    """What the operations besides the matrix products take on one device in one step: the arrays Korthikanti et
    al. count a layer keeps (:func:`.memory.layer_activation_bytes` without the attention's scores, which a fused
    attention never writes) written once by the forward pass and read once and their gradients written once by the
    backward pass, once more written by a recomputed forward pass, at the memory's bandwidth, for every layer of the
    device's stage and every microbatch; 0 where the cluster has no bandwidth.

    >>> h100 = Cluster.published("H100 SXM", per_node=1)
    >>> from parallelkit.planner import MODELS, layer_activation_bytes
    >>> seconds = _elementwise_seconds(MODELS["llama3-8b"], Layout(), h100, 1, "bf16")
    >>> seconds == 32 * 3 * layer_activation_bytes(MODELS["llama3-8b"], 1, recompute="selective") / 3.35e12
    True
    """
    if cluster.hbm_bytes_per_s is None:
        return 0.0
    arrays = layer_activation_bytes(model, micro, tensor=layout.tensor, sequence_parallel=layout.sequence_parallel,
                                    context=layout.context, context_method=layout.context_method,
                                    recompute="selective", element_bytes=ELEMENT_BYTES[precision])  # fmt: skip
    passes = 3 if layout.recompute == "none" else 4
    layers = math.ceil(model.layers / layout.stages)
    return layers * layout.microbatches * passes * arrays / cluster.hbm_bytes_per_s


def matmul_efficiency(model: ModelShape, layout: Layout, cluster: Cluster, micro: int, precision: str) -> float:
    """The share of one device's peak that one layer's matrix products reach on a microbatch of ``micro`` sequences:
    their FLOPs over the peak times their time (:func:`matmul_seconds`), shapes as the module's assumptions say."""
    ulysses = layout.context_method == "ulysses" and layout.context > 1
    return _matmul_efficiency(model, cluster, precision, layout.tensor, layout.context, ulysses, layout.expert, micro)


@functools.lru_cache(maxsize=65536)  # the planner asks for the same shapes for many layouts
def _matmul_efficiency(
    model: ModelShape, cluster: Cluster, precision: str, t: int, context: int, ulysses: bool, expert: int, micro: int
) -> float:
    h, f = model.d_model, model.ffn
    tokens = micro * model.seq / context
    kv = model.kv_heads_ * model.head_dim
    products = [(tokens, h, (h + 2 * kv) / t, 1), (tokens, h / t, h, 1)]  # (m, k, n, how many)
    if model.experts:  # each of the device's experts on the tokens routed to it
        routed = max(tokens * model.top_k * expert / model.experts, 1.0)
        local = model.experts / expert
        products += [(routed, h, (2 if model.gated else 1) * f / t, local), (routed, f / t, h, local)]
    else:
        products += [(tokens, h, (2 if model.gated else 1) * f / t, 1), (tokens, f / t, h, 1)]
    heads = model.heads / t
    if ulysses:  # every token of a share of the heads
        queries, heads = micro * model.seq, heads / context
    else:  # the device's queries against every key
        queries = tokens
    keys = micro * model.seq
    per_sequence = [(queries / micro, model.head_dim, keys / micro, 2 * heads * micro)]  # scores, then values
    flops = sum(2 * m * k * n * count for m, k, n, count in products + per_sequence)
    attention = "bf16" if precision == "fp8" else precision  # FP8 recipes keep the attention's products in bf16
    seconds = sum(matmul_seconds(m, k, n, cluster, precision) * count for m, k, n, count in products)
    seconds += sum(matmul_seconds(m, k, n, cluster, attention) * count for m, k, n, count in per_sequence)
    return flops / (seconds * cluster.peak_flops(precision))


def gradient_seconds(model: ModelShape, layout: Layout, cluster: Cluster, element_bytes: int) -> float:
    """The gradients' (and ZeRO-3's parameters') collectives over the axes where the same parameters repeat.

    The dense parameters repeat over ``expert x context x data`` (contiguous in :data:`_MESH_ORDER`,
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
