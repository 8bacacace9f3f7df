"""Prefetching: batches placed ahead by a background thread, in order, errors raised in place, threads ended."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import parallelkit as pk


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "parallelkit-prefetch"]


def test_batches_arrive_placed_in_order(digits):
    strategy = pk.Mirrored(4)
    host = list(pk.data.batches(digits, 64, steps=5))
    placed = list(pk.prefetch(host, strategy, size=2))
    assert [p.size for p in placed] == [64] * 5
    for p, h in zip(placed, host, strict=True):
        for leaf, original in zip(jax.tree.leaves(p.batch), jax.tree.leaves(h), strict=True):
            assert leaf.sharding.spec == P(pk.DATA) and len(leaf.sharding.device_set) == 4
            np.testing.assert_array_equal(np.asarray(leaf), original)
    assert _prefetch_threads() == []


def test_the_thread_runs_ahead_by_size(digits):
    taken = []

    def source():
        for i, batch in enumerate(pk.data.batches(digits, 64, steps=10)):
            taken.append(i)
            yield batch

    feed = pk.prefetch(source(), pk.SingleDevice(), size=3)
    next(feed)
    deadline = time.monotonic() + 30  # a hang guard, not a timing claim
    while len(taken) < 1 + 3 + 1 and time.monotonic() < deadline:  # 3 queued, 1 in the producer's hands
        time.sleep(0.01)
    assert len(taken) == 5
    feed.close()
    assert _prefetch_threads() == []


def test_an_error_in_the_data_arrives_after_the_batches_before_it(digits):
    def source():
        yield from pk.data.batches(digits, 64, steps=2)
        raise OSError("disk gone")

    feed = pk.prefetch(source(), pk.SingleDevice())
    assert next(feed).size == next(feed).size == 64
    with pytest.raises(OSError, match="disk gone"):
        next(feed)
    assert _prefetch_threads() == []


def test_fit_with_and_without_prefetch_trains_the_same(mlp, digits):
    loss, params = mlp
    results = [
        pk.fit(pk.Mirrored(4, backend=backend), loss, params, optax.adam(1e-3),
               pk.data.batches(digits, 64, steps=6), prefetch=ahead)
        for backend in ("jit", "pmap") for ahead in (0, 2)
    ]  # fmt: skip
    for placed_in_step, prefetched in (results[:2], results[2:]):  # same program: the same bits
        jax.tree.map(np.testing.assert_array_equal, prefetched.params, placed_in_step.params)
    for result in results:
        assert result.history.batch_size == 64 and len(result.history.records) == 6
    assert _prefetch_threads() == []


def test_fit_with_prefetch_stops_the_thread_when_the_data_fails(mlp, digits):
    loss, params = mlp

    def source():
        yield from pk.data.batches(digits, 64, steps=3)
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone") as caught:
        pk.fit(pk.SingleDevice(), loss, params, optax.sgd(0.1), source(), prefetch=2)
    assert len(caught.value.fit_result.history.records) == 3
    assert _prefetch_threads() == []


def test_fit_prefetches_only_when_asked(mlp, digits):
    """Off by default (on the CPU, the one place measured, it was slower); ``prefetch=2`` starts the thread."""
    loss, params = mlp

    class Threads(pk.Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, record):
            self.seen.append(len(_prefetch_threads()))

    default, asked = Threads(), Threads()
    pk.fit(pk.SingleDevice(), loss, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=10), callbacks=[default])
    pk.fit(pk.SingleDevice(), loss, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=10), callbacks=[asked],
           prefetch=2)  # fmt: skip
    assert default.seen == [0] * 10
    assert asked.seen[0] == 1  # after the first step 2 batches wait ready and the thread holds the next: alive
    assert _prefetch_threads() == []


def test_bad_input_gets_a_clear_error(digits, mlp):
    with pytest.raises(ValueError, match="whole number >= 1"):
        pk.prefetch([], pk.SingleDevice(), size=0)
    loss, params = mlp
    mirrored, single = pk.Mirrored(2), pk.SingleDevice()
    placed = next(pk.prefetch(pk.data.batches(digits, 64, steps=1), mirrored))
    with pytest.raises(ValueError, match="placed by Mirrored"):
        single.step(loss)(single.init(params, optax.sgd(0.1)), placed)
