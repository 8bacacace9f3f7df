"""Megatron's tensor-parallel split of the kit's MLP, CNN and transformer, written out as partition rules.

Each function gives ``(regex, PartitionSpec)`` pairs for :class:`parallelkit.TensorParallel`'s
``rules=`` (:mod:`parallelkit.core.partition` says how rules match): the specs the model's own
declared logical axes give under ``TensorParallel``'s default, spelled out.

>>> megatron_cnn_rules()[0]
('^convs/0/kernel$', P(None, None, None, 'model'))
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from ..core.types import MODEL


def megatron_mlp_rules(hidden_layers: int) -> list[tuple[str, P]]:
    """Megatron-style rules for :class:`parallelkit.models.MLP` (layers ``hidden/i`` then ``head``).

    Layers alternate: an even layer is split by **columns** (each device computes a
    slice of the outputs, kernel ``P(None, "model")``, bias ``P("model")``), the next by
    **rows** (each device holds the input slice it produced and computes a partial
    sum, kernel ``P("model", None)``). After each row-split layer one all-reduce adds
    the partial sums, so a column/row pair costs one all-reduce forward and one
    backward (the backward one only where the block's input has a gradient to pass on,
    so not for the first block, whose input is the data). The head continues the
    alternation when it would be a row split, and is replicated otherwise. These are the
    specs the MLP's declared logical axes give under :class:`parallelkit.TensorParallel`.

    >>> megatron_mlp_rules(1)[-2:]
    [('^head/kernel$', P('model', None)), ('^head/bias$', P())]
    """
    rules = []
    for i in range(hidden_layers + 1):
        name = f"hidden/{i}" if i < hidden_layers else "head"
        if i % 2 == 0 and i < hidden_layers:  # column split; the head is never column split (its outputs are logits)
            rules += [(f"^{name}/kernel$", P(None, MODEL)), (f"^{name}/bias$", P(MODEL))]
        elif i % 2:
            rules += [(f"^{name}/kernel$", P(MODEL, None)), (f"^{name}/bias$", P())]
        else:
            rules += [(f"^{name}/kernel$", P()), (f"^{name}/bias$", P())]
    return rules


def megatron_cnn_rules() -> list[tuple[str, P]]:
    """Megatron's column/row pair on the first two convolutions of :class:`parallelkit.models.CNN`.

    ``convs/0`` is split by output channels (kernel ``P(None, None, None, "model")``),
    ``convs/1`` by input channels (kernel ``P(None, None, "model", None)``): each device
    convolves its own channels and one all-reduce adds the partial sums. The rest
    (later convolutions, BatchNorm, the head) is replicated. These are the specs the CNN's
    declared logical axes give under :class:`parallelkit.TensorParallel`.

    >>> megatron_cnn_rules()[0]
    ('^convs/0/kernel$', P(None, None, None, 'model'))
    """
    return [
        ("^convs/0/kernel$", P(None, None, None, MODEL)),
        ("^convs/0/bias$", P(MODEL)),
        ("^convs/1/kernel$", P(None, None, MODEL, None)),
        (".*", P()),
    ]


def megatron_transformer_rules() -> list[tuple[str, P]]:
    """Megatron-style rules for :class:`parallelkit.models.Transformer`; everything else replicated.

    Attention: ``query``, ``key`` and ``value`` split by columns, which splits the heads
    (head ``j`` is the ``j``-th block of columns), ``out`` by rows: one all-reduce after
    attention. The MLP: ``mlp_in`` by columns, ``mlp_out`` by rows: one all-reduce after
    it. Embedding, position, layer norms and the head stay replicated. These are the specs
    the transformer's declared logical axes give under :class:`parallelkit.TensorParallel`.
    """
    columns, rows = P(None, MODEL), P(MODEL, None)
    return [
        (r"/(query|key|value|mlp_in)/kernel$", columns),
        (r"/(query|key|value|mlp_in)/bias$", P(MODEL)),
        (r"/(out|mlp_out)/kernel$", rows),
        (".*", P()),
    ]
