"""Memory per device of a layout, by the standard accounting: ZeRO for the state, Korthikanti for activations.

Its assumptions, each with its source, are set out in ``docs/planner.md`` (under this module's name); the
coefficients are constants of the code, each with its source beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.types import is_count
from ..models.layers.attention import METHODS
from ..models.recompute import RECOMPUTE
from ..strategies.fully_sharded import zero_state_bytes
from ..strategies.pipeline.strategy import SCHEDULES as PIPELINE_SCHEDULES
from .model import ModelShape

# Bytes per parameter of (parameters, gradients, optimizer state), by precision and optimizer.
# FP8 training as Transformer Engine runs it by default keeps bf16 mixed precision's state: the weights stay in 16
# bits (float32 masters beside them) and each matrix product quantizes its inputs to FP8 with a per-tensor scale as
# it runs (Transformer Engine's FP8 recipes:
# https://nvidia.github.io/TransformerEngine/features/low_precision_training/fp8_delayed_scaling/fp8_delayed_scaling.html;
# FP8 weights in place of the 16-bit ones are an option, "fp8_primary_weights":
# https://github.com/NVIDIA/TransformerEngine/pull/1544). The FP8 copies of a step's weights are transient, like any
# product's cast input, and not counted.
STATE_BYTES = {
    ("bf16", "adam"): (2, 2, 12),  # ZeRO's mixed-precision Adam: 16-bit copies; float32 master, m, v
    ("bf16", "sgd"): (2, 2, 4),  # 16-bit copies; the float32 master
    ("fp32", "adam"): (4, 4, 8),
    ("fp32", "sgd"): (4, 4, 0),
    ("fp8", "adam"): (2, 2, 12),  # bf16's: FP8 only inside the matrix products
    ("fp8", "sgd"): (2, 2, 4),
}
# A stored activation, by the training precision. Under "fp8" the arrays a layer keeps are bf16's: the norms',
# activation functions', attention's and residuals' tensors stay in bf16 in Transformer Engine's recipes; only a
# linear layer's saved input may be its FP8 copy (1 byte), a saving this count leaves out (an upper bound, the safe
# side for "does it fit").
ELEMENT_BYTES = {"bf16": 2, "fp32": 4, "fp8": 2}
# The cross-entropy losses the planner counts, by what they hold at their peak (:func:`loss_bytes`).
# "in_place": Megatron-LM's vocabulary-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py,
# _VocabParallelCrossEntropy): the logits cast to float32 once, the softmax and then its gradient worked in that copy
# in place. "eager": PyTorch's torch.nn.functional.cross_entropy on logits.float(), a log-softmax then a negative
# log-likelihood, each its own kernel, as torchtitan's train.py calls it (pytorch/torchtitan commit 9dec370), and
# torch's loss_parallel where the vocabulary is split (torch/distributed/tensor/parallel/loss.py).
LOSSES = ("in_place", "eager")
SCHEDULES = tuple(PIPELINE_SCHEDULES)  # the kit's named pipeline schedules, each one the planner times
# torchtitan's op-level selective recomputation (activation_checkpoint.selective_ac_option = "op", the setting of
# its Llama 3 8B benchmarks: pytorch/torchtitan commit 9dec370, torchtitan/parallelisms/parallelize_llama.py,
# _save_list and _apply_ac_to_transformer_block; train_configs/llama3_8b.toml): a block keeps its input and the
# outputs of the operations it saves, the attention kernel's and every second matrix product's in the order the block
# runs them (it counts them from one and recomputes the even ones: for a Llama block q, v, the gate and the down
# projection are kept; k, the attention's output projection and the up projection recomputed), and recomputes
# everything else from them in the backward pass. The planner counts and times it; the kit's transformers recompute
# none, selective or full (build.unsupported).
OP_LEVEL = "op"
PLANNED_RECOMPUTE = (*RECOMPUTE, OP_LEVEL)
# The kit's context methods but the zig-zag ring, which sends the ring's bytes in a balanced order: the planner
# times it as the ring.
CONTEXT_METHODS = tuple(method for method in METHODS if method != "ring_zigzag")


def is_zero_stage(zero: object) -> bool:
    """Whether ``zero`` is a ZeRO stage: a whole number from 0 to 3 (a bool is not, nor is ``1.0``).

    >>> is_zero_stage(3), is_zero_stage(4), is_zero_stage(True), is_zero_stage(1.0)
    (True, False, False, False)
    """
    return is_count(zero, least=0) and zero <= 3


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by what they hold."""

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float = 0.0  # the most the last stage's loss holds at once, one microbatch's (loss_bytes)
    buffers: float = 0.0  # what one layer's backward pass holds beside the kept arrays (fused programs)
    grads_apart: bool = False  # a fused program: the gradients are made as the activations are freed
    gathered: float = 0.0  # ZeRO-3's parameters gathered at the peak (gathered_bytes)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The most held at once: the state, the activations, the loss, the buffers and ZeRO-3's gathered
        parameters; for a fused program the gradients or the activations with the logits, whichever is larger, not
        both (the module's "A fused program")."""
        held = self.params + self.optimizer + self.buffers + self.gathered
        if self.grads_apart:
            return held + max(self.grads, self.activations + self.logits)
        return held + self.grads + self.activations + self.logits

    def __str__(self) -> str:
        parts = ("params", "grads", "optimizer", "activations", "logits", "buffers", "gathered", "total")
        return ", ".join(f"{name} {getattr(self, name) / 1e9:.2f} GB" for name in parts)


def state_bytes(
    params: float, *, data: int = 1, zero: int = 0, precision: str = "bf16", optimizer: str = "adam"
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes on one device for ``params`` parameters it holds a part of.

    ``params`` is what one device's model-parallel slice holds before ZeRO (the model's
    parameters over tensor x pipeline x expert splits); ``zero`` (0-3) splits over the ``data``
    devices that replicate it.

    >>> psi = 7.5e9  # the ZeRO paper's Figure 1: 7.5B parameters, 64 devices, K = 12
    >>> [round(sum(state_bytes(psi, data=64, zero=z)) / 1e9, 1) for z in range(4)]
    [120.0, 31.4, 16.6, 1.9]
    """
    if (precision, optimizer) not in STATE_BYTES:
        raise ValueError(f"precision={precision!r}, optimizer={optimizer!r}: choose from {list(STATE_BYTES)}.")
    if not is_zero_stage(zero) or not is_count(data):
        raise ValueError(f"zero={zero!r} must be 0, 1, 2 or 3 and data={data!r} a whole number >= 1.")
    per_param, _, per_moment = STATE_BYTES[precision, optimizer]  # a gradient takes its parameter's bytes
    split = zero_state_bytes(zero, params * per_param, params * per_moment, data)  # FullySharded's accounting
    return split["parameters"], split["gradients"], split["optimizer"]


@dataclass(frozen=True)
class Product:
    """One matrix product of a block, a token's: ``inner`` by ``outer`` features; ``column``: split over tensor by its
    output (Megatron's column-parallel), else by its input (row-parallel: each device holds a partial sum of the
    whole output); ``mlp``: one of the MLP's (an MoE layer runs it for each of a token's ``top_k`` experts)."""

    name: str
    inner: float
    outer: float
    column: bool
    mlp: bool = False

    def copies(self, model: ModelShape) -> int:
        """How many times a token runs it: an MoE layer's MLP products once for each of its ``top_k`` experts."""
        return model.top_k if self.mlp and model.experts else 1


def block_products(model: ModelShape) -> tuple[Product, ...]:
    """A block's matrix products in the order torchtitan's Llama runs them: q, k, v, the attention's output
    projection, the MLP's gate (a gated MLP's), up and down projections.

    >>> [p.name for p in block_products(ModelShape(1, 64, 4, 256, 10, 8))]
    ['q', 'k', 'v', 'o', 'gate', 'up', 'down']
    """
    h, f, kv = model.d_model, model.ffn, model.kv_heads_ * model.head_dim
    gate = (Product("gate", h, f, True, True),) if model.gated else ()
    return (Product("q", h, h, True), Product("k", h, kv, True), Product("v", h, kv, True), Product("o", h, h, False),
            *gate, Product("up", h, f, True, True), Product("down", f, h, False, True))  # fmt: skip


def op_level_kept(model: ModelShape) -> tuple[Product, ...]:
    """The products whose outputs :data:`OP_LEVEL` recomputation keeps: the first, third, fifth... of
    :func:`block_products` (torchtitan recomputes the second, fourth, sixth...).

    >>> [p.name for p in op_level_kept(ModelShape(1, 64, 4, 256, 10, 8))]
    ['q', 'v', 'gate', 'down']
    """
    return block_products(model)[0::2]


def op_level_recomputed(model: ModelShape) -> tuple[Product, ...]:
    """The products :data:`OP_LEVEL` recomputation runs again in the backward pass: the second, fourth... of
    :func:`block_products`, those :func:`op_level_kept` leaves.

    >>> [p.name for p in op_level_recomputed(ModelShape(1, 64, 4, 256, 10, 8))]
    ['k', 'o', 'up']
    """
    return block_products(model)[1::2]


def layer_activation_bytes(
    model: ModelShape,
    micro_batch: int,
    *,
    tensor: int = 1,
    sequence_parallel: bool = False,
    context: int = 1,
    context_method: str = "ring",
    recompute: str = "none",
    element_bytes: int = 2,
    fused: bool = False,
) -> float:
    """The activations one transformer layer keeps on one device for its backward pass, in bytes.

    Korthikanti et al.'s accounting (the module's docstring), for ``element_bytes`` a stored
    activation (2: the paper's 16-bit; 4: float32) and 1 byte a dropout mask entry, masks only
    where ``model.dropout``; without dropout the attention keeps its probabilities once, not the
    paper's three arrays. ``context`` devices split each sequence: each holds ``s / context``
    tokens. Under ``"allgather"`` and ``"ring"`` its queries meet every key, ``s/c x s`` scores
    (the ring one ``s/c x s/c`` block a step, each kept for the backward pass as automatic
    differentiation keeps a loop's), and it keeps the ``c - 1`` other blocks of keys and values it
    received; under ``"ulysses"`` it holds ``a/c`` heads of ``s x s``. An MoE layer keeps the
    MLP's arrays for each of a token's ``top_k`` experts. Under ``"op"`` (:data:`OP_LEVEL`, torchtitan's): the
    layer's input, the attention kernel's output and the outputs of :func:`op_level_kept`'s products (a
    row-parallel product's whole partial sum), whether ``fused`` or not. ``fused``: a program compiled whole
    (XLA's), which keeps the layer's input, the queries, keys and values, the attention's output and the MLP's
    pre-activations, and the probabilities unless recomputed (the module's "A fused program").

    >>> gpt = ModelShape(layers=1, d_model=4096, heads=32, ffn=16384, vocab=1, seq=2048, gated=False)
    >>> s, b, h, a = 2048, 1, 4096, 32  # the paper's s b h (34 + 5 a s / h), its 4h GELU block
    >>> layer_activation_bytes(gpt, b) == s * b * h * (34 + 5 * a * s / h)
    True
    >>> layer_activation_bytes(gpt, b, tensor=8, sequence_parallel=True) == s * b * h / 8 * (34 + 5 * a * s / h)
    True
    """
    if recompute not in PLANNED_RECOMPUTE or context_method not in CONTEXT_METHODS:
        raise ValueError(f"recompute={recompute!r} (one of {PLANNED_RECOMPUTE}), context_method={context_method!r} "
                         f"(one of {CONTEXT_METHODS}).")  # fmt: skip
    if min(micro_batch, tensor, context, element_bytes) < 1:
        raise ValueError(f"micro_batch={micro_batch}, tensor={tensor}, context={context}, "
                         f"element_bytes={element_bytes}: whole numbers >= 1.")  # fmt: skip
    s, b, h, a, e = model.seq / context, micro_batch, model.d_model, model.heads, element_bytes
    mask = 1 if model.dropout else 0
    outer_split = tensor if sequence_parallel else 1
    if recompute == "full":
        return e * s * b * h / outer_split
    kv = model.kv_heads_ * model.head_dim
    routed = model.top_k if model.experts else 1
    received = 2 * e * (context - 1) * s * b * kv if context_method != "ulysses" else 0.0  # others' K and V
    if recompute == OP_LEVEL:  # the input; the attention kernel's output; every second product's output
        kept = sum(p.outer * p.copies(model) / (tensor if p.column else 1) for p in op_level_kept(model))
        return e * s * b * (h / outer_split + h / tensor + kept) + received / tensor
    attention = e * (s * b * h + 2 * s * b * kv + s * b * h)  # Q; K and V; the output projection's input
    mlp = e * (4 if model.gated else 2) * s * b * model.ffn * routed
    queries_heads = a * s if context_method != "ulysses" else a / context * model.seq
    per_score = 2 * e + mask if model.dropout else e  # probabilities, their mask and the dropped ones; or once
    scores = 0.0 if recompute == "selective" else per_score * queries_heads * model.seq * b
    outer = (4 * e + 2 * mask) * s * b * h  # two norms' inputs, the two blocks' inputs, their dropout masks
    if fused:  # the module's "what a layer keeps": the input; Q, K, V, attention's output; the pre-activations
        mlp, outer = e * (2 if model.gated else 1) * s * b * model.ffn * routed, (e + 2 * mask) * s * b * h
    return outer / outer_split + (attention + mlp + scores + received) / tensor


def loss_bytes(
    model: ModelShape,
    micro_batch: int,
    *,
    tensor: int = 1,
    context: int = 1,
    loss: str = "in_place",
    element_bytes: int = 2,
    fused: bool = False,
) -> float:
    """The most the loss holds at once on the device that runs it (the last stage), in bytes: a microbatch's
    ``s b V / tensor`` logits (``s / context`` tokens a sequence, the vocabulary split over ``tensor``) at
    :func:`bytes_a_logit`.

    >>> m = ModelShape(layers=1, d_model=8, heads=2, ffn=32, vocab=100, seq=4)
    >>> loss_bytes(m, 2, context=2, loss="eager") == 12 * 2 * (4 / 2) * 100
    True
    """
    per_logit = bytes_a_logit(loss, tensor=tensor, element_bytes=element_bytes, fused=fused)
    return per_logit * micro_batch * (model.seq / context) * model.vocab / tensor


def bytes_a_logit(loss: str = "in_place", *, tensor: int = 1, element_bytes: int = 2, fused: bool = False) -> int:
    """The bytes a logit the loss holds at its peak (:func:`loss_bytes`):

    - ``fused`` (a program compiled whole, as the kit's): one float32 copy kept for the backward pass, 4;
    - ``"in_place"`` (:data:`LOSSES`, Megatron-LM's): the float32 copy beside the ``element_bytes`` logits in
      the forward pass and beside their gradient cast back in the backward pass, ``4 + element_bytes`` (4 in
      float32, where the cast is the array itself);
    - ``"eager"`` (PyTorch's, torchtitan's): in the backward pass the log-softmax's output, kept from the
      forward pass, the likelihood's gradient and the log-softmax's gradient at once, 12; with the vocabulary
      split (``tensor > 1``: loss_parallel, which computes both gradients in one function) four at once, 16: the
      kept output and the likelihood's gradient, beside the output's exponential and the sum of the two, then
      beside that sum and its product with the incoming gradient.

    >>> [bytes_a_logit(kind) for kind in LOSSES], bytes_a_logit("eager", tensor=2), bytes_a_logit(element_bytes=4)
    ([6, 12], 16, 4)
    """
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not a cross-entropy the planner counts: give one of {LOSSES} "
                         "(Megatron-LM's in place, or PyTorch's op by op, as torchtitan runs it).")  # fmt: skip
    if fused:
        return 4
    if loss == "in_place":
        return 4 + (element_bytes if element_bytes < 4 else 0)
    return 16 if tensor > 1 else 12


def gathered_bytes(
    model: ModelShape, *, tensor: int = 1, expert: int = 1, stages: int = 1, param_bytes: int = 2
) -> float:
    """What ZeRO-3 holds gathered at the step's peak, the loss's backward pass, in bytes on one device.

    The ends' parameters, gathered for the whole step (PyTorch's FSDP2 keeps its root unit, which torchtitan's
    Llama leaves the embedding, the final norm and the output head in, gathered from the forward pass to the end
    of the backward pass: ``FSDPState._lazy_init``, "for the root, do not reshard after forward"), both tables on one
    stage and one table at each end of a pipeline; and the last layer's, the first the backward pass needs
    (torchtitan leaves it gathered after the forward pass; a prefetch would gather it as early). Each in its
    ``param_bytes`` copy, its matrices over ``tensor`` (the experts' over ``expert`` too; the norms' few scales
    are counted split as well).

    >>> m = ModelShape(layers=2, d_model=8, heads=2, ffn=32, vocab=100, seq=4, gated=False)
    >>> gathered_bytes(m) == 2 * (m.embedding_params + m.layer_params)
    True
    """
    ends = model.embedding_params if stages == 1 else model.vocab * model.d_model
    routed = model.experts * model.expert_params
    layer = (model.layer_params - routed) / tensor + routed / (tensor * expert)
    return param_bytes * (ends / tensor + layer)


def backward_working_bytes(
    model: ModelShape,
    micro_batch: int,
    *,
    tensor: int = 1,
    context: int = 1,
    context_method: str = "ring",
    fused: bool = False,
) -> float:
    """What one layer's backward pass holds for a moment beside the kept activations, in bytes on one device.

    For a fused program (``fused``) whose attention is not fused, as the kit's (:func:`parallelkit.models.layers.
    attention.dense`: float32 scores), the layer's probabilities and their gradient, ``2 x 4 a s^2 b`` over the
    ``tensor`` devices that split the heads, ``s / context`` queries against the keys each method's device holds
    (the module's "One layer's backward pass"). Korthikanti et al.'s accounting (``fused=False``) counts what is
    kept between the passes only: 0.

    >>> m = ModelShape(layers=1, d_model=8, heads=2, ffn=32, vocab=1, seq=4, gated=False)
    >>> backward_working_bytes(m, 1, fused=True) == 2 * 4 * 2 * 4 * 4, backward_working_bytes(m, 1)
    (True, 0.0)
    """
    if not fused:
        return 0.0
    queries = model.seq / context
    keys = model.seq if context_method != "ring" else model.seq / context  # the ring: one block at a time
    heads = model.heads / (context if context_method == "ulysses" else 1)
    if context_method == "ulysses":
        queries = model.seq
    return 2 * 4 * heads * queries * keys * micro_batch / tensor


def in_flight(schedule: str, stages: int, microbatches: int, stage: int = 0, virtual: int = 1) -> float:
    """Microbatches whose activations pipeline stage ``stage`` holds at once under ``schedule``.

    GPipe: all of them; 1F1B: ``stages - stage``; ZB-H1: ``stages`` on every stage (a
    microbatch is held until its weight pass); never more than the microbatches. Interleaved
    1F1B with ``virtual`` chunks a stage: Megatron-LM's warm-up, ``2 (stages - stage - 1) +
    (virtual - 1) stages`` chunk forward passes and one more before the first backward pass
    (at most all ``virtual x microbatches``), each chunk ``1 / virtual`` of the stage's layers,
    so a fraction of a microbatch's worth may be in flight. Without a pipeline (one stage) the
    microbatches are accumulation steps, run one after another: one is in flight.

    >>> in_flight("gpipe", 4, 8), in_flight("1f1b", 4, 8), in_flight("1f1b", 4, 2), in_flight("gpipe", 1, 8)
    (8, 4, 2, 1)
    >>> in_flight("1f1b", 4, 8, stage=3), in_flight("zb-h1", 4, 8, stage=3)
    (1, 4)
    >>> in_flight("interleaved", 4, 8, virtual=2), 4 * (1 + 3 / (4 * 2))  # Korthikanti et al.'s 1 + (p-1)/(p m)
    (5.5, 5.5)
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: one of {SCHEDULES}.")
    if stages == 1:
        return 1
    if schedule == "interleaved":
        chunks = 2 * (stages - stage - 1) + (virtual - 1) * stages + 1
        return min(chunks, virtual * microbatches) / virtual
    held = {"gpipe": microbatches, "1f1b": stages - stage, "zb-h1": stages}[schedule]
    return min(held, microbatches)


def weight_passes_pending(schedule: str, stages: int, microbatches: int, stage: int = 0) -> int:
    """ZB-H1's weight passes that stage ``stage`` has deferred at once: the kit's schedule runs the weight pass of
    microbatch ``j - stage`` after the backward pass of ``j`` (:func:`parallelkit.strategies.pipeline.schedules.
    zero_bubble_schedule`), so ``stage`` of them (none on the first stage); 0 under the other schedules.

    >>> weight_passes_pending("zb-h1", 4, 8, stage=3), weight_passes_pending("1f1b", 4, 8, stage=3)
    (3, 0)
    """
    return min(stage, microbatches) if schedule == "zb-h1" else 0


def weight_pass_bytes(
    model: ModelShape,
    micro_batch: int,
    *,
    tensor: int = 1,
    sequence_parallel: bool = False,
    context: int = 1,
    element_bytes: int = 2,
) -> float:
    """What one layer's deferred weight pass keeps beyond its activations: the gradients of its matrix products'
    outputs (``dW = x^T dy`` needs ``dy``), in bytes on one device.

    The queries, keys and values, the MLP's up (and gate) projections per routed expert, split over ``tensor``
    (column-parallel); the attention's and the MLP's output projections, ``s b h`` each, split over ``tensor``
    only with sequence parallelism (row-parallel: reduced, or reduce-scattered with it). ``context`` splits the
    tokens.

    >>> m = ModelShape(layers=1, d_model=8, heads=2, ffn=32, vocab=1, seq=4, gated=False)
    >>> weight_pass_bytes(m, 1) == 2 * 4 * (8 + 2 * 8 + 32 + 2 * 8)  # q, k, v; up; two outputs of h
    True
    """
    s, b, h, e = model.seq / context, micro_batch, model.d_model, element_bytes
    kv = model.kv_heads_ * model.head_dim
    columns = h + 2 * kv + (2 if model.gated else 1) * model.ffn * (model.top_k if model.experts else 1)
    rows = h + h * (model.top_k if model.experts else 1)  # the attention's output, then the MLP's per routed expert
    return e * s * b * (columns / tensor + rows / (tensor if sequence_parallel else 1))
