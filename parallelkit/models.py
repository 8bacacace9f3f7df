"""Small Flax (NNX) models, and a functional view that strategies can train.

Strategies work on plain parameter pytrees and ``loss_fn(params, batch)``, so an
NNX module is split once into a static graph and a dict of arrays::

    model = pk.models.MLP(64, (128,), 10, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    logits = apply(params, x)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import optax
from flax import nnx

Apply = Callable[[dict, jax.Array], jax.Array]


class MLP(nnx.Module):
    """Flatten, then Dense-ReLU layers, then a Dense classifier."""

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int, *, rngs: nnx.Rngs):
        sizes = [in_features, *hidden]
        self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:], strict=True)])
        self.head = nnx.Linear(sizes[-1], num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for layer in self.hidden:
            x = jax.nn.relu(layer(x))
        return self.head(x)


class CNN(nnx.Module):
    """Two 3x3 conv-ReLU-avgpool blocks, then a Dense classifier (NHWC input)."""

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (8, 16), *, rngs: nnx.Rngs
    ):
        height, width, in_channels = input_shape
        chans = [in_channels, *channels]
        self.convs = nnx.List([nnx.Conv(a, b, (3, 3), rngs=rngs) for a, b in zip(chans[:-1], chans[1:], strict=True)])
        pooled = math.ceil(height / 2 ** len(channels)) * math.ceil(width / 2 ** len(channels))
        self.head = nnx.Linear(pooled * chans[-1], num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for conv in self.convs:
            x = nnx.avg_pool(jax.nn.relu(conv(x)), (2, 2), strides=(2, 2), padding="SAME")
        return self.head(x.reshape(x.shape[0], -1))


def functional(module: nnx.Module) -> tuple[Apply, dict]:
    """Split ``module`` into ``apply(params, x)`` and its parameters as a plain nested dict."""
    graphdef, state = nnx.split(module)

    def apply(params: dict, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, nnx.State(params))(x)

    return apply, nnx.to_pure_dict(state)


def classifier_loss(apply: Apply) -> Callable[[dict, dict], tuple[jax.Array, dict]]:
    """``loss_fn(params, batch) -> (mean cross-entropy, {"accuracy": ...})`` for ``{"x", "y"}`` batches."""

    def loss_fn(params: dict, batch: dict) -> tuple[jax.Array, dict]:
        logits = apply(params, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    return loss_fn


def build(name: str, input_shape: Sequence[int], num_classes: int, seed: int = 0) -> tuple[Apply, dict]:
    """A named model ("mlp" or "cnn"), initialised from ``seed``, in functional form.

    >>> apply, params = build("mlp", (8, 8, 1), 10)
    >>> apply(params, jax.numpy.zeros((2, 8, 8, 1))).shape
    (2, 10)
    """
    rngs = nnx.Rngs(seed)
    if name == "mlp":
        return functional(MLP(math.prod(input_shape), (64,), num_classes, rngs=rngs))
    if name == "cnn":
        return functional(CNN(input_shape, num_classes, rngs=rngs))
    raise ValueError(f"Unknown model {name!r}: choose 'mlp' or 'cnn'.")


def param_bytes(params: dict) -> int:
    """Total bytes of a parameter tree (what one full gradient all-reduce carries)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
