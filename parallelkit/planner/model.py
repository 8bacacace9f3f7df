"""A transformer described by its shape: what the planner needs to know of a model, and published shapes.

:class:`Transformer` counts its parameters exactly from its shape (embeddings, attention with
grouped key-value heads, a plain or gated MLP, norms, biases where the model has them), and its
training FLOPs per token as PaLM counts them (``6 N`` plus attention:
:func:`parallelkit.measure.flops.dense_training_flops`). :data:`MODELS` holds published shapes,
each checked in the tests against the parameter count its authors publish.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..measure.flops import dense_training_flops


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape.

    Args:
      layers, d_model, heads, ffn, vocab, seq: depth, width, attention heads, the MLP's hidden
        width, the vocabulary and the sequence length trained on.
      kv_heads: key and value heads (grouped-query attention); ``heads`` when None.
      gated: a gated MLP (SwiGLU: three ``d_model x ffn`` matrices) rather than two (GELU).
      tied: the output head shares the input embedding's matrix.
      bias: linear layers and norms carry biases (GPT-2), not only norm scales (Llama).
      positions: a learned position embedding of ``seq`` rows (GPT-2); rotary positions have none.
      experts, top_k: a mixture of experts in every layer's MLP (0: a dense model), each token
        routed to ``top_k`` of them.
      name: for tables.

    >>> tiny = Transformer(layers=2, d_model=8, heads=2, ffn=32, vocab=16, seq=4)
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
    positions: bool = False
    experts: int = 0
    top_k: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        for field in ("layers", "d_model", "heads", "ffn", "vocab", "seq"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Transformer({field}={value!r}): a whole number >= 1.")
        if self.d_model % self.heads:
            raise ValueError(f"Transformer: d_model={self.d_model} does not split into heads={self.heads}.")
        if self.heads % self.kv_heads_:
            raise ValueError(f"Transformer: heads={self.heads} do not group into kv_heads={self.kv_heads}.")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"Transformer: top_k={self.top_k} must be in 1..experts={self.experts}.")

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
        return weights + ((d + 2 * kv + d) if self.bias else 0)

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
        """The input embedding, the output head unless tied, learned positions if any, and the final norm."""
        table = self.vocab * self.d_model
        return table * (1 if self.tied else 2) + (self.seq * self.d_model if self.positions else 0) + self.norm_params

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.mlp_params + 2 * self.norm_params

    @property
    def params(self) -> int:
        """Every parameter."""
        return self.layers * self.layer_params + self.embedding_params

    @property
    def active_params(self) -> int:
        """The parameters one token uses: ``top_k`` experts of each MoE layer, every other weight."""
        if not self.experts:
            return self.params
        unused = self.layers * (self.experts - self.top_k) * self.expert_params
        return self.params - unused

    def flops_per_token(self) -> float:
        """Training FLOPs per token: ``6`` per active parameter plus attention, as PaLM counts them."""
        return dense_training_flops(self.active_params, 1, layers=self.layers, seq_len=self.seq, d_model=self.d_model)


# Published shapes. Llama 3: Meta's model cards and config.json (rotary positions, SwiGLU, untied,
# no biases, grouped-query attention). GPT-2 XL: Radford et al. (2019) and its config.json (learned
# positions, GELU MLP of 4 x d_model, tied head, biases).
MODELS: dict[str, Transformer] = {
    "gpt2-xl": Transformer(48, 1600, 25, 6400, 50257, 1024, gated=False, tied=True, bias=True, positions=True,
                           name="GPT-2 XL"),
    "llama3-8b": Transformer(32, 4096, 32, 14336, 128256, 8192, kv_heads=8, name="Llama 3 8B"),
    "llama3-70b": Transformer(80, 8192, 64, 28672, 128256, 8192, kv_heads=8, name="Llama 3 70B"),
}  # fmt: skip
