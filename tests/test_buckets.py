"""Gradient buckets: ``pk.Mirrored(..., bucket_bytes=b)`` reduces its gradients in buckets, one all-reduce each.

Proven as every strategy is: the same parameters as one device, and the all-reduces the
compiled program holds (their count and bytes) are the ones the bucket plan says.
"""

from __future__ import annotations

import jax
import optax
import pytest
from helpers import tree_allclose

import parallelkit as pk
from parallelkit.strategies.allreduce import bucket_plan
from parallelkit.strategies.data_parallel import gradient_buckets

BACKENDS = ("jit", "pmap")
METRIC_BYTES = 2 * 4  # loss and accuracy, float32 scalars
SMALL = 1000  # bytes: the digits MLP's four gradient leaves fall into four buckets


def train(strategy, loss_fn, params, batches, **options):
    state, step = strategy.init(params, optax.adam(1e-3)), strategy.step(loss_fn, **options)
    for batch in batches:
        state, _ = step(state, batch)
    return state, step


@pytest.fixture(scope="module")
def batches(digits):
    return list(pk.data.batches(digits, 64, steps=3))


def test_the_plan_takes_the_leaves_in_the_given_order_and_closes_a_full_bucket():
    assert bucket_plan([400, 400, 400, 1000], 800, [3, 2, 1, 0]) == [[3], [2, 1], [0]]
    assert bucket_plan([100, 100, 100], 1000, [2, 1, 0]) == [[2, 1, 0]]
    assert bucket_plan([100, 100, 100], None, [2, 1, 0]) == [[2, 1, 0]]
    assert bucket_plan([5000, 10], 100, [1, 0]) == [[1], [0]]  # a leaf larger than a bucket travels alone
    assert bucket_plan([], 100, []) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bucket_bytes", [SMALL, 10**9])
def test_bucketed_training_equals_one_device(backend, bucket_bytes, mlp, batches):
    loss_fn, params = mlp
    strategy = pk.Mirrored(4, backend=backend, bucket_bytes=bucket_bytes)
    state, _ = train(strategy, loss_fn, params, batches)
    expected, _ = train(pk.SingleDevice(), loss_fn, params, batches)
    tree_allclose(strategy.unreplicate(state.params), expected.params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_bucket_is_one_all_reduce_of_its_bytes(backend, mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(4, backend=backend, bucket_bytes=SMALL)
    state = strategy.init(params, optax.sgd(0.1))
    plan = strategy.gradient_buckets(loss_fn, state, batch)
    leaf_bytes = [4 * x.size for x in jax.tree.leaves(params)]
    assert len(plan) == len(leaf_bytes) == 4 and sorted(plan) == sorted(leaf_bytes)  # each leaf over 1000 / 4
    found = pk.inspect.collectives(strategy.step(loss_fn), state, batch)
    assert [c.op for c in found] == ["all-reduce"] * len(plan)
    # in the plan's order: the first carries the metrics too, each later one a float of the one before
    assert [c.bytes for c in found] == [plan[0] + METRIC_BYTES, *(b + 4 for b in plan[1:])]


def test_one_big_bucket_compiles_to_todays_single_all_reduce(mlp, batch):
    loss_fn, params = mlp
    state = pk.Mirrored(4).init(params, optax.sgd(0.1))
    texts = [
        pk.Mirrored(4, bucket_bytes=b).step(loss_fn).lower(state, batch).compile().as_text() for b in (None, 10**9)
    ]
    counts = [sum(" all-reduce(" in line for line in text.splitlines()) for text in texts]
    assert counts == [1, 1]


def test_the_traffic_report_expects_the_buckets(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(4, bucket_bytes=SMALL)
    state = strategy.init(params, optax.sgd(0.1))
    (flow,) = [f for f in strategy.traffic(loss_fn, state, batch).flows if "all-reduce" in f.what]
    assert "4 buckets" in flow.what
    assert flow.measured == flow.expected == pk.models.param_bytes(params) + METRIC_BYTES + 4 * 3


def test_buckets_with_accumulation_and_a_hand_written_ring(mlp, batches):
    loss_fn, params = mlp
    strategy = pk.Mirrored(4, allreduce="ring", bucket_bytes=SMALL)
    state, step = train(strategy, loss_fn, params, batches, accumulate=2)
    expected, _ = train(pk.SingleDevice(), loss_fn, params, batches)
    tree_allclose(strategy.unreplicate(state.params), expected.params)
    text = step.lower(state, batches[0]).compile().as_text()
    assert " all-reduce(" not in text and "collective-permute" in text  # the ring's permutes, no psum


def test_gradient_buckets_sizes_match_the_plan():
    params = {"a": jax.numpy.zeros(100), "b": jax.numpy.zeros(300)}
    assert gradient_buckets(params, 1000, [1, 0]) == [1200, 400]
    assert gradient_buckets(params, None, [1, 0], metric_bytes=8) == [1608]


def test_the_timeline_hides_buckets_behind_the_backward_pass_but_not_their_latency():
    four = pk.costmodel.Cluster(1, 4, pk.costmodel.Link("test", GBps=10, latency_us=5, source="by hand"))
    one = pk.costmodel.bucket_timeline(four, [4e6])  # no overlap: everything after the backward pass
    assert one.exposed_s == pytest.approx(one.communication_s) == pytest.approx(6 * (5e-6 + 1e6 / 10e9))
    exposed = {n: pk.costmodel.bucket_timeline(four, [4e6 / n] * n, backward_s=1e-3).exposed_s for n in (1, 4, 1000)}
    assert exposed[4] < exposed[1]  # four buckets: three hidden behind the backward pass
    assert exposed[1000] > exposed[1]  # a thousand: 6,000 latencies, more than all the bytes
    assert pk.costmodel.bucket_timeline(four, [4e6 / 4] * 4, backward_s=1e-3).starts[1:] == pytest.approx(
        (0.5e-3, 0.75e-3, 1e-3)
    )  # each starts when its gradients exist (the one before is done by then)
    with pytest.raises(ValueError, match="bytes > 0"):
        pk.costmodel.bucket_timeline(four, [0.0])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "25MB"])
def test_a_bucket_size_that_is_not_a_whole_number_of_bytes_is_refused(bad):
    with pytest.raises(ValueError, match=r"bucket_bytes=.*whole number >= 1.*25 \* 2\*\*20"):
        pk.Mirrored(2, bucket_bytes=bad)


def test_the_bucket_size_shows_in_the_strategy():
    assert repr(pk.Mirrored(2, backend="pmap", bucket_bytes=4096)) == (
        "Mirrored(backend='pmap', devices=2, bucket_bytes=4096)"
    )
    assert repr(pk.Mirrored(2)) == "Mirrored(backend='jit', devices=2)"
