"""Megatron's sequence parallelism (TensorParallel / Hybrid with sequence_parallel=True): equal to one device,
and each block's all-reduce written as a reduce-scatter and an all-gather, read from the compiled step."""

from __future__ import annotations

import collections

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import small_gpt, tree_allclose
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit.models.layers.sequence import gather_columns, scatter_rows
from parallelkit.strategies.tensor import SEQUENCE_PARALLEL

LENGTH, BATCH, STEPS, DEPTH, DIM = 32, 4, 10, 2, 32
OPTIMIZER = optax.sgd(0.1, momentum=0.9)  # not Adam: see tests/test_context_parallel.py


@pytest.fixture(scope="module")
def corpus() -> pk.data.Dataset:
    return pk.data.text(length=LENGTH, max_bytes=20_000)


def _train(strategy, dropout: float, corpus, accumulate: int = 1) -> dict:
    loss_fn, params = small_gpt(LENGTH, dim=DIM, depth=DEPTH, dropout=dropout)
    state = strategy.init(params, OPTIMIZER, rng=0 if dropout else None)
    step = strategy.step(loss_fn, accumulate=accumulate)
    for batch in pk.data.batches(corpus, BATCH, steps=STEPS):
        state, _ = step(state, batch)
    return strategy.unreplicate(state.params)


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_tensor_parallel_with_sequence_parallelism_trains_the_gpt_as_one_device(corpus, dropout):
    """10 steps, SingleDevice's parameters (float32 tolerance); with dropout the step's key draws the masks for
    the global batch under jit, as on one device, so the same tolerance holds."""
    reference = _train(pk.SingleDevice(), dropout, corpus)
    tree_allclose(_train(pk.TensorParallel(2, sequence_parallel=True, devices=jax.devices()[:2]), dropout, corpus),
                  reference)  # fmt: skip
    if not dropout:  # and within data-parallel groups, once, each replica's rows as 2 microbatches
        hybrid = pk.Hybrid(2, 2, sequence_parallel=True, devices=jax.devices()[:4])
        tree_allclose(_train(hybrid, dropout, corpus, accumulate=2), reference)


def _activation_collectives(strategy, corpus) -> collections.Counter:
    """How many collectives of each kind the compiled step makes on (pieces of) the residual stream."""
    loss_fn, params = small_gpt(LENGTH, dim=DIM, depth=DEPTH)
    batch = next(pk.data.batches(corpus, BATCH, steps=1))
    found = pk.inspect.collectives(strategy.step(loss_fn), strategy.init(params, OPTIMIZER), batch)
    residual = {f"f32[{BATCH},{LENGTH},{DIM}]", f"f32[{BATCH},{LENGTH // 2},{DIM}]"}  # whole, or half the tokens
    return collections.Counter(c.op for c in found if set(c.shapes) <= residual)


def test_each_blocks_all_reduce_becomes_a_reduce_scatter_and_an_all_gather(corpus):
    """Plain tensor parallelism all-reduces the residual stream's partial sums: 2 per block forward (attention,
    MLP) and 2 backward. Sequence parallelism makes each a reduce-scatter, and all-gathers the tokens before
    each column-split layer (its transpose: the backward's all-gather before each row-split layer)."""
    devices = jax.devices()[:2]
    plain = _activation_collectives(pk.TensorParallel(2, devices=devices), corpus)
    assert plain["all-reduce"] >= 4 * DEPTH and plain["reduce-scatter"] == 0, plain  # fused pairs count once
    split = _activation_collectives(pk.TensorParallel(2, sequence_parallel=True, devices=devices), corpus)
    assert split["reduce-scatter"] == 4 * DEPTH and split["all-gather"] == 4 * DEPTH, split
    assert split["all-reduce"] == 0, split


def test_the_edges_are_the_layers_themselves_without_the_rules():
    layer = nnx.Linear(8, 12, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 4, 8))
    np.testing.assert_array_equal(gather_columns(x, [layer, layer], "heads")[1], layer(x))
    np.testing.assert_array_equal(scatter_rows(x, layer, "mlp"), layer(x))


def test_the_rule_set_and_its_option():
    assert SEQUENCE_PARALLEL.spec(("batch", "norm_length", "embed")) == P(None, "model", None)
    assert SEQUENCE_PARALLEL.spec(("batch", "length", "heads", None)) == P(None, None, "model", None)
    strategy = pk.TensorParallel(2, sequence_parallel=True, devices=jax.devices()[:2])
    assert repr(strategy) == "TensorParallel(model=2, sequence_parallel=True)"
    assert repr(pk.Hybrid(2, 2, sequence_parallel=True, devices=jax.devices()[:4])).endswith("sequence_parallel=True)")
    assert repr(pk.TensorParallel(2, devices=jax.devices()[:2])) == "TensorParallel(model=2)"


@pytest.mark.slow
def test_the_classifier_transformer_too(digits):
    """Its 8 tokens (pixel rows) split over 2 devices between blocks: one device's parameters after 5 steps with
    dropout, and a reduce-scatter for each of its blocks' 2 partial sums, forward and backward."""
    apply, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    loss_fn = pk.models.classifier_loss(apply)
    batches = list(pk.data.batches(digits, 16, steps=5))
    results = []
    for strategy in (pk.SingleDevice(), pk.TensorParallel(2, sequence_parallel=True, devices=jax.devices()[:2])):
        state, step = strategy.init(params, OPTIMIZER, rng=0), strategy.step(loss_fn)
        for batch in batches:
            state, _ = step(state, batch)
        results.append(strategy.unreplicate(state.params))
    tree_allclose(results[1], results[0])
    ops = collections.Counter(c.op for c in pk.inspect.collectives(step, state, batches[0]))
    assert ops["reduce-scatter"] == 4 * len(params["blocks"]), ops
