"""Small Flax (NNX) models, and the functional view (``apply``, ``params``) that strategies train."""

from ..core.contract import tree_bytes as param_bytes
from . import layers
from .classifiers import (
    CNN,
    MLP,
    Apply,
    Layers,
    Tower,
    Transformer,
    as_layers,
    build,
    classifier_loss,
    cross_entropy,
)
from .functional import Functional, declared_axes, from_nnx, functional, param_axes, with_axes
from .gpt import GPT, lm_loss
from .megatron import megatron_cnn_rules, megatron_mlp_rules, megatron_transformer_rules
from .recompute import RECOMPUTE, active_recomputation, block_policy, recomputation, remat

__all__ = [
    "CNN", "GPT", "MLP", "RECOMPUTE", "Apply", "Functional", "Layers", "Tower", "Transformer",
    "active_recomputation", "as_layers", "block_policy", "build", "classifier_loss", "cross_entropy", "declared_axes",
    "from_nnx", "functional", "layers", "lm_loss", "megatron_cnn_rules", "megatron_mlp_rules",
    "megatron_transformer_rules", "param_axes", "param_bytes", "recomputation", "remat", "with_axes",
]  # fmt: skip
