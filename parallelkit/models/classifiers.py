"""The kit's classifiers (MLP, CNN, a small transformer, a scanned tower), their loss, and their layers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ..core.axes import constrain
from .functional import functional, graph_and_params, param_axes, record_axes, with_axes
from .layers.basic import apply_dropout, apply_layer, dense, layer_norm
from .layers.sequence import RESIDUAL, gather_columns, scatter_rows
from .recompute import active_recomputation, block_policy, maybe_remat, recompute_block, recompute_scores, remat_policy

Apply = Callable[[dict, jax.Array], jax.Array]


class MLP(nnx.Module):
    """Flatten, then Dense-ReLU layers, then a Dense classifier.

    The parameters declare their logical axes (:func:`parallelkit.models.param_axes`) in
    Megatron's alternation: the input is ``features``, the width after an even hidden layer
    ``mlp`` and after an odd one ``embed``, the logits ``classes``. With ``mlp`` split over
    devices, an even layer is split by columns, the next by rows, and the head by rows when
    it follows an even layer (replicated otherwise). ``remat`` (False, True for
    ``"nothing_saveable"``, or a policy name) wraps each hidden layer with
    :func:`parallelkit.models.remat` (:mod:`parallelkit.models.recompute` says what the compiler keeps).
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        num_classes: int,
        *,
        remat: bool | str = False,
        rngs: nnx.Rngs,
    ):
        sizes = [in_features, *hidden]
        names = ["features", *("mlp" if i % 2 == 0 else "embed" for i in range(len(hidden)))]
        self.hidden = nnx.List(
            [dense(sizes[i], sizes[i + 1], names[i], names[i + 1], rngs) for i in range(len(hidden))]
        )
        self.head = dense(sizes[-1], num_classes, names[-1], "classes", rngs)
        self.remat = remat_policy(remat)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        run = maybe_remat(lambda layer, x: jax.nn.relu(apply_layer(layer, x)), self.remat)
        for layer in self.hidden:
            x = run(layer, x)
        return apply_layer(self.head, x)

    def as_layers(self) -> Layers:
        """This MLP as layers for :class:`~parallelkit.Pipeline` (:func:`as_layers`): its Dense layers, ReLU after
        each hidden one, the first flattening ``batch["x"]``; as layers, ``remat`` is not applied."""
        linears = [*self.hidden, self.head]
        parts = [graph_and_params(layer) for layer in linears]

        def dense_layer(i: int):
            graphdef = parts[i][0]
            hidden = i < len(linears) - 1

            def apply(params: dict, x):
                if i == 0:
                    x = x["x"].reshape(x["x"].shape[0], -1)
                y = nnx.merge(graphdef, nnx.State(params))(x)
                return jax.nn.relu(y) if hidden else y

            return apply

        for linear, (_, params) in zip(linears, parts, strict=True):  # each layer's declared axes, for declared_axes
            record_axes(params, param_axes(linear))
        return Layers([dense_layer(i) for i in range(len(linears))], [params for _, params in parts])


class CNN(nnx.Module):
    """Two 3x3 conv-ReLU-avgpool blocks, then a Dense classifier (NHWC input); BatchNorm after each conv on request.

    With ``batch_norm=True`` each conv is followed by ``nnx.BatchNorm``: in training it
    normalises with the statistics of the batch it sees and updates running averages
    (the model's mutable state, see :func:`from_nnx`). ``bn_axis_name`` makes it
    average those statistics over a ``pmap``/``shard_map`` axis (SyncBatchNorm); under
    ``jax.jit`` with a sharded batch the batch *is* the global batch, so it is synced already.

    The parameters declare their logical axes: the channels between the first two convolutions
    are ``hidden_channels`` (Megatron's column and row split when that name is split over
    devices), every other channel axis ``channels``, the kernel's window ``None``, the logits
    ``classes``; BatchNorm's scale and bias declare none (replicated).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (8, 16),
        *,
        batch_norm: bool = False,
        bn_axis_name: str | None = None,
        rngs: nnx.Rngs,
    ):
        height, width, in_channels = input_shape
        chans = [in_channels, *channels]
        names = ["hidden_channels" if i == 1 else "channels" for i in range(len(chans))]
        self.convs = nnx.List(
            [_conv(chans[i], chans[i + 1], names[i], names[i + 1], rngs) for i in range(len(channels))]
        )
        self.norms = (
            nnx.List([nnx.BatchNorm(c, momentum=0.9, axis_name=bn_axis_name, rngs=rngs) for c in chans[1:]])
            if batch_norm
            else None
        )
        pooled = math.ceil(height / 2 ** len(channels)) * math.ceil(width / 2 ** len(channels))
        self.head = dense(pooled * chans[-1], num_classes, "features", "classes", rngs)

    def __call__(self, x: jax.Array, *, train: bool = True) -> jax.Array:
        for i, conv in enumerate(self.convs):
            x = apply_layer(conv, x)
            if self.norms is not None:
                x = self.norms[i](x, use_running_average=not train)
            x = nnx.avg_pool(jax.nn.relu(x), (2, 2), strides=(2, 2), padding="SAME")
        return apply_layer(self.head, x.reshape(x.shape[0], -1))


def _conv(channels_in: int, channels_out: int, axis_in: str, axis_out: str, rngs: nnx.Rngs) -> nnx.Conv:
    """A 3x3 ``nnx.Conv`` whose kernel declares ``(None, None, axis_in, axis_out)`` and its bias ``(axis_out,)``."""
    return nnx.Conv(
        channels_in,
        channels_out,
        (3, 3),
        kernel_init=with_axes(nnx.initializers.lecun_normal(), (None, None, axis_in, axis_out)),
        bias_init=with_axes(nnx.initializers.zeros_init(), (axis_out,)),
        rngs=rngs,
    )


class Transformer(nnx.Module):
    """A small pre-norm transformer classifier: embedding, attention + MLP blocks, layer norm, dropout.

    An image of ``rows x cols x channels`` is read as a sequence of ``rows`` tokens,
    one per pixel row (the embedding is a Dense layer over a row), plus a learned
    position embedding. Each block is ``x + Attention(LayerNorm(x))`` then
    ``x + MLP(LayerNorm(x))``, with dropout on both branches; the classifier reads
    the mean over the tokens. Attention keeps separate ``query``, ``key``, ``value``
    and ``out`` Dense layers so that its heads are contiguous column blocks, which is
    what a tensor-parallel rule splits.

    Activations name their axes with :func:`parallelkit.core.axes.constrain` (``batch``,
    ``length``, ``embed``, ``heads``, ``mlp``; the residual stream's length, where the layer
    norms, dropout and residual adds act, is ``norm_length``, as in :class:`parallelkit.models.GPT`):
    under :class:`parallelkit.SPMD` rules that map ``length`` (and ``norm_length``) to ``seq`` the
    tokens are split over that mesh axis; elsewhere the calls do nothing. The split layers are
    called through :mod:`parallelkit.models.layers.sequence`, so ``TensorParallel(k, sequence_parallel=True)``
    splits the residual stream along the tokens (Megatron's sequence parallelism).

    The parameters declare their logical axes: ``query``, ``key`` and ``value`` kernels
    ``("embed", "heads")``, ``out`` ``("heads", "embed")``, ``mlp_in`` ``("embed", "mlp")``,
    ``mlp_out`` ``("mlp", "embed")``, biases and layer norms their output axis, the embedding
    ``("features", "embed")``, the positions ``("length", "embed")``, the head
    ``("embed", "classes")``. With ``heads`` and ``mlp`` split over devices this is Megatron's
    split of attention and of the MLP.

    Dropout is active when ``rngs`` (a PRNG key) is passed to ``__call__``. ``remat`` (False,
    True for ``"nothing_saveable"``, or a policy name) wraps each block with
    :func:`parallelkit.models.remat` (:mod:`parallelkit.models.recompute` says what the compiler keeps).
    With ``remat=False`` the blocks recompute as the active :func:`~parallelkit.models.recomputation`
    says (``"selective"``: the attention weights, dropout included; ``"full"``: each block); a model built
    with ``remat`` refuses any recomputation besides ``"none"``, when the step is traced.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        *,
        dim: int = 32,
        heads: int = 4,
        depth: int = 2,
        mlp_dim: int = 64,
        dropout: float = 0.1,
        remat: bool | str = False,
        rngs: nnx.Rngs,
    ):
        rows = input_shape[0]
        token = math.prod(input_shape[1:])
        self.heads, self.dropout_rate, self.remat = heads, dropout, remat_policy(remat)
        self.embed = dense(token, dim, "features", "embed", rngs)
        self.position = nnx.Param(
            with_axes(nnx.initializers.normal(0.02), ("length", "embed"))(rngs.params(), (rows, dim))
        )
        self.blocks = nnx.List([_Block(dim, heads, mlp_dim, rngs=rngs) for _ in range(depth)])
        self.norm = layer_norm(dim, "embed", rngs)
        self.head = dense(dim, num_classes, "embed", "classes", rngs)

    def __call__(self, x: jax.Array, *, rngs: jax.Array | None = None) -> jax.Array:
        x = x.reshape(x.shape[0], x.shape[1], -1)  # (batch, tokens, features of a token)
        x = constrain(apply_layer(self.embed, x) + self.position[None], RESIDUAL)
        keys = [None] * len(self.blocks) if rngs is None else list(jax.random.split(rngs, len(self.blocks)))
        run = maybe_remat(lambda block, x, key: block(x, self.heads, self.dropout_rate, key), self._block_policy())
        for block, key in zip(self.blocks, keys, strict=True):
            x = run(block, x, key)
        return apply_layer(self.head, self.norm(x).mean(axis=1))

    def _block_policy(self) -> str | None:
        """The blocks' policy: the model's ``remat``, or the active recomputation's; both at once are refused."""
        layout = active_recomputation()
        if self.remat is not None and layout != "none":
            raise ValueError(
                f"Transformer(remat={self.remat!r}) and recomputation {layout!r} both choose what the blocks "
                "recompute: build the model with remat=False to let the strategy choose, or recompute 'none'."
            )
        return self.remat or block_policy(layout)

    def as_layers(self) -> Layers:
        """This transformer as layers for :class:`~parallelkit.Pipeline` (:func:`as_layers`): the embedding with
        the positions, each block, and the final norm with the head. As layers it runs without dropout and
        ``remat`` is not applied; its blocks recompute as the active :func:`~parallelkit.models.recomputation` says."""
        return stack_layers(
            self,
            lambda embed, position, x: embed(x.reshape(x.shape[0], x.shape[1], -1)) + position[None],
            lambda block, x: block(x, self.heads, 0.0, None),
            lambda x: x.mean(axis=1),
        )


class _Block(nnx.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
        self.attn_norm = layer_norm(dim, "embed", rngs)
        # No bias for keys: q . (k + b) adds the same q . b to every logit of a row, which softmax
        # removes, so such a bias would get a zero gradient and never learn.
        self.query, self.value = dense(dim, dim, "embed", "heads", rngs), dense(dim, dim, "embed", "heads", rngs)
        self.key = dense(dim, dim, "embed", "heads", rngs, use_bias=False)
        self.out = dense(dim, dim, "heads", "embed", rngs)
        self.mlp_norm = layer_norm(dim, "embed", rngs)
        self.mlp_in = dense(dim, mlp_dim, "embed", "mlp", rngs)
        self.mlp_out = dense(mlp_dim, dim, "mlp", "embed", rngs)

    def __call__(self, x: jax.Array, heads: int, rate: float, key: jax.Array | None) -> jax.Array:
        batch, tokens, dim = x.shape
        keys = [None] * 3 if key is None else list(jax.random.split(key, 3))
        q, k, v = project_heads(self, x, heads)
        attend = recompute_scores(lambda q, k, v, key: _attend(q, k, v, key, rate))  # the rate bound, not traced
        attended = attend(q, k, v, keys[0]).reshape(batch, tokens, dim)
        x = constrain(x + apply_dropout(scatter_rows(attended, self.out, "heads"), rate, keys[1]), RESIDUAL)
        return constrain(x + apply_dropout(feed_forward(self, x), rate, keys[2]), RESIDUAL)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, key: jax.Array | None, rate: float) -> jax.Array:
    """Every token's attention to every token, with dropout (rate ``rate``, from ``key``) on the softmax weights."""
    weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", apply_dropout(weights, rate, key), v)


def project_heads(block: nnx.Module, x: jax.Array, heads: int) -> tuple[jax.Array, ...]:
    """The queries, keys and values ``(batch, length, heads, head_dim)`` of a transformer's or GPT's ``block``."""
    batch, length, dim = x.shape
    projected = gather_columns(block.attn_norm(x), (block.query, block.key, block.value), "heads")
    return tuple(
        constrain(y.reshape(batch, length, heads, dim // heads), ("batch", "length", "heads", None)) for y in projected
    )


def feed_forward(block: nnx.Module, x: jax.Array) -> jax.Array:
    """The MLP branch of a transformer's or GPT's ``block``: ``mlp_norm``, ``mlp_in``, GELU, ``mlp_out``."""
    (hidden,) = gather_columns(block.mlp_norm(x), (block.mlp_in,), "mlp")
    hidden = constrain(jax.nn.gelu(hidden), ("batch", "length", "mlp"))
    return scatter_rows(hidden, block.mlp_out, "mlp")


class Tower(nnx.Module):
    """An embedding, ``depth`` equal residual layers stacked in one array and run by a scan, and a head.

    The layers' kernels are one ``(depth, width, width)`` parameter (their biases one
    ``(depth, width)``), and ``jax.lax.scan`` runs them one layer's weights at a time:
    each layer is ``x + tanh(x @ kernel[i] + bias[i])``. This is how large models are
    written for fully sharded training: the compiled program holds one layer's gathered
    weights at a time instead of every layer's (notebook 07 measures the difference
    against :class:`MLP`, whose layers are separate leaves in an unrolled loop).
    ``remat=True`` wraps each layer with :func:`parallelkit.models.remat` under the
    ``nothing_saveable`` policy: the backward pass recomputes the layer's activations
    instead of keeping them; a policy name (``remat="dots_saveable"``) chooses another
    policy. All give the same numbers. Its parameters declare no logical axes.
    """

    def __init__(
        self,
        in_features: int,
        width: int,
        depth: int,
        num_classes: int,
        *,
        remat: bool | str = False,
        rngs: nnx.Rngs,
    ):
        self.remat = remat_policy(remat)
        self.embed = nnx.Linear(in_features, width, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.kernels = nnx.Param(
            jax.vmap(lambda key: init(key, (width, width)))(jax.random.split(rngs.params(), depth))
        )
        self.biases = nnx.Param(jnp.zeros((depth, width)))
        self.head = nnx.Linear(width, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        def layer(x: jax.Array, weights: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            kernel, bias = weights
            return x + jnp.tanh(x @ kernel + bias), None

        x = self.embed(x.reshape(x.shape[0], -1))
        x, _ = jax.lax.scan(maybe_remat(layer, self.remat), x, (self.kernels[...], self.biases[...]))
        return apply_layer(self.head, x)


def classifier_loss(apply: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_fn(params, batch, **extras)``: mean cross-entropy and accuracy for ``{"x", "y"}`` batches.

    Without extras it returns ``(loss, {"accuracy": ...})``. A strategy whose state
    carries a PRNG key passes ``rng=`` (forwarded to ``apply``, for dropout); one whose
    state carries model state passes ``model_state=`` and gets
    ``(loss, {"accuracy": ...}, new_model_state)`` back.
    """

    def loss_fn(params: dict, batch: dict, **extras):
        out = apply(params, batch["x"], **extras)
        logits, new_state = out if "model_state" in extras else (out, None)
        loss, aux = cross_entropy(logits, batch)
        return (loss, aux, new_state) if "model_state" in extras else (loss, aux)

    return loss_fn


def cross_entropy(logits: jax.Array, batch: dict) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy of ``logits`` against ``batch["y"]``, and the accuracy: a pipeline's ``head_loss``.

    >>> loss, aux = cross_entropy(jnp.array([[0.0, 9.0]]), {"y": jnp.array([1])})
    >>> round(float(loss), 4), float(aux["accuracy"])
    (0.0001, 1.0)

    Raises:
      TypeError: labels that are not integers (float or one-hot labels).
    """
    labels = jnp.result_type(batch["y"])
    if not jnp.issubdtype(labels, jnp.integer):
        raise TypeError(
            f"Labels must be integer class ids (0 to {logits.shape[-1] - 1}, one per example), but batch['y'] holds "
            f"{labels} values. Convert them with y.astype(np.int32), or one-hot rows with y.argmax(-1)."
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


class Layers(NamedTuple):
    """A model as layers, ``apply_i(params_i, x) -> y``, and their parameters (for :class:`~parallelkit.Pipeline`)."""

    apply: list[Callable[[Any, Any], Any]]
    params: list[dict]


def as_layers(module: Any) -> Layers:
    """The kit's :class:`MLP`, :class:`Transformer` or :class:`~parallelkit.models.GPT` as a list of layers,
    each with its own parameters: ``module.as_layers()``, for a model that has that method.

    The first layer takes a batch ``{"x", ...}`` and reads ``batch["x"]``; each later layer
    takes the previous one's output; the last gives the logits, for :func:`cross_entropy`.
    Composed in order (:func:`parallelkit.strategies.pipeline.sequential_loss`) they compute the
    module's own logits. Each model's method says what its layers are (:meth:`MLP.as_layers`,
    :meth:`Transformer.as_layers`, :meth:`parallelkit.models.GPT.as_layers`).

    >>> layers, params = as_layers(MLP(4, (8,), 2, rngs=nnx.Rngs(0)))
    >>> len(layers), sorted(params[0])
    (2, ['bias', 'kernel'])

    Raises:
      TypeError: a module without an ``as_layers()`` method (write its layers as functions instead).
    """
    if callable(getattr(module, "as_layers", None)):
        return module.as_layers()
    raise TypeError(
        f"as_layers knows the kit's MLP, Transformer and GPT, not {type(module).__name__}: write the model as a list "
        "of functions apply_i(params_i, x) -> y with a list of their parameters."
    )


def stack_layers(module: nnx.Module, embedding: Callable, run_block: Callable, pool: Callable) -> Layers:
    """A :class:`Transformer` or GPT as :func:`as_layers` gives it: ``embedding(embed, position, batch["x"])``,
    ``run_block(block, x)`` for each block, and the head on ``pool`` of the final norm's output."""
    (embed, embed_params), (norm, norm_params), (head, head_params) = map(
        graph_and_params, (module.embed, module.norm, module.head)
    )

    def embed_layer(params: dict, batch: dict) -> jax.Array:
        return embedding(nnx.merge(embed, nnx.State(params["embed"])), params["position"], batch["x"])

    def block_layer(graphdef):
        return lambda params, x: recompute_block(run_block)(nnx.merge(graphdef, nnx.State(params)), x)

    def classify(params: dict, x: jax.Array) -> jax.Array:
        x = pool(nnx.merge(norm, nnx.State(params["norm"]))(x))
        return nnx.merge(head, nnx.State(params["head"]))(x)

    blocks = [graph_and_params(block) for block in module.blocks]
    params = [
        {"embed": embed_params, "position": module.position[...]},
        *(params for _, params in blocks),
        {"norm": norm_params, "head": head_params},
    ]
    axes = param_axes(module)  # each layer's declared logical axes, found again by declared_axes
    declared = [
        {"embed": axes["embed"], "position": axes["position"]},
        *(axes["blocks"][i] for i in range(len(blocks))),
        {"norm": axes["norm"], "head": axes["head"]},
    ]
    for layer_params, layer_axes in zip(params, declared, strict=True):
        record_axes(layer_params, layer_axes)
    return Layers([embed_layer, *(block_layer(graphdef) for graphdef, _ in blocks), classify], params)


def build(name: str, input_shape: Sequence[int], num_classes: int, seed: int = 0) -> tuple[Apply, dict]:
    """A named model ("mlp", "cnn" or "transformer"), initialised from ``seed``, in functional form.

    The transformer has dropout (pass ``rng=`` to ``apply`` to turn it on); for a model
    with BatchNorm, use ``from_nnx(CNN(..., batch_norm=True, rngs=...))``.

    >>> apply, params = build("mlp", (8, 8, 1), 10)
    >>> apply(params, jax.numpy.zeros((2, 8, 8, 1))).shape
    (2, 10)
    """
    rngs = nnx.Rngs(seed)
    if name == "mlp":
        return functional(MLP(math.prod(input_shape), (64,), num_classes, rngs=rngs))
    if name == "cnn":
        return functional(CNN(input_shape, num_classes, rngs=rngs))
    if name == "transformer":
        return functional(Transformer(input_shape, num_classes, rngs=rngs))
    raise ValueError(f"Unknown model {name!r}: choose 'mlp', 'cnn' or 'transformer'.")
