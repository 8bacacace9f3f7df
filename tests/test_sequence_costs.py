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
from parallelkit.measure.sequence_costs import CONTEXT_METHODS, collectives

BATCH, LENGTH, DIM, LAYERS = 4, 32, 32, 2


def _measured(strategy, rank: int) -> dict[str, tuple[int, int]]:
    """(count, bytes) of each collective kind in the GPT's compiled step whose arrays all have ``rank`` axes
    (the activations: the parameters' gradients have fewer)."""
    model = pk.models.GPT(256, max_length=LENGTH, dim=DIM, heads=4, depth=LAYERS, mlp_dim=64, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    tokens = np.zeros((BATCH, LENGTH), np.int32)
    found = pk.inspect.collectives(strategy.step(pk.models.lm_loss(apply)), strategy.init(params, optax.sgd(0.1)),
                                   {"x": tokens, "y": tokens})  # fmt: skip
    totals: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for c in found:
        if all(s.count(",") == rank - 1 and re.match(r"f32\[", s) for s in c.shapes):
            totals[c.op][0] += 1
            totals[c.op][1] += c.bytes
    return {op: tuple(v) for op, v in totals.items()}


def _predicted(strategy: str, n: int) -> dict[str, tuple[int, float]]:
    # The cost model's convention: a group of n devices takes n x batch_per_device samples.
    work = costmodel.Workload(0, 1e-3, batch_per_device=BATCH // n, sequence_bytes=LENGTH * DIM * 4, layers=LAYERS)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0])
    for planned in collectives(work, strategy, n):
        totals[planned.op][0] += planned.count
        totals[planned.op][1] += planned.bytes
    return {op: tuple(v) for op, v in totals.items()}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("method", CONTEXT_METHODS)
def test_context_parallel_collectives_are_the_compilers(method, n):
    """Each method's collectives on q, k, v and the output, forward and backward: the compiled step's count and
    bytes of each kind, read from its HLO, equal the cost model's."""
    strategy = pk.ContextParallel(seq=n, method=method, data=1, devices=jax.devices()[:n])
    assert _measured(strategy, rank=4) == _predicted(f"ContextParallel({method})", n)


@pytest.mark.slow
def test_sequence_parallel_collectives_are_the_compilers():
    strategy = pk.TensorParallel(2, sequence_parallel=True, devices=jax.devices()[:2])
    measured = _measured(strategy, rank=3)  # the residual stream: (batch, length or length / 2, dim)
    assert measured == _predicted("TensorParallel(SP)", 2)


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
