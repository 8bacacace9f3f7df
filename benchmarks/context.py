"""Splitting the sequence: collectives, bytes, attention memory and step time of each context-parallel method.

The GPT (``pk.models.GPT``: width 64, 8 heads, 2 layers; one sequence per step) on the
kit's corpus (``pk.data.text``), in one process with 8 simulated CPU devices: one device
(``pk.SingleDevice``), then ``pk.ContextParallel(seq=n, method=m)`` for every method on
2, 4 and 8 devices, at several lengths. For each compiled training step the script reads
from its HLO (``pk.inspect.collectives``) the count and payload of each collective on
the attention's activations (arrays of 4 axes: q, k, v and the output, forward and
backward) and the bytes each device sends for them, one way
(``pk.inspect.Collective.sent_bytes``: ``(n-1)/n`` of an all-gather's output, ``n - 1``
times a reduce-scatter's shard, a permute's array, ``(n-1)/n`` of an all-to-all's; the
payload alone does not compare methods), sets them beside the cost model's
(:mod:`parallelkit.measure.costmodel.sequence`) and the book's forward wire bytes per layer
(all-gather: ``(n-1)/n`` of the K,V bytes; ring: ``n - 1`` permutes of a K,V block;
Ulysses: 4 all-to-alls of ``(n-1)/n`` of a block), reads the attention's temporaries per device from the compiler
(``pk.inspect.memory_per_device`` of attention alone, forward and backward, beside the
``T^2`` scores divided by ``n``), and times the step (median of ``--steps`` steps after
the 3 it trains). It checks first that every split step ends with SingleDevice's
parameters after 3 SGD steps. Then the same for Megatron's sequence parallelism
(``pk.TensorParallel(n, sequence_parallel=True)`` against plain ``TensorParallel``).

Simulated devices share this machine's cores (2 here): the times show the work and the
waiting each method adds on one CPU, not the speed-up of real devices, which run at once.

    .venv/bin/python benchmarks/context.py          # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from interleaved import header, save

import parallelkit as pk

pk.simulate_devices(8)

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from parallelkit import attention, costmodel  # noqa: E402
from parallelkit.measure.costmodel import CONTEXT_METHODS  # noqa: E402
from parallelkit.measure.costmodel import sequence_collectives as collectives  # noqa: E402

DIM, HEADS, DEPTH, ITEM = 64, 8, 2, 4


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--out", default="benchmarks/results/context.json")
    return parser


def _model(length: int):
    model = pk.models.GPT(256, max_length=length, dim=DIM, heads=HEADS, depth=DEPTH, mlp_dim=4 * DIM,
                          rngs=nnx.Rngs(0))  # fmt: skip
    apply, params = pk.models.functional(model)
    return pk.models.lm_loss(apply), params


def _activation_collectives(found, rank: int) -> dict[str, dict[str, float]]:
    """Count, payload bytes and bytes sent per device of each kind of collective whose arrays all have ``rank`` axes."""
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0, "sent_bytes": 0.0})
    for c in found:
        if all(s.count(",") == rank - 1 for s in c.shapes):
            totals[c.op]["count"] += 1
            totals[c.op]["bytes"] += c.bytes
            totals[c.op]["sent_bytes"] += c.sent_bytes()
    return dict(totals)


def _predicted(strategy: str, n: int, length: int, batch: int) -> dict[str, dict[str, float]]:
    work = costmodel.Workload(0, 1e-3, batch_per_device=1, sequence_bytes=batch / n * length * DIM * ITEM,
                              layers=DEPTH)  # fmt: skip
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"count": 0, "bytes": 0.0, "sent_bytes": 0.0})
    for planned in collectives(work, strategy, n):
        totals[planned.op]["count"] += planned.count
        totals[planned.op]["bytes"] += planned.bytes
        totals[planned.op]["sent_bytes"] += planned.sent_bytes
    return dict(totals)


def _book_forward_bytes(method: str, n: int, length: int) -> float:
    """Bytes one device receives per layer in the forward pass, by the book (one sequence)."""
    kv = 2 * length * DIM * ITEM  # the keys and values of the whole sequence
    block = kv / n
    return {
        "allgather": (n - 1) / n * kv,
        "ring": (n - 1) * block,
        "ring_zigzag": (n - 1) * block,  # and the layout's permutes, which a data loader would save
        "ulysses": 4 * (n - 1) / n * (length * DIM * ITEM / n),
    }[method]


def _attention_temp(method: str | None, n: int, length: int) -> int:
    """The compiler's temporaries per device for attention alone, forward and backward, one sequence."""
    shape = (1, length, HEADS, DIM // HEADS)
    q = k = v = jax.ShapeDtypeStruct(shape, np.float32)
    if method is None:
        fn = attention.dense
    else:
        mesh = pk.mesh.make_mesh(jax.devices()[:n], seq=n)
        fn = lambda q, k, v: attention.context_parallel(q, k, v, mesh=mesh, method=method)  # noqa: E731
    grad = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))
    return pk.inspect.memory_per_device(grad, q, k, v).temp


def _run(strategy, loss_fn, params, batches, reference, steps: int) -> tuple:
    """Train on ``batches`` (checked against ``reference``'s parameters, when given), then time ``steps`` more
    steps of the same compiled program: (the step, a state, its median ms, the parameters)."""
    state, step = strategy.init(params, optax.sgd(0.1)), strategy.step(loss_fn)
    for batch in batches:
        state, _ = step(state, batch)
    trained = strategy.unreplicate(state.params)
    if reference is not None:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), trained, reference)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, _ = step(state, batches[0])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return step, state, float(np.median(times)) * 1e3, trained


def main() -> None:
    args = _parser().parse_args()
    rows = []
    print(f"GPT width {DIM}, {HEADS} heads, {DEPTH} layers, one sequence per step; {jax.devices()[0].platform}, "
          f"{len(jax.devices())} simulated devices on {os.cpu_count()} cores")  # fmt: skip
    head = (f"{'strategy':<48}{'T':>6}{'n':>3}  {'collectives (count x op: payload MB, HLO | cost model)':<58}"
            f"{'sent MB':>8}{'book fwd MB/layer':>18}{'attn temp MB':>13}{'scores/n MB':>12}"
            f"{'ms/step':>9}")  # fmt: skip
    print(head)
    for length in args.lengths:
        corpus = pk.data.text(length=length, max_bytes=max(64 * length, 100_000))
        loss_fn, params = _model(length)
        batches = list(pk.data.batches(corpus, 1, steps=3))
        *_, ms, reference = _run(pk.SingleDevice(), loss_fn, params, batches, None, args.steps)
        scores = HEADS * length * length * ITEM
        one = _attention_temp(None, 1, length)
        rows.append({"strategy": "SingleDevice", "length": length, "devices": 1, "collectives": {}, "predicted": {},
                     "attention_temp_bytes": one, "scores_bytes_per_device": scores, "median_ms": ms})  # fmt: skip
        print(f"{'SingleDevice':<48}{length:>6}{1:>3}  {'-':<58}{'-':>8}{'-':>18}{one / 1e6:>13.2f}"
              f"{scores / 1e6:>12.2f}{ms:>9.1f}")  # fmt: skip
        for n in args.devices:
            for method in CONTEXT_METHODS:
                strategy = pk.ContextParallel(seq=n, method=method, data=1, devices=jax.devices()[:n])
                step, state, ms, _ = _run(strategy, loss_fn, params, batches, reference, args.steps)
                measured = _activation_collectives(pk.inspect.collectives(step, state, batches[0]), rank=4)
                predicted = _predicted(f"context_{method}", n, length, 1)
                temp = _attention_temp(method, n, length)
                book = _book_forward_bytes(method, n, length)
                rows.append({"strategy": repr(strategy), "method": method, "length": length, "devices": n,
                             "collectives": measured, "predicted": predicted, "book_forward_bytes_per_layer": book,
                             "attention_temp_bytes": temp, "scores_bytes_per_device": scores / n,
                             "median_ms": ms})  # fmt: skip
                cells = "; ".join(f"{v['count']} x {op}: {v['bytes'] / 1e6:.2f} | {predicted[op]['bytes'] / 1e6:.2f}"
                                  for op, v in measured.items())  # fmt: skip
                sent = sum(v["sent_bytes"] for v in measured.values())
                print(f"{method:<48}{length:>6}{n:>3}  {cells:<58}{sent / 1e6:>8.2f}{book / 1e6:>18.3f}"
                      f"{temp / 1e6:>13.2f}{scores / n / 1e6:>12.2f}{ms:>9.1f}")  # fmt: skip
        for n in (2, 4):  # Megatron's sequence parallelism beside plain tensor parallelism (8 heads: up to 8)
            for sp in (False, True):
                strategy = pk.TensorParallel(n, sequence_parallel=sp, devices=jax.devices()[:n])
                step, state, ms, _ = _run(strategy, loss_fn, params, batches, reference, args.steps)
                compiled = step.lower(state, batches[0]).compile()
                measured = _activation_collectives(pk.inspect.parse_collectives(compiled.as_text()), rank=3)
                residual = int(compiled.memory_analysis().temp_size_in_bytes)
                predicted = _predicted("sequence_parallel", n, length, 1) if sp else {}
                rows.append({"strategy": repr(strategy), "length": length, "devices": n, "collectives": measured,
                             "predicted": predicted, "step_temp_bytes": residual, "median_ms": ms})  # fmt: skip
                cells = "; ".join(
                    f"{v['count']} x {op}: {v['bytes'] / 1e6:.2f}"
                    + (f" | {predicted[op]['bytes'] / 1e6:.2f}" if op in predicted else "")
                    for op, v in measured.items()
                )
                sent = sum(v["sent_bytes"] for v in measured.values())
                print(f"{repr(strategy):<48}{length:>6}{n:>3}  {cells:<58}{sent / 1e6:>8.2f}{'-':>18}{'-':>13}"
                      f"{'-':>12}{ms:>9.1f}")  # fmt: skip
    record = {
        **header("context", args),
        "model": {"dim": DIM, "heads": HEADS, "depth": DEPTH, "batch": 1},
        "rows": rows,
    }
    save(record, args.out)


if __name__ == "__main__":
    main()
