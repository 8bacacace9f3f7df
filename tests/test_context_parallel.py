"""pk.ContextParallel: the GPT trained with its sequence split over devices equals one device, by every method."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import small_gpt, tree_allclose
from jax.sharding import PartitionSpec as P

import parallelkit as pk

LENGTH, BATCH, STEPS = 32, 4, 10
# Momentum SGD, not Adam: Adam's g / (sqrt(v) + 1e-8) turns the float rounding of near-zero gradients (summed in
# another order over the devices) into full-size updates, which then differ by more than the tolerance (seen
# here: 5x it on one of 8192 head weights after 10 steps, with equal dropout masks), though nothing is wrong.
OPTIMIZER = optax.sgd(0.1, momentum=0.9)
COLLECTIVE = {"allgather": "all-gather", "ring": "collective-permute", "ring_zigzag": "collective-permute",
              "ulysses": "all-to-all"}  # fmt: skip


@pytest.fixture(scope="module")
def corpus() -> pk.data.Dataset:
    return pk.data.text(length=LENGTH, max_bytes=20_000)


def _train(strategy, dropout: float, corpus) -> tuple:
    """10 steps from one key (dropout's masks drawn from it when ``dropout``): the parameters, the last step."""
    loss_fn, params = small_gpt(LENGTH, dropout=dropout)
    state = strategy.init(params, OPTIMIZER, rng=0 if dropout else None)
    step = strategy.step(loss_fn)
    for batch in pk.data.batches(corpus, BATCH, steps=STEPS):
        state, _ = step(state, batch)
    return strategy.unreplicate(state.params), step, state, batch


@pytest.fixture(scope="module")
def reference(corpus) -> dict[float, object]:
    return {dropout: _train(pk.SingleDevice(), dropout, corpus)[0] for dropout in (0.0, 0.1)}


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("method", ["allgather", "ring", "ring_zigzag", "ulysses"])
def test_each_method_trains_the_gpt_as_one_device(corpus, reference, method, dropout):
    """data=2 x seq=2: SingleDevice's parameters after 10 steps (float32 tolerance). With dropout the step's key
    draws the masks for the global batch under jit, as on one device, so "equal" is the same tolerance."""
    strategy = pk.ContextParallel(seq=2, method=method, data=2, devices=jax.devices()[:4])
    params, step, state, batch = _train(strategy, dropout, corpus)
    tree_allclose(params, reference[dropout])
    assert COLLECTIVE[method] in step.lower(state, batch).compile().as_text()


@pytest.mark.slow
def test_eight_devices_on_one_sequence(corpus, reference):
    """seq=8, the zig-zag ring: each device holds two chunks of 2 of the 32 tokens; still one device's parameters."""
    strategy = pk.ContextParallel(seq=8, method="ring_zigzag")
    assert dict(strategy.mesh.shape) == {"data": 1, "seq": 8}
    params, *_ = _train(strategy, 0.0, corpus)
    tree_allclose(params, reference[0.0])


def test_batch_arrays_split_over_data_then_seq_unless_named():
    strategy = pk.ContextParallel(seq=2, data=2, batch_axes={"w": ("batch",)}, devices=jax.devices()[:4])
    placed = strategy.place_batch({"x": np.zeros((4, 8), np.int32), "w": np.ones((4,), np.float32)})
    assert placed["x"].sharding.spec == P("data", "seq") and placed["w"].sharding.spec == P("data")
    assert {s.data.shape for s in placed["x"].addressable_shards} == {(2, 4)}
    assert strategy.num_replicas == 2
    plain = pk.ContextParallel(seq=2, data=2, devices=jax.devices()[:4])
    assert plain.place_batch(np.zeros((4, 8))).sharding.spec == P("data", "seq")  # not a dict: every array so
    with pytest.raises(ValueError, match="lays out batch arrays by name"):
        strategy.place_batch(np.zeros((4, 8)))


def test_parameters_replicated_or_by_rules():
    _, params = small_gpt(LENGTH)
    replicated = pk.ContextParallel(seq=4, devices=jax.devices()[:4])
    assert all(spec == P() for spec in jax.tree.leaves(replicated.partition_specs(params)))
    by_rules = pk.ContextParallel(seq=4, rules=[(r"mlp_in/kernel", P(None, "seq")), (".*", P())],
                                  devices=jax.devices()[:4])  # fmt: skip
    assert by_rules.partition_specs(params)["blocks"][0]["mlp_in"]["kernel"] == P(None, "seq")


def test_construction_and_repr():
    strategy = pk.ContextParallel(seq=4, method="ulysses")
    assert repr(strategy) == "ContextParallel(seq=4, method='ulysses', data=2)"
    assert strategy.pattern == "context_ulysses"
    with pytest.warns(pk.DeviceSubsetWarning, match="runs on 2 of the 8"):
        pk.ContextParallel(seq=2, data=1)


def test_bad_input_is_a_clear_error():
    with pytest.raises(pk.DeviceCountError, match="seq=16.*needs 16 devices, but 8 exist"):
        pk.ContextParallel(seq=16)
    with pytest.raises(pk.DeviceCountError, match="seq=4, data=4.*needs 16 devices"):
        pk.ContextParallel(seq=4, data=4)
    with pytest.raises(ValueError, match="Unknown attention method 'flash'.*'ring'"):
        pk.ContextParallel(seq=2, method="flash")
    with pytest.raises(ValueError, match=r"ContextParallel\(seq=0\)"):
        pk.ContextParallel(seq=0)
    strategy = pk.ContextParallel(seq=4, data=2)
    with pytest.raises(ValueError, match="sequence length 30 of batch array 'x' does not split over seq=4"):
        strategy.place_batch({"x": np.zeros((4, 30), np.int32), "y": np.zeros((4, 30), np.int32)})
    with pytest.raises(ValueError, match=r"'label' has shape \(4,\).*batch_axes=\{'label': \('batch',\)\}"):
        strategy.place_batch({"x": np.zeros((4, 32), np.int32), "label": np.zeros((4,), np.int32)})


def test_ulysses_with_heads_that_do_not_divide_is_a_clear_error(corpus):
    loss_fn, params = small_gpt(LENGTH)  # 4 heads
    strategy = pk.ContextParallel(seq=8, method="ulysses")
    state, batch = strategy.init(params, optax.sgd(0.1)), next(pk.data.batches(corpus, 2, steps=1))
    with pytest.raises(ValueError, match=r"4 head\(s\) do not divide by its 8 devices"):
        strategy.step(loss_fn)(state, batch)


def test_traffic_reads_the_batch_slice_and_the_rings_permutes(corpus):
    loss_fn, params = small_gpt(LENGTH)
    strategy = pk.ContextParallel(seq=4, data=2)
    batch = next(pk.data.batches(corpus, 4, steps=1))
    traffic = strategy.traffic(loss_fn, strategy.init(params, OPTIMIZER), batch)
    assert traffic.pattern == "context_ring" and traffic.replicas == 2
    sliced = traffic.flow("batch slice")
    assert sliced.measured == sliced.expected == 2 * 4 * LENGTH * 4 / 8  # x and y, int32, over data x seq
    assert traffic.flow("other collectives (collective-permute)").measured > 0


@pytest.mark.slow
def test_accumulation_splits_each_replicas_sequences_too(corpus):
    """accumulate=2 (each replica's rows as two microbatches, one sync): one device's step on the whole batch."""

    def run(strategy, accumulate):
        loss_fn, params = small_gpt(LENGTH)
        state, step = strategy.init(params, OPTIMIZER), strategy.step(loss_fn, accumulate=accumulate)
        for batch in pk.data.batches(corpus, 8, steps=3):
            state, _ = step(state, batch)
        return strategy.unreplicate(state.params)

    reference = run(pk.SingleDevice(), 1)
    tree_allclose(run(pk.ContextParallel(seq=2, data=2, devices=jax.devices()[:4]), 2), reference)
