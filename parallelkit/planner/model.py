"""A transformer described by its shape: what the planner needs to know of a model, and published shapes.

:class:`ModelShape` counts its parameters exactly from its shape (embeddings, attention with
grouped key-value heads, a plain or gated MLP, norms, biases where the model has them), and its
training FLOPs per token as PaLM counts them (``6 N`` plus attention:
:func:`parallelkit.measure.flops.dense_training_flops`). :data:`MODELS` holds published shapes,
each checked in the tests against the parameter count its authors publish.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

from ..core.types import is_count
from ..measure.flops import dense_training_flops


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape.

    Args:
      layers, d_model, heads, ffn, vocab, seq: depth, width, attention heads, the MLP's hidden
        width, the vocabulary and the sequence length trained on.
      kv_heads: key and value heads (grouped-query attention); ``heads`` when None.
      gated: a gated MLP (SwiGLU: three ``d_model x ffn`` matrices) rather than two (GELU).
      tied: the output head shares the input embedding's matrix.
      bias: linear layers (an untied head too) and norms carry biases (GPT-2), not only norm scales (Llama).
      key_bias: with ``bias``, the key projection has one too (GPT-2's does; the kit's GPT's does not).
      positions: a learned position embedding of ``seq`` rows (GPT-2); rotary positions have none.
      dropout: the model trains with dropout, whose masks its activations keep (1 byte an entry).
      experts, top_k: a mixture of experts in every layer's MLP (0: a dense model), each token
        routed to ``top_k`` of them (a dense model with ``top_k`` other than 1 warns: it is unused).
      name: for tables.

    Raises:
      ValueError: a size that is not a whole number (a bool is not one), a flag that is not a bool,
        ``heads`` that do not divide ``d_model``, ``kv_heads`` that do not divide ``heads``, or
        ``top_k`` above ``experts``.

    >>> tiny = ModelShape(layers=2, d_model=8, heads=2, ffn=32, vocab=16, seq=4)
    >>> tiny.layer_params, tiny.embedding_params, tiny.params  # 4 x 8 x 8 + 3 x 8 x 32 + 2 x 8; 2 x 16 x 8 + 8
    (1040, 264, 2344)
    """

    layers: int
    d_model: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: int | None = None
    gated: bool = True
    tied: bool = False
    bias: bool = False
    key_bias: bool = True
    positions: bool = False
    dropout: bool = True
    experts: int = 0
    top_k: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "d_model", "heads", "ffn", "vocab", "seq"):
            value = getattr(self, field)
            if not is_count(value):
                raise ValueError(f"ModelShape({field}={value!r}): a whole number >= 1.")
        if self.kv_heads is not None and not is_count(self.kv_heads):
            raise ValueError(f"ModelShape(kv_heads={self.kv_heads!r}) is not a number of heads: give a whole number "
                             f">= 1 that divides heads={self.heads}, or None for one per query head.")  # fmt: skip
        if not is_count(self.experts, least=0):
            raise ValueError(f"ModelShape(experts={self.experts!r}) is not a number of experts: give a whole number "
                             ">= 1 for a mixture of experts, or 0 for a dense model.")  # fmt: skip
        if not is_count(self.top_k):
            raise ValueError(f"ModelShape(top_k={self.top_k!r}) is not a number of experts: give the whole number "
                             "(>= 1) of experts each token is routed to.")  # fmt: skip
        for flag in ("gated", "tied", "bias", "key_bias", "positions", "dropout"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"ModelShape({flag}={getattr(self, flag)!r}) is not a bool: give True or False.")
        if self.d_model % self.heads:
            raise ValueError(f"ModelShape: d_model={self.d_model} does not split into heads={self.heads}.")
        if self.heads % self.kv_heads_:
            raise ValueError(f"ModelShape: heads={self.heads} do not group into kv_heads={self.kv_heads}.")
        if self.experts and self.top_k > self.experts:
            raise ValueError(f"ModelShape(top_k={self.top_k}) routes each token to more experts than the "
                             f"{self.experts} there are: choose top_k from 1 to {self.experts}.")  # fmt: skip
        if not self.experts and self.top_k != 1:
            warnings.warn(f"ModelShape(top_k={self.top_k}) with experts=0: a dense model routes no tokens, so "
                          "top_k is unused. Give experts= for a mixture of experts, or leave top_k at 1.",
                          stacklevel=3)  # fmt: skip

    @property
    def kv_heads_(self) -> int:
        """Key-value heads: ``kv_heads``, or ``heads`` for plain multi-head attention."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def attention_params(self) -> int:
        """One layer's query, key, value and output projections (and their biases)."""
        d, kv = self.d_model, self.kv_heads_ * self.head_dim
        weights = d * d + 2 * d * kv + d * d
        return weights + ((d + (2 if self.key_bias else 1) * kv + d) if self.bias else 0)

    @property
    def expert_params(self) -> int:
        """One expert's MLP (one layer's dense MLP for a dense model)."""
        d, f = self.d_model, self.ffn
        return (3 if self.gated else 2) * d * f + ((f + d) if self.bias else 0)

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: every expert and the router, or the dense MLP."""
        if not self.experts:
            return self.expert_params
        return self.experts * self.expert_params + self.d_model * self.experts

    @property
    def norm_params(self) -> int:
        """One norm's scale (and bias)."""
        return self.d_model * (2 if self.bias else 1)

    @property
    def embedding_params(self) -> int:
        """The input embedding, the output head (and its bias) unless tied, learned positions if any, the final norm."""
        table = self.vocab * self.d_model
        head_bias = self.vocab if self.bias and not self.tied else 0
        return (
            table * (1 if self.tied else 2)
            + head_bias
            + (self.seq * self.d_model if self.positions else 0)
            + self.norm_params
        )

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.norm_params

    @functools.cached_property  # counted once: the planner asks for it for every layout
    def params(self) -> int:
        """Every parameter."""
        return self.layers * self.layer_params + self.embedding_params

    @functools.cached_property  # counted once: the planner asks for it for every layout
    def routed_params(self) -> int:
        """Every expert's weights in every layer (0 for a dense model): what an expert axis splits."""
        return self.layers * self.experts * self.expert_params

    @functools.cached_property  # counted once: the planner asks for it for every layout
    def active_params(self) -> int:
        """The parameters one token uses: ``top_k`` experts of each MoE layer, every other weight."""
        if not self.experts:
            return self.params
        unused = self.layers * (self.experts - self.top_k) * self.expert_params
        return self.params - unused

    @classmethod
    def from_gpt(cls, gpt: Any, name: str = "") -> ModelShape:
        """The shape of the kit's :class:`parallelkit.models.GPT` (a GELU MLP, biases but the key's,
        learned positions, an untied head), trained on sequences of its ``max_length``.

        >>> from flax import nnx; import parallelkit as pk
        >>> gpt = pk.models.GPT(256, max_length=32, dim=16, heads=2, depth=2, mlp_dim=64, rngs=nnx.Rngs(0))
        >>> ModelShape.from_gpt(gpt).params == pk.models.param_bytes(pk.models.functional(gpt)[1]) // 4
        True
        """
        block = gpt.blocks[0]
        experts = block.moe.w_in.shape[0] if gpt.routing else 0
        ffn = block.moe.w_in.shape[2] if experts else block.mlp_in.kernel.shape[1]
        vocab, d_model = gpt.embed.embedding.shape
        top_k = gpt.routing["top_k"] if experts else 1
        shape = {"gated": False, "bias": True, "key_bias": False, "positions": True}
        dropout = bool(gpt.dropout_rate > 0)  # a NumPy rate compares to a NumPy bool, not a flag
        return cls(len(gpt.blocks), d_model, gpt.heads, ffn, vocab, gpt.max_length, **shape, dropout=dropout,
                   experts=experts, top_k=top_k, name=name or "the kit's GPT")  # fmt: skip

    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6`` per active parameter plus attention, as PaLM counts them."""
        return dense_training_flops(self.active_params, 1, layers=self.layers, seq_len=self.seq, d_model=self.d_model)


# Published shapes. Llama 3: Meta's model cards and config.json (rotary positions, SwiGLU, untied,
# no biases, grouped-query attention). GPT-2 XL: Radford et al. (2019) and its config.json (learned
# positions, GELU MLP of 4 x d_model, tied head, biases, dropout 0.1); Llama 3 trains without dropout.
MODELS: dict[str, ModelShape] = {
    "gpt2-xl": ModelShape(48, 1600, 25, 6400, 50257, 1024, gated=False, tied=True, bias=True, positions=True,
                           name="GPT-2 XL"),
    "llama3-8b": ModelShape(32, 4096, 32, 14336, 128256, 8192, kv_heads=8, dropout=False, name="Llama 3 8B"),
    "llama3-70b": ModelShape(80, 8192, 64, 28672, 128256, 8192, kv_heads=8, dropout=False, name="Llama 3 70B"),
}  # fmt: skip
