"""A small causal language model (GPT) and its next-token loss.

The model's attention is one call, :func:`parallelkit.attention.attend`, so a strategy
that splits the sequence changes how attention is computed without a second copy of
the model. Its parameters carry logical axis names (``nnx.with_partitioning``:
``vocab``, ``embed``, ``heads``, ``mlp``) and its activations name theirs with
:func:`parallelkit.core.axes.constrain`, so axis rules can place both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import attention
from ..core.axes import constrain
from .classifiers import _dense, _dropout, _layer_norm, classifier_loss
from .functional import with_axes
from .sequence import RESIDUAL, gather_columns, scatter_rows

_INIT = nnx.initializers.normal(0.02)  # GPT-2's initialisation of every weight matrix and embedding


class GPT(nnx.Module):
    """A decoder-only transformer: token and position embeddings, pre-norm causal blocks, layer norm, head.

    Each of the ``depth`` blocks is ``x + Attention(LayerNorm(x))`` then
    ``x + MLP(LayerNorm(x))`` (GELU), with causal self-attention computed by
    :func:`parallelkit.attention.attend` on ``(batch, length, heads, head_dim)`` arrays.
    The output head is a Dense layer of its own (not tied to the token embedding), so
    the embedding and the head can be split differently. Dropout (rate ``dropout``) acts
    on the embeddings and on the output of both branches of every block (not on the
    attention weights, which stay inside ``attend``) when ``rngs`` (a PRNG key) is passed
    to ``__call__``; each block draws from its own key split from it.

    Logical axes: the token embedding is ``("vocab", "embed")``, the positions
    ``(None, "embed")``, the query, key and value kernels ``("embed", "heads")``, the
    attention output ``("heads", "embed")``, the MLP ``("embed", "mlp")`` and
    ``("mlp", "embed")``, the head ``("embed", "vocab")``, each bias its output axis,
    and the layer norms' scales and biases ``("embed",)``. Activations: the residual stream
    (the embeddings and every block's input and output, where the layer norms, dropout and
    residual adds act) is ``("batch", "norm_length", "embed")`` (MaxText's ``activation_norm_length``),
    so rules can split it where attention and the MLP see whole sequences (Megatron's sequence
    parallelism, :mod:`parallelkit.models.sequence`); queries,
    keys, values and attention's output ``("batch", "length", "heads", None)``, the MLP's
    hidden units ``("batch", "length", "mlp")``, and the logits ``("batch", "norm_length", "vocab")``
    (the final norm and the head act on each token alone, as the residual stream's layers do).

    >>> model = GPT(256, max_length=16, dim=32, heads=4, depth=1, mlp_dim=64, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)

    Raises:
      ValueError: ``dim`` that ``heads`` does not divide.
    """

    def __init__(
        self,
        vocab: int,
        *,
        max_length: int = 256,
        dim: int = 64,
        heads: int = 4,
        depth: int = 2,
        mlp_dim: int = 256,
        dropout: float = 0.0,
        rngs: nnx.Rngs,
    ):
        if dim % heads:
            raise ValueError(f"dim={dim} must divide into heads={heads} equal heads: choose a multiple of {heads}.")
        self.heads, self.max_length, self.dropout_rate = heads, max_length, dropout
        self.embed = nnx.Embed(vocab, dim, embedding_init=with_axes(_INIT, ("vocab", "embed")), rngs=rngs)
        # Positions stay whole along the length: the model reads the table's first `length` rows, which
        # would move rows between devices if the table were split over the length and longer than the tokens.
        self.position = nnx.Param(with_axes(_INIT, (None, "embed"))(rngs.params(), (max_length, dim)))
        self.blocks = nnx.List([_CausalBlock(dim, heads, mlp_dim, rngs=rngs) for _ in range(depth)])
        self.norm = _layer_norm(dim, "embed", rngs)
        self.head = _dense(dim, vocab, "embed", "vocab", rngs, kernel_init=_INIT)

    def __call__(self, tokens: jax.Array, *, rngs: jax.Array | None = None) -> jax.Array:
        """Logits ``(batch, length, vocab)`` for integer ``tokens`` ``(batch, length)``; position ``t`` sees ``<= t``.

        Raises:
          ValueError: tokens that are not ``(batch, length)``, or longer than ``max_length``.
        """
        if tokens.ndim != 2:
            raise ValueError(f"GPT takes tokens of shape (batch, length), got shape {tokens.shape}.")
        length = tokens.shape[1]
        if length > self.max_length:
            raise ValueError(
                f"The sequences hold {length} tokens, but this GPT has positions for max_length={self.max_length}. "
                f"Build it with max_length >= {length}, or cut the sequences shorter."
            )
        keys = [None] * (len(self.blocks) + 1) if rngs is None else list(jax.random.split(rngs, len(self.blocks) + 1))
        x = self.embed(tokens) + self.position[:length][None]
        x = constrain(_dropout(x, self.dropout_rate, keys[0]), RESIDUAL)
        for block, key in zip(self.blocks, keys[1:], strict=True):
            x = block(x, self.heads, self.dropout_rate, key)
        return constrain(self.head(self.norm(x)), ("batch", "norm_length", "vocab"))  # a token at a time, as norms


class _CausalBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
        self.attn_norm = _layer_norm(dim, "embed", rngs)
        self.query = _dense(dim, dim, "embed", "heads", rngs, kernel_init=_INIT)
        # No bias for keys: q . (k + b) adds the same q . b to every logit of a row, which softmax removes.
        self.key = _dense(dim, dim, "embed", "heads", rngs, use_bias=False, kernel_init=_INIT)
        self.value = _dense(dim, dim, "embed", "heads", rngs, kernel_init=_INIT)
        self.out = _dense(dim, dim, "heads", "embed", rngs, kernel_init=_INIT)
        self.mlp_norm = _layer_norm(dim, "embed", rngs)
        self.mlp_in = _dense(dim, mlp_dim, "embed", "mlp", rngs, kernel_init=_INIT)
        self.mlp_out = _dense(mlp_dim, dim, "mlp", "embed", rngs, kernel_init=_INIT)

    def __call__(self, x: jax.Array, heads: int, rate: float, key: jax.Array | None) -> jax.Array:
        batch, length, dim = x.shape
        keys = [None, None] if key is None else list(jax.random.split(key))
        # gather_columns and scatter_rows are the layers themselves, or Megatron's sequence-parallel edges
        # (all-gather of the tokens in, reduce-scatter out) under rules that split the residual stream.
        projected = gather_columns(self.attn_norm(x), (self.query, self.key, self.value), "heads")
        q, k, v = (
            constrain(y.reshape(batch, length, heads, dim // heads), ("batch", "length", "heads", None))
            for y in projected
        )
        attended = constrain(attention.attend(q, k, v, causal=True), ("batch", "length", "heads", None))
        x = x + _dropout(scatter_rows(attended.reshape(batch, length, dim), self.out, "heads"), rate, keys[0])
        x = constrain(x, RESIDUAL)
        (hidden,) = gather_columns(self.mlp_norm(x), (self.mlp_in,), "mlp")
        hidden = constrain(jax.nn.gelu(hidden), ("batch", "length", "mlp"))
        return constrain(x + _dropout(scatter_rows(hidden, self.mlp_out, "mlp"), rate, keys[1]), RESIDUAL)


def lm_loss(apply: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn(params, batch, **extras)``: mean next-token cross-entropy of a language model, with metrics.

    The batch is ``{"x": tokens, "y": targets}``, both integer ``(batch, length)``, where
    ``y[:, t]`` is the token after ``x[:, t]`` (what :func:`parallelkit.data.text` gives).
    Inputs and targets of one length split along the sequence the same way, which a
    batch holding only ``x`` (predicting ``x[:, 1:]`` from ``x[:, :-1]``) would not.
    The loss is the mean over every position of every sequence; the metrics are the
    ``accuracy`` of the most likely next token and the ``perplexity``, ``exp(loss)``.
    Extras are passed on as :func:`parallelkit.models.classifier_loss` passes them
    (``rng=`` turns dropout on).

    Conceptually, this is::

        logits = apply(params, batch["x"])  # (batch, length, vocab)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()  # over batch and length

    >>> from parallelkit.models import functional
    >>> apply, params = functional(GPT(256, max_length=8, dim=8, heads=2, depth=1, mlp_dim=8, rngs=nnx.Rngs(0)))
    >>> x = jnp.zeros((2, 8), jnp.int32)
    >>> loss, aux = lm_loss(apply)(params, {"x": x, "y": x})
    >>> sorted(aux)
    ['accuracy', 'perplexity']
    """
    classify = classifier_loss(apply)

    def loss_fn(params: dict, batch: dict, **extras):
        if "y" not in batch or batch["y"].shape != batch["x"].shape:
            got = f"shape {batch['y'].shape}" if "y" in batch else "no 'y'"
            raise ValueError(
                f"lm_loss needs targets batch['y'] of the shape of batch['x'] {batch['x'].shape}, the token after each "
                f"input token, but the batch has {got}. pk.data.text gives both."
            )
        loss, aux, *model_state = classify(params, batch, **extras)
        return (loss, {**aux, "perplexity": jnp.exp(loss)}, *model_state)

    return loss_fn
