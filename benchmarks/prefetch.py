"""What does placing the batch inside the step cost, and does prefetching win it back?

One device, an MLP 784-1024-1024-10, SGD, global batch 256 (synthetic data). Three
variants train from the same parameters on the same batches:

- ``hand, on device``: a hand-written ``jax.jit`` step whose batches were put on the
  device before the clock started (the floor: no copy at all);
- ``library, host batch``: ``pk.SingleDevice().step`` given host (NumPy) batches, so
  each step first copies its batch to the device;
- ``library, prefetch``: the same step fed by ``pk.prefetch`` (what ``pk.fit(..., prefetch=2)`` does),
  a background thread copying the next batches while a step runs.

Each variant runs ``--chunk`` steps in a row, blocking on every step; the variants
take turns, chunk after chunk, ``--rounds`` times, and the table gives the median
over rounds of (chunk wall time / chunk steps): prefetching only helps a loop, so a
loop is what is timed. The run stops with an error unless every variant ends with
the same parameters (rtol 1e-5, atol 1e-6).

    .venv/bin/python benchmarks/prefetch.py            # about half a minute on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx
from interleaved import summarize, take_turns

import parallelkit as pk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/prefetch.json")
    args = parser.parse_args()

    apply, params = pk.models.functional(pk.models.MLP(784, (1024, 1024), 10, rngs=nnx.Rngs(0)))
    loss = pk.models.classifier_loss(apply)
    tx = optax.sgd(0.01)
    steps = args.rounds * args.chunk + 2  # the first two: compile and warm up, untimed
    host = list(pk.data.batches(pk.data.synthetic(4096, (784,), 10), args.batch_size, steps=steps, seed=0))
    strategy = pk.SingleDevice()
    step = strategy.step(loss)

    def hand(state, batch):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state[0], batch)  # as the library's step
        updates, opt = tx.update(grads, state[1], state[0])
        return (optax.apply_updates(state[0], updates), opt), {"loss": value, **metrics}

    hand_step = jax.jit(hand, donate_argnums=0)
    on_device = [jax.device_put(b) for b in host]
    jax.block_until_ready(on_device)

    feeds = {
        "hand, on device": (iter(on_device), hand_step, jax.device_put((params, tx.init(params)))),
        "library, host batch": (iter(host), step, strategy.init(params, tx)),
        "library, prefetch": (pk.prefetch(iter(host), strategy), step, strategy.init(params, tx)),
    }
    states = {name: state for name, (_, _, state) in feeds.items()}

    def advance(name: str, count: int) -> None:
        batches, fn, _ = feeds[name]
        for _ in range(count):
            states[name], out = fn(states[name], next(batches))
            jax.block_until_ready(out)

    per_step = take_turns({name: functools.partial(advance, name) for name in feeds}, args.rounds, args.chunk)
    feeds["library, prefetch"][0].close()

    reference = jax.device_get(states["hand, on device"][0])
    for name in ("library, host batch", "library, prefetch"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     jax.device_get(states[name].params), reference)  # fmt: skip

    rows = summarize(per_step, "hand, on device")
    print(f"{'variant':<22}{'median ms/step':>15}{'p10':>8}{'p90':>8}{'/ hand':>8}")
    for name, r in rows.items():
        r["per_step_s"] = per_step[name]
        print(f"{name:<22}{r['median_ms']:>15.2f}{r['p10_ms']:>8.2f}{r['p90_ms']:>8.2f}{r['ratio_to_hand']:>8.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
        "machine": platform.machine(), "device": str(pk.device_summary()), "args": vars(args), "variants": rows,
    }, indent=2))  # fmt: skip
    print(f"Saved {out}; every variant ended with the hand-written step's parameters.")


if __name__ == "__main__":
    main()
