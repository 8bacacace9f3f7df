"""The cost model's sequence-splitting patterns: their collectives against the compiled steps', and their times."""

from __future__ import annotations

import collections
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallelkit as pk
from parallelkit import costmodel
from parallelkit.measure.costmodel import CONTEXT_METHODS
from parallelkit.measure.costmodel import sequence_collectives as collectives

BATCH, LENGTH, DIM, LAYERS = 4, 32, 32, 2
PATTERNS = tuple(f"context_{m}" for m in CONTEXT_METHODS)


def _measured(strategy, rank: int) -> dict[str, tuple[int, int, float]]:
    """(count, payload bytes, bytes one device sends) of each collective kind in the GPT's compiled step whose
    arrays all have ``rank`` axes (the activations: the parameters' gradients have fewer)."""
    model = pk.models.GPT(256, max_length=LENGTH, dim=DIM, heads=4, depth=LAYERS, mlp_dim=64, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    tokens = np.zeros((BATCH, LENGTH), np.int32)
    found = pk.inspect.collectives(strategy.step(pk.models.lm_loss(apply)), strategy.init(params, optax.sgd(0.1)),
                                   {"x": tokens, "y": tokens})  # fmt: skip
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    for c in found:
        if all(s.count(",") == rank - 1 and re.match(r"f32\[", s) for s in c.shapes):
            totals[c.op][0] += 1
            totals[c.op][1] += c.bytes
            totals[c.op][2] += c.sent_bytes()
    return {op: tuple(v) for op, v in totals.items()}


def _predicted(strategy: str, n: int) -> dict[str, tuple[int, float, float]]:
    # The cost model's convention: a group of n devices takes n x batch_per_device samples.
    work = costmodel.Workload(0, 1e-3, batch_per_device=BATCH // n, sequence_bytes=LENGTH * DIM * 4, layers=LAYERS)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    for planned in collectives(work, strategy, n):
        totals[planned.op][0] += planned.count
        totals[planned.op][1] += planned.bytes
        totals[planned.op][2] += planned.sent_bytes
    return {op: tuple(v) for op, v in totals.items()}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", CONTEXT_METHODS)
def test_context_parallel_collectives_are_the_compilers(method, n):
    """Each method's collectives on q, k, v and the output, forward and backward: the compiled step's count,
    payload and bytes sent per device of each kind, read from its HLO, equal the cost model's."""
    strategy = pk.ContextParallel(seq=n, method=method, data=1, devices=jax.devices()[:n])
    assert _measured(strategy, rank=4) == _predicted(f"ContextParallel({method})", n)


@pytest.mark.slow
def test_sequence_parallel_collectives_are_the_compilers():
    strategy = pk.TensorParallel(2, sequence_parallel=True, devices=jax.devices()[:2])
    measured = _measured(strategy, rank=3)  # the residual stream: (batch, length or length / 2, dim)
    assert measured == _predicted("TensorParallel(SP)", 2)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bytes_sent_per_device_are_each_methods_closed_form(n):
    """Per layer, with b a device's block of one (length, dim) activation: 4 (n-1) b for the all-gather and the ring
    (equal, though their payloads differ), 8 more for the zig-zag ring, 8 (n-1)/n b for Ulysses; the
    2 all-reduces forward and 2 backward of sequence parallelism, 2 (n-1)/n of n b each."""
    b, layers = 3 * 1024, 5
    work = costmodel.Workload(0, 1e-3, batch_per_device=3, sequence_bytes=1024, layers=layers)
    sent = {m: sum(p.sent_bytes for p in collectives(work, m, n)) for m in (*PATTERNS, "sequence_parallel")}
    payload = {m: sum(p.bytes for p in collectives(work, m, n)) for m in PATTERNS}
    assert sent["context_allgather"] == sent["context_ring"] == layers * 4 * (n - 1) * b
    assert payload["context_allgather"] == layers * (2 * n * b + 2 * b) != payload["context_ring"]
    assert sent["context_ring_zigzag"] == layers * (4 * (n - 1) + 8) * b
    assert sent["context_ulysses"] == layers * 8 * (n - 1) / n * b
    assert sent["sequence_parallel"] == layers * 4 * 2 * (n - 1) / n * (n * b)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_rounds_send_the_bytes_sent(n):
    """The cost model's rounds, on a link of 1 GB/s without latency, take the bytes sent per device / 1 GB/s."""
    link = costmodel.Link("test", GBps=1, latency_us=0, source="by hand")
    work = costmodel.Workload(0, 1e-3, batch_per_device=2, sequence_bytes=1e6, layers=2)
    for name in (*PATTERNS, "sequence_parallel"):
        seconds = costmodel.communication_seconds(work, costmodel.Cluster(1, n, link), name, model=n)
        assert seconds == pytest.approx(sum(p.sent_bytes for p in collectives(work, name, n)) / 1e9, rel=1e-12), name


def test_times_follow_the_rounds():
    link = costmodel.Link("test", GBps=1, latency_us=0, source="by hand")
    cluster = costmodel.Cluster(1, 4, link)
    work = costmodel.Workload(0, 1e-3, batch_per_device=1, sequence_bytes=1e6, layers=1)
    seconds = {m: costmodel.communication_seconds(work, cluster, f"context_{m}", model=4) for m in CONTEXT_METHODS}
    # ring: 4 (n-1) = 12 permutes of 1 MB, one round each; all-gather: 2 all-gathers of 4 MB and 2 reduce-scatters
    # of 1 MB, each 3 rounds of 1 MB: the same 12 ms; Ulysses: 8 all-to-alls of 3 rounds of 1/4 MB: 6 ms.
    assert seconds["ring"] == pytest.approx(12e-3) and seconds["allgather"] == pytest.approx(12e-3)
    assert seconds["ulysses"] == pytest.approx(6e-3)
    assert seconds["ring_zigzag"] == pytest.approx(12e-3 + 16 * 0.5e-3)
    # sequence parallelism: each of 4 all-reduces of a block (4 samples x 1 MB over the group) as a ring
    sp = costmodel.communication_seconds(work, cluster, "sequence_parallel", model=4)
    assert sp == pytest.approx(4 * costmodel.allreduce_seconds(cluster, 4e6))
    p = costmodel.predict(work, cluster, "ContextParallel(ring)", model=4)
    assert p.step_s == pytest.approx(1e-3 + 12e-3)


def test_bad_input_is_a_clear_error():
    work = costmodel.Workload(0, 1e-3, batch_per_device=1)
    with pytest.raises(ValueError, match=r"Workload\(sequence_bytes=..., layers=...\)"):
        collectives(work, "context_ring", 2)
    with pytest.raises(ValueError, match="'mirrored' does not split the sequence"):
        collectives(work, "mirrored", 2)
    cluster = costmodel.Cluster(1, 4, costmodel.PRESETS["nvlink3"])
    with pytest.raises(ValueError, match="needs model=k.*seq for context parallelism"):
        costmodel.predict(work, cluster, "context_ring")
    with pytest.raises(ValueError, match="layers a whole number"):
        costmodel.Workload(0, 1e-3, batch_per_device=1, layers=-1)
