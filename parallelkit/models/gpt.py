"""A small causal language model (:class:`GPT`) and its next-token loss (:func:`lm_loss`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..core.axes import constrain
from ..core.types import is_count
from .classifiers import Layers, cross_entropy, feed_forward, project_heads, stack_layers
from .functional import with_axes
from .layers import attention
from .layers.basic import apply_dropout, apply_layer, dense, layer_norm
from .layers.experts import check_routing, moe_layer
from .layers.sequence import RESIDUAL, scatter_rows
from .recompute import recompute_block

_INIT = nnx.initializers.normal(0.02)  # GPT-2's initialisation of every weight matrix and embedding
_LOAD_BALANCING = 0.01  # the weight of the load-balancing loss (the Switch Transformer's alpha)


class GPT(nnx.Module):
    """A decoder-only transformer: token and position embeddings, pre-norm causal blocks, layer norm, head.

    Each of the ``depth`` blocks is ``x + Attention(LayerNorm(x))`` then
    ``x + MLP(LayerNorm(x))`` (GELU), with causal self-attention computed by
    :func:`parallelkit.models.layers.attention.attend` on ``(batch, length, heads, head_dim)`` arrays.
    The output head is a Dense layer of its own (not tied to the token embedding), so
    the embedding and the head can be split differently. Dropout (rate ``dropout``) acts
    on the embeddings and on the output of both branches of every block (not on the
    attention weights, which stay inside ``attend``) when ``rngs`` (a PRNG key) is passed
    to ``__call__``; each block draws from its own key split from it. Inside a
    :func:`~parallelkit.models.recomputation` block, open while the step is traced, the backward pass
    recomputes attention's scores and probabilities (``"selective"``) or each whole block (``"full"``).

    With ``experts > 0`` the model is a mixture of experts: the MLP of every block (as in
    Mixtral; GShard replaces every other one) is
    :func:`parallelkit.models.layers.experts.moe_layer` over ``experts`` feed-forward networks of width
    ``mlp_dim`` (GELU), each token sent to its ``top_k`` experts within
    ``capacity_factor``, its tokens routed in ``groups`` equal groups. ``__call__`` then
    returns ``(logits, aux)``, where ``aux`` holds each MoE block's ``load_balancing_loss``,
    ``router_z_loss`` and ``dropped_fraction`` (shape ``(depth,)``), ``tokens_per_expert``
    and ``kept_per_expert`` (``(depth, experts)``), which :func:`lm_loss` adds to the loss
    and the metrics. Under :class:`~parallelkit.ExpertParallel` the layer exchanges tokens by
    all-to-all and needs ``groups`` equal to the devices the tokens are split over.

    Logical axes: the token embedding is ``("vocab", "embed")``, the positions
    ``(None, "embed")``, the query, key and value kernels ``("embed", "heads")``, the
    attention output ``("heads", "embed")``, the MLP ``("embed", "mlp")`` and
    ``("mlp", "embed")``, the head ``("embed", "vocab")``, each bias its output axis,
    and the layer norms' scales and biases ``("embed",)``. With experts, the router is
    ``("embed", None)`` and the experts' weights ``("expert", "embed", "mlp")`` and
    ``("expert", "mlp", "embed")``, their biases ``("expert", "mlp")`` and ``("expert", "embed")``.
    Activations: the residual stream (the embeddings and every block's input and output, where
    the layer norms, dropout and residual adds act) is ``("batch", "norm_length", "embed")``
    (MaxText's ``activation_norm_length``), so rules can split it where attention and the MLP
    see whole sequences (Megatron's sequence parallelism, :mod:`parallelkit.models.layers.sequence`);
    queries, keys, values and attention's output ``("batch", "length", "heads", None)``, the
    MLP's hidden units ``("batch", "length", "mlp")``, and the logits
    ``("batch", "norm_length", "vocab")`` (the final norm and the head act on each token alone,
    as the residual stream's layers do).

    >>> model = GPT(256, max_length=16, dim=32, heads=4, depth=1, mlp_dim=64, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
    >>> moe = GPT(256, max_length=16, dim=32, heads=4, depth=1, mlp_dim=64, experts=4, rngs=nnx.Rngs(0))
    >>> logits, aux = moe(jnp.zeros((2, 16), jnp.int32))
    >>> logits.shape, aux["tokens_per_expert"].shape
    ((2, 16, 256), (1, 4))

    Raises:
      ValueError: ``dim`` that ``heads`` does not divide; with experts, ``top_k`` outside
        ``1..experts``, ``capacity_factor <= 0``, or ``groups`` that is not a whole number >= 1.
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
        experts: int = 0,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        groups: int = 1,
        rngs: nnx.Rngs,
    ):
        if dim % heads:
            raise ValueError(f"dim={dim} must divide into heads={heads} equal heads: choose a multiple of {heads}.")
        if experts:  # MoE settings that cannot route, said in the model's own words
            if not is_count(experts):
                raise ValueError(
                    f"GPT(experts={experts!r}): give a whole number of experts >= 1 (or 0 for a dense MLP)."
                )
            check_routing(experts, top_k, capacity_factor)
            if not is_count(groups):
                raise ValueError(
                    f"GPT(groups={groups!r}): the tokens route in a whole number >= 1 of groups (under ExpertParallel, "
                    "the number of devices the tokens are split over)."
                )
        self.heads, self.max_length, self.dropout_rate = heads, max_length, dropout
        self.routing = dict(top_k=top_k, capacity_factor=capacity_factor, groups=groups) if experts else None
        self.embed = nnx.Embed(vocab, dim, embedding_init=with_axes(_INIT, ("vocab", "embed")), rngs=rngs)
        # Positions stay whole along the length: the model reads the table's first `length` rows, which
        # would move rows between devices if the table were split over the length and longer than the tokens.
        self.position = nnx.Param(with_axes(_INIT, (None, "embed"))(rngs.params(), (max_length, dim)))
        self.blocks = nnx.List([_CausalBlock(dim, heads, mlp_dim, experts, rngs=rngs) for _ in range(depth)])
        self.norm = layer_norm(dim, "embed", rngs)
        self.head = dense(dim, vocab, "embed", "vocab", rngs, kernel_init=_INIT)

    def __call__(self, tokens: jax.Array, *, rngs: jax.Array | None = None) -> jax.Array | tuple[jax.Array, dict]:
        """Logits ``(batch, length, vocab)`` for integer ``tokens`` ``(batch, length)``; position ``t`` sees ``<= t``.

        With experts, ``(logits, aux)``: the MoE layers' aux, stacked over the blocks.

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
        x = apply_layer(self.embed, tokens) + self.position[:length][None]
        x = constrain(apply_dropout(x, self.dropout_rate, keys[0]), RESIDUAL)
        layers = []
        run = recompute_block(lambda block, x, key: block(x, self.heads, self.dropout_rate, key, self.routing))
        for block, key in zip(self.blocks, keys[1:], strict=True):
            x, aux = run(block, x, key)
            layers.append(aux)
        # laid out a token at a time, as the norms are
        logits = constrain(apply_layer(self.head, self.norm(x)), ("batch", "norm_length", "vocab"))
        if self.routing is None:
            return logits
        return logits, {name: jnp.stack([aux[name] for aux in layers]) for name in _MOE_METRICS}

    def as_layers(self) -> Layers:
        """This GPT as layers for :class:`~parallelkit.Pipeline` (:func:`~parallelkit.models.as_layers`).

        The embedding (tokens ``batch["x"]`` and positions), each block, and the final norm with
        the head, whose logits :func:`~parallelkit.models.cross_entropy` scores against
        ``batch["y"]`` as :func:`lm_loss` does. As layers, the GPT runs without dropout; its blocks
        recompute as the active :func:`~parallelkit.models.recomputation` says.

        Raises:
          TypeError: a GPT with experts (its blocks return the router's aux as well).
        """
        if self.routing is not None:
            raise TypeError("A GPT with experts is not a list of layers (its blocks return the router's aux): "
                            "train it with pk.ExpertParallel, or build it without experts for a pipeline.")  # fmt: skip
        return stack_layers(
            self,
            lambda embed, position, tokens: embed(tokens) + position[: tokens.shape[1]][None],
            lambda block, x: block(x, self.heads, 0.0, None)[0],
            lambda x: x,
        )


# What the MoE GPT reports of each MoE layer: pk.experts.moe_layer's aux
_MOE_METRICS = ("load_balancing_loss", "router_z_loss", "dropped_fraction", "tokens_per_expert", "kept_per_expert")


class _CausalBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, experts: int = 0, *, rngs: nnx.Rngs):
        self.attn_norm = layer_norm(dim, "embed", rngs)
        self.query = dense(dim, dim, "embed", "heads", rngs, kernel_init=_INIT)
        # No bias for keys: q . (k + b) adds the same q . b to every logit of a row, which softmax removes.
        self.key = dense(dim, dim, "embed", "heads", rngs, use_bias=False, kernel_init=_INIT)
        self.value = dense(dim, dim, "embed", "heads", rngs, kernel_init=_INIT)
        self.out = dense(dim, dim, "heads", "embed", rngs, kernel_init=_INIT)
        self.mlp_norm = layer_norm(dim, "embed", rngs)
        if experts:
            self.moe = _Experts(dim, mlp_dim, experts, rngs=rngs)
        else:
            self.mlp_in = dense(dim, mlp_dim, "embed", "mlp", rngs, kernel_init=_INIT)
            self.mlp_out = dense(mlp_dim, dim, "mlp", "embed", rngs, kernel_init=_INIT)

    def __call__(
        self, x: jax.Array, heads: int, rate: float, key: jax.Array | None, routing: dict | None = None
    ) -> tuple[jax.Array, dict | None]:
        """The block's output, and the MoE layer's aux (None without experts)."""
        batch, length, dim = x.shape
        keys = [None, None] if key is None else list(jax.random.split(key))
        # gather_columns and scatter_rows are the layers themselves, or Megatron's sequence-parallel edges
        # (all-gather of the tokens in, reduce-scatter out) under rules that split the residual stream.
        q, k, v = project_heads(self, x, heads)
        attended = constrain(attention.attend(q, k, v, causal=True), attention.NAMES)
        x = x + apply_dropout(scatter_rows(attended.reshape(batch, length, dim), self.out, "heads"), rate, keys[0])
        x = constrain(x, RESIDUAL)
        if routing is None:
            out, aux = feed_forward(self, x), None
        else:
            out, aux = moe_layer(self.mlp_norm(x), self.moe.params(), **routing)
        return constrain(x + apply_dropout(out, rate, keys[1]), RESIDUAL), aux


class _Experts(nnx.Module):
    """The parameters of :func:`~parallelkit.models.layers.experts.moe_layer` as NNX parameters declaring their axes."""

    def __init__(self, dim: int, hidden: int, experts: int, *, rngs: nnx.Rngs):
        zeros = nnx.initializers.zeros_init()
        self.router = nnx.Param(with_axes(_INIT, ("embed", None))(rngs.params(), (dim, experts)))
        self.w_in = nnx.Param(with_axes(_INIT, ("expert", "embed", "mlp"))(rngs.params(), (experts, dim, hidden)))
        self.w_out = nnx.Param(with_axes(_INIT, ("expert", "mlp", "embed"))(rngs.params(), (experts, hidden, dim)))
        self.b_in = nnx.Param(with_axes(zeros, ("expert", "mlp"))(rngs.params(), (experts, hidden)))
        self.b_out = nnx.Param(with_axes(zeros, ("expert", "embed"))(rngs.params(), (experts, dim)))

    def params(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in ("router", "w_in", "w_out", "b_in", "b_out")}


def lm_loss(apply: Callable[..., Any], *, load_balancing: float = _LOAD_BALANCING) -> Callable[..., Any]:
    """``loss_fn(params, batch, **extras)``: mean next-token cross-entropy of a language model, with metrics.

    The batch is ``{"x": tokens, "y": targets}``, both integer ``(batch, length)``, where
    ``y[:, t]`` is the token after ``x[:, t]`` (what :func:`parallelkit.data.text` gives).
    Inputs and targets of one length split along the sequence the same way, which a
    batch holding only ``x`` (predicting ``x[:, 1:]`` from ``x[:, :-1]``) would not.
    The loss is the mean over every position of every sequence; the metrics are the
    ``accuracy`` of the most likely next token and the ``perplexity``, ``exp`` of the
    cross-entropy. Extras are passed on as :func:`parallelkit.models.classifier_loss`
    passes them (``rng=`` turns dropout on).

    For a mixture-of-experts model (one whose ``apply`` returns ``(logits, aux)``, as
    :class:`GPT` with ``experts`` does) the loss adds ``load_balancing`` times the
    load-balancing losses summed over the MoE blocks (0.01, the Switch Transformer's
    weight), and the metrics add the ``cross_entropy``, that sum as
    ``load_balancing_loss``, the mean over the blocks of the ``router_z_loss`` (reported,
    not added) and of the ``dropped_fraction``, ``tokens_per_expert``, ``(blocks, experts)``
    token-choices routed to each expert before capacity, and ``kept_per_expert``, those it kept.

    Conceptually, this is::

        logits = apply(params, batch["x"])  # (batch, length, vocab)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()  # over batch and length
        # with experts: logits, aux = apply(...); loss += load_balancing * aux["load_balancing_loss"].sum()

    >>> from parallelkit.models import functional
    >>> apply, params = functional(GPT(256, max_length=8, dim=8, heads=2, depth=1, mlp_dim=8, rngs=nnx.Rngs(0)))
    >>> x = jnp.zeros((2, 8), jnp.int32)
    >>> loss, aux = lm_loss(apply)(params, {"x": x, "y": x})
    >>> sorted(aux)
    ['accuracy', 'perplexity']
    """

    def loss_fn(params: dict, batch: dict, **extras):
        if "y" not in batch or batch["y"].shape != batch["x"].shape:
            got = f"shape {batch['y'].shape}" if "y" in batch else "no 'y'"
            raise ValueError(
                f"lm_loss needs targets batch['y'] of the shape of batch['x'] {batch['x'].shape}, the token after each "
                f"input token, but the batch has {got}. pk.data.text gives both."
            )
        out = apply(params, batch["x"], **extras)
        out, new_state = out if "model_state" in extras else (out, None)
        logits, moe = out if isinstance(out, tuple) else (out, None)
        loss, aux = cross_entropy(logits, batch)
        aux["perplexity"] = jnp.exp(loss)
        if moe is not None:
            balance = jnp.sum(moe["load_balancing_loss"])
            aux |= {
                "cross_entropy": loss,
                "load_balancing_loss": balance,
                "router_z_loss": jnp.mean(moe["router_z_loss"]),
                "dropped_fraction": jnp.mean(moe["dropped_fraction"]),
                "tokens_per_expert": moe["tokens_per_expert"],
                "kept_per_expert": moe["kept_per_expert"],
            }
            loss = loss + load_balancing * balance
        return (loss, aux, new_state) if "model_state" in extras else (loss, aux)

    return loss_fn
