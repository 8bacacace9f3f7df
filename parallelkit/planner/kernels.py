"""One device's compute in a step: each operation of a layer as one kernel, its FLOPs and its bytes.

The compute half of :mod:`.steptime`'s model (whose docstring lists every assumption once); the coefficients
below, each with its source.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from .cluster import Cluster
from .layout import Layout, device_state
from .memory import ELEMENT_BYTES, OP_LEVEL, STATE_BYTES, op_level_recomputed
from .model import ModelShape

# ---- The table of assumptions: every coefficient of the compute model, each with its source. ----
# The share of the peak a large matrix product reaches: the best of a brute-force search over shapes of BF16 matmuls
# (S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table": H100 SXM 794.5 of 989 TFLOP/s, A100 SXM 271.2 of 312). A chip this dict does not hold (the TPUs,
# the B200, the H800, the H100 NVL, the MI300X) takes the H100's share, and FP8 products the bf16 share of the FP8
# peak: assumptions.
ACHIEVABLE = {"H100 SXM": 794.5 / 989, "A100 SXM 80GB": 271.2 / 312}
_ACHIEVABLE_ELSE = ACHIEVABLE["H100 SXM"]
# The share of the peak a product reaches by its size, (at least this many FLOPs in one kernel, share), largest
# first: calculon's curve for the A100 and the H100 (calculon-ai/calculon systems/a100_80g.json and
# h100_80g_nvl8.json, "matrix" "gflops_efficiency", the same on both; Isaev et al., "Calculon", SC23), capped by
# ACHIEVABLE. Taken for every chip: an assumption beyond those two.
MATMUL_SHARE = ((128e9, 0.95), (16e9, 0.90), (1e9, 0.60), (0.0, 0.10))
# The share of the memory's bandwidth one kernel reaches by the bytes it moves, (at least, share): calculon's
# (the same files, "mem1" "MB_efficiency"), for every chip: an assumption beyond those two.
MEMORY_SHARE = ((100e6, 0.90), (10e6, 0.75), (1e6, 0.60), (0.0, 0.30))
# FP8's scaling cost, bytes per element of a product's input: Transformer Engine's default delayed scaling reads the
# bf16 tensor once (2 bytes) and writes its FP8 copy (1 byte); its current scaling reads it once more for the amax
# (https://nvidia.github.io/TransformerEngine/features/low_precision_training/fp8_delayed_scaling/fp8_delayed_scaling.html).
FP8_CAST_BYTES = 2 + 1
# The optimizer's step, as Megatron-LM's mixed-precision optimizer runs it (megatron/core/optimizer/optimizer.py,
# Float16OptimizerWithFloat16Params.step, with apex's FusedAdam), each pass one kernel over the state a device holds,
# in bytes moved a parameter: the 16-bit gradient copied to float32 (read 2, write 4), the gradients' norm for
# clipping (read 4), Adam (read the gradient, the float32 master, m and v; write the last three), the master copied
# to the 16-bit parameter (read 4, write 2), the 16-bit gradient zeroed for the next step (write 2). fp16's
# unscaling and the clip's scaling (only when the norm passes the limit) are not counted. Under "fp32" (no master,
# no copies): the norm, Adam and the zeroing. Adam's passes are timed whatever optimizer the memory counts.
_MIXED_PASSES = (2 + 4, 4, 16 + 12, 4 + 2, 2)  # bf16's, and fp8's (its state is bf16's: memory.STATE_BYTES)
OPTIMIZER_PASSES = {"bf16": _MIXED_PASSES, "fp8": _MIXED_PASSES, "fp32": (4, 28, 4)}
# FlashAttention-2's backward pass runs five matrix products to its forward's two (it recomputes the scores):
# Dao, "FlashAttention-2", 2023, section 3.1 (Algorithms 1 and 2). An unfused backward runs four.
FLASH_BACKWARD = 5 / 2


@dataclass(frozen=True)
class Passes:
    """One layer's seconds for one microbatch on one device, by pass (:func:`layer_passes`).

    ``forward``; ``backward``: the activations' gradients and any recomputed forward pass; ``weight``: the
    weights' gradients (ZB-H1 defers them); of all three, ``products``: the linear layers' matrix products (async
    tensor parallelism hides its collectives behind them) and ``core``: the attention's (the ring hides its
    permutes behind them).
    """

    forward: float
    backward: float
    weight: float
    products: float = 0.0
    core: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.weight


def compute_seconds(
    model: ModelShape, layout: Layout, cluster: Cluster, batch: int, precision: str, efficiency: float | None,
    attention: str,
) -> tuple[float, Passes, float]:  # fmt: skip
    """One device's compute seconds in a step (:func:`step_time`'s), one layer's :class:`Passes` for a microbatch,
    and the share of the peak the compute ran at."""
    peak = cluster.peak_flops(precision)
    m, stages = layout.microbatches, layout.stages
    micro = batch // (layout.replicas * m)
    layers = math.ceil(model.layers / stages)
    per_token = model.flops_per_token()
    attention_flops = per_token - 6 * model.active_params
    if layout.recompute == OP_LEVEL:  # the products it did not keep, forward once more
        extra = model.layers * sum(2 * p.inner * p.outer * p.copies(model) for p in op_level_recomputed(model))
    else:
        extra = {"none": 0.0, "selective": attention_flops / 3, "full": per_token / 3}[layout.recompute]
    flops = (per_token + extra) * batch * model.seq / layout.devices  # one device's
    if efficiency is not None:
        compute = flops / (efficiency * peak)
        passes = _even_passes(compute / (layers * m), extra / per_token * 3, attention_flops / per_token)
        return compute, passes, efficiency
    passes = layer_passes(model, layout, cluster, micro, precision, attention)
    compute = m * slowest_stage(model, layout, passes.total, head_seconds(model, layout, cluster, micro, precision))
    compute += optimizer_seconds(model, layout, cluster, precision)
    return compute, passes, flops / (compute * peak)


def slowest_stage(model: ModelShape, layout: Layout, layer: float, head: float) -> float:
    """One microbatch's seconds on the slowest pipeline stage: the first stages' ``ceil(layers / stages)`` layers
    of ``layer`` seconds each, or the last stage's (what is left of the layers) with the output layer's ``head``
    seconds, whichever is longer. Each stage sends its microbatch on when its neighbour takes it, so every stage
    runs at the slowest one's pace; the output layer and the loss run on the last stage alone (Megatron-LM splits
    the layers evenly over the stages and puts them there; Megatron-Core's ``account_for_loss_in_pipeline_split``
    exists to count them as a layer). Without a pipeline: the layers and the head.

    >>> from parallelkit.planner.model import ModelShape
    >>> gpt = ModelShape(layers=8, d_model=64, heads=4, ffn=256, vocab=100, seq=16)
    >>> slowest_stage(gpt, Layout(), 1.0, 0.5), slowest_stage(gpt, Layout(stages=4), 1.0, 0.5)
    (8.5, 2.5)
    """
    first = math.ceil(model.layers / layout.stages)
    last = max(model.layers - (layout.stages - 1) * first, 0)
    return max(first * layer, last * layer + head)


def _even_passes(seconds: float, recomputed: float, attention: float) -> Passes:
    """One layer's ``seconds`` for a microbatch as the one-number model splits them: forward, backward and weight
    passes equal, ``recomputed`` forward passes more in the backward, the ``attention`` share of each in its core."""
    unit = seconds / (3 + recomputed)
    return Passes(unit, unit * (1 + recomputed), unit, products=seconds * (1 - attention), core=seconds * attention)


def memory_seconds(nbytes: float, cluster: Cluster) -> float:
    """One kernel moving ``nbytes`` through the device's memory at :data:`MEMORY_SHARE` of its bandwidth; 0 where
    ``cluster.hbm_bytes_per_s`` is None (FLOPs alone)."""
    if cluster.hbm_bytes_per_s is None:
        return 0.0
    return nbytes / (cluster.hbm_bytes_per_s * _share_of(MEMORY_SHARE, nbytes))


def _share_of(curve: Sequence[tuple[float, float]], size: float) -> float:
    """The share a curve of (at least, share) pairs, largest first, gives ``size``."""
    return next(share for least, share in curve if size >= least)


def matmul_share(flops: float, cluster: Cluster) -> float:
    """The share of the peak a product of ``flops`` reaches: :data:`MATMUL_SHARE` by its size, at most the chip's
    :data:`ACHIEVABLE`.

    >>> h100 = Cluster.published("H100 SXM", per_node=1)
    >>> round(matmul_share(2 * 8192**3, h100), 3), matmul_share(2e9, h100), matmul_share(1e8, h100)
    (0.803, 0.6, 0.1)
    """
    return min(ACHIEVABLE.get(cluster.chip, _ACHIEVABLE_ELSE), _share_of(MATMUL_SHARE, flops))


def matmul_seconds(m: float, k: float, n: float, cluster: Cluster, precision: str, batch: float = 1) -> float:
    """``batch`` products of ``m x k`` by ``k x n`` in one kernel on one device: the longer of their FLOPs at
    :func:`matmul_share` of the peak and their bytes at :func:`memory_seconds` (FLOPs alone where
    ``cluster.hbm_bytes_per_s`` is None). Under ``"fp8"`` the inputs are 1 byte an element and the output bf16, and
    quantizing the inputs first adds :data:`FP8_CAST_BYTES` an input element, a pass of its own.

    >>> h100 = Cluster.published("H100 SXM", per_node=1)
    >>> big, thin = matmul_seconds(8192, 8192, 8192, h100, "bf16"), matmul_seconds(8192, 8192, 16, h100, "bf16")
    >>> round(2 * 8192**3 / big / 989.5e12, 3), round(2 * 8192**2 * 16 / thin / 989.5e12, 3)  # share of the peak
    (0.733, 0.045)
    >>> fp8 = matmul_seconds(8192, 8192, 8192, h100, "fp8")  # FP8's peak, less the quantization of the inputs
    >>> round(2 * 8192**3 / fp8 / 1979e12, 3)
    0.608
    """
    total = 2 * m * k * n * batch
    flops = total / (matmul_share(total, cluster) * cluster.peak_flops(precision))
    if cluster.hbm_bytes_per_s is None:
        return flops
    if precision != "fp8":
        return flops + memory_seconds(ELEMENT_BYTES[precision] * (m * k + k * n + m * n) * batch, cluster)
    inputs = (m * k + k * n) * batch  # quantized to 1 byte each by a pass of their own, then read by the product
    cast = memory_seconds(FP8_CAST_BYTES * inputs, cluster)
    return cast + flops + memory_seconds(inputs + ELEMENT_BYTES["bf16"] * m * n * batch, cluster)


def layer_passes(model: ModelShape, layout: Layout, cluster: Cluster, micro: int, precision: str,
                 attention: str = "flash") -> Passes:  # fmt: skip
    """One layer's :class:`Passes` for a microbatch of ``micro`` sequences on one device: every operation timed on
    its own (the module's assumptions), each kernel one after another."""
    ulysses = layout.context_method == "ulysses" and layout.context > 1
    return _passes(model, cluster, precision, layout.tensor, layout.sequence_parallel, layout.context, ulysses,
                   layout.expert, micro, layout.recompute, attention)  # fmt: skip


@functools.lru_cache(maxsize=65536)  # the planner asks for the same shapes for many layouts
def _passes(
    model: ModelShape, cluster: Cluster, precision: str, t: int, sp: bool, context: int, ulysses: bool,
    expert: int, micro: int, recompute: str, attention: str,
) -> Passes:  # fmt: skip
    h, f, e = model.d_model, model.ffn, ELEMENT_BYTES[precision]
    tokens = micro * model.seq / context
    kv = model.kv_heads_ * model.head_dim
    linear = [(tokens, h, (h + 2 * kv) / t, 1), (tokens, h / t, h, 1)]  # (m, k, n, kernels of it)
    routed, local = tokens, 1.0
    if model.experts:  # each of the device's experts on the tokens routed to it
        routed, local = max(tokens * model.top_k * expert / model.experts, 1.0), model.experts / expert
        linear += [(routed, h, (2 if model.gated else 1) * f / t, local), (routed, f / t, h, local)]
        mlp_tokens = tokens * model.top_k
    else:
        linear += [(tokens, h, (2 if model.gated else 1) * f / t, 1), (tokens, f / t, h, 1)]
        mlp_tokens = tokens
    products = sum(matmul_seconds(m, k, n, cluster, precision) * count for m, k, n, count in linear)
    heads, queries = model.heads / t, tokens / micro  # a sequence's queries on this device
    if ulysses:  # every token of a share of the heads
        heads, queries = heads / context, model.seq
    keys, d, pairs = model.seq, model.head_dim, heads * micro
    exact = "bf16" if precision == "fp8" else precision  # FP8 recipes keep the attention's products in bf16
    scores = pairs * queries * keys  # elements of the scores
    if attention == "flash":  # the two products in one kernel; it reads q, k, v and writes the output
        flops = 4 * queries * keys * d * pairs
        moved = ELEMENT_BYTES[exact] * pairs * d * (2 * queries + 2 * keys)
        core = flops / (matmul_share(flops, cluster) * cluster.peak_flops(exact)) + memory_seconds(moved, cluster)
        core_back, core_vector = FLASH_BACKWARD * core, (0.0, 0.0)
    else:  # queries x keys writes the scores, scores x values reads them; softmax and dropout in between
        core = sum(matmul_seconds(*shape, cluster, exact, pairs) for shape in ((queries, d, keys), (queries, keys, d)))
        core_back, core_vector = 2 * core, _score_passes(scores, e, model.dropout, cluster)
    forward_vector, backward_vector = elementwise(model, cluster, tokens / (t if sp else 1), mlp_tokens * f / t, e)
    forward = products + core + core_vector[0] + forward_vector
    if recompute == OP_LEVEL:  # the products it does not keep, each one kernel, and everything but the products
        rows = {False: (tokens, 1), True: (routed, local)}  # (m of the product, kernels of it)
        again = forward_vector + sum(
            matmul_seconds(rows[p.mlp][0], p.inner / (1 if p.column else t), p.outer / (t if p.column else 1), cluster,
                           precision) * rows[p.mlp][1]
            for p in op_level_recomputed(model))  # fmt: skip
    else:
        again = {"none": 0.0, "selective": core + core_vector[0], "full": forward}[recompute]
    backward = products + core_back + core_vector[1] + backward_vector + again
    return Passes(forward, backward, products, products=3 * products, core=core + core_back)


def _score_passes(scores: float, e: int, dropout: bool, cluster: Cluster) -> tuple[float, float]:
    """The forward and the backward seconds of an unfused attention's passes over its ``scores`` (elements of
    ``e`` bytes): the softmax reads and writes them, and its backward reads 2 arrays and writes 1; a dropout (where
    the model has one) reads them and writes them and a 1-byte mask, and its backward reads the gradient and the
    mask and writes one."""
    drop = memory_seconds((2 * e + 1) * scores, cluster) if dropout else 0.0
    return memory_seconds(2 * e * scores, cluster) + drop, memory_seconds(3 * e * scores, cluster) + drop


def elementwise(model: ModelShape, cluster: Cluster, outer: float, inner: float, e: int) -> tuple[float, float]:
    """The forward and the backward seconds of a layer's operations outside its products, each one kernel moving
    its arrays through memory (their FLOPs, a few an element, take a fraction of that on these chips): ``outer``
    tokens of the residual stream (split over ``tensor`` under sequence parallelism), ``inner`` elements of the
    MLP's hidden activation.

    Forward: 2 norms (read, write), 2 residual additions with their dropout (read 2, write 1, a 1-byte mask
    where the model has dropout), the activation function (read 1, or the gate's 2, write 1). Backward: the norms
    read the input and the gradient and write one (3), the additions read the gradient and the mask and write
    theirs (2 and the mask), the activation function reads its inputs and the gradient, writes theirs (3, gated 5).
    """
    mask, gated = (1 if model.dropout else 0), model.gated
    h = model.d_model

    def moved(*bytes_each: float) -> float:
        return sum(memory_seconds(b, cluster) for b in bytes_each)

    forward = moved(2 * e * outer * h, 2 * e * outer * h, (3 * e + mask) * outer * h, (3 * e + mask) * outer * h,
                    (3 if gated else 2) * e * inner)  # fmt: skip
    backward = moved(3 * e * outer * h, 3 * e * outer * h, (2 * e + mask) * outer * h, (2 * e + mask) * outer * h,
                     (5 if gated else 3) * e * inner)  # fmt: skip
    return forward, backward


def head_seconds(model: ModelShape, layout: Layout, cluster: Cluster, micro: int, precision: str) -> float:
    """The output layer's seconds for one microbatch on one device: its product with the vocabulary (split over
    ``tensor``), forward and both gradients, and the loss's passes over the logits (read and written forward, read
    and the gradient written backward)."""
    return _head(model, cluster, micro, layout.tensor, layout.context, precision)


@functools.lru_cache(maxsize=65536)  # the planner asks for the same head for many layouts
def _head(model: ModelShape, cluster: Cluster, micro: int, tensor: int, context: int, precision: str) -> float:
    tokens = micro * model.seq / context
    vocab = model.vocab / tensor
    logits = ELEMENT_BYTES[precision] * tokens * vocab
    product = matmul_seconds(tokens, model.d_model, vocab, cluster, precision)
    return 3 * product + 2 * memory_seconds(2 * logits, cluster)


def optimizer_seconds(model: ModelShape, layout: Layout, cluster: Cluster, precision: str) -> float:
    """The optimizer's step on one device: :data:`OPTIMIZER_PASSES`, each a kernel over the parameters whose Adam
    state it holds (:func:`.layout.memory_per_device`'s split); the last, the gradients' zeroing, over the
    gradients it holds (whole below ZeRO-2)."""
    return _optimizer(model, cluster, precision, layout.tensor * layout.stages, layout.expert, layout.context,
                      layout.data, layout.zero)  # fmt: skip


@functools.lru_cache(maxsize=65536)  # the planner asks for the same split for many layouts
def _optimizer(model: ModelShape, cluster: Cluster, precision: str, split: int, expert: int, context: int, data: int,
               zero: int) -> float:  # fmt: skip
    _, grads, state = device_state(model, split, expert, context, data, zero, precision, "adam")
    _, grad_bytes, state_bytes = STATE_BYTES[precision, "adam"]
    *update, zeroing = OPTIMIZER_PASSES[precision]
    seconds = sum(memory_seconds(nbytes * state / state_bytes, cluster) for nbytes in update)
    return seconds + memory_seconds(zeroing * grads / grad_bytes, cluster)
