"""Central storage and parameter servers against a hand-written central storage in plain JAX.

MLP 784-1024-1024-10, SGD, global batch 256 (synthetic data), 2 simulated devices,
every variant's batches placed before the clock starts. Four variants train from the
same parameters on the same batches:

- ``single device``: ``pk.SingleDevice``, the whole batch on one device (the floor);
- ``hand central``: the naive central storage written out: the parameters and the
  optimizer state on device 0, ``jax.device_put`` of the parameters to each device,
  a jitted gradient per device on its half of the batch, the gradients
  ``jax.device_put`` back to device 0, one jitted update of their mean there;
- ``pk.CentralStorage``: the library's, state in host memory (see its module);
- ``pk.ParameterServer(2)``: the state cut into 2 shards, each in its own host memory.

The variants take turns, ``--chunk`` blocked steps at a time, ``--rounds`` times, the
order reversed every other round; the table gives the median over rounds of the
chunk's time per step and its ratio to ``hand central``. The run stops with an error
unless the library's variants end with the hand-written one's parameters (rtol 1e-5,
atol 1e-6): they add the same per-device gradients. SingleDevice's largest difference
is reported (it sums the whole batch in another order).

    .venv/bin/python benchmarks/central.py            # about half a minute on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
from pathlib import Path

from interleaved import summarize, take_turns

import parallelkit as pk

pk.simulate_devices(2)

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
import optax  # noqa: E402

from parallelkit.bench import _model  # noqa: E402
from parallelkit.tour import max_abs_diff  # noqa: E402


def hand_central(loss, tx, params, devices):
    """(state, step) of central storage written by hand: state on ``devices[0]``, one update there."""
    owner, n = devices[0], len(devices)
    grad = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))

    @jax.jit
    def update(params, opt_state, *grads):
        mean = jax.tree.map(lambda *g: sum(g[1:], g[0]) / n, *grads)
        updates, opt_state = tx.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(state, halves):
        params, opt_state = state
        grads = [grad(jax.device_put(params, d), half) for d, half in zip(devices, halves, strict=True)]
        return update(params, opt_state, *jax.device_put(grads, owner))

    state = jax.device_put((params, tx.init(params)), owner)
    return state, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/central.json")
    args = parser.parse_args()

    loss, params, _, dataset = _model("wide")  # the benchmark command's MLP 784-1024-1024-10
    tx = optax.sgd(0.01)
    steps = args.rounds * args.chunk + 2  # the first two: compile and warm up, untimed
    host = list(pk.data.batches(dataset, args.batch_size, steps=steps, seed=0))
    devices = jax.devices()[:2]
    half = args.batch_size // 2

    def halves(batch):
        return [jax.device_put(jax.tree.map(lambda x, i=i: x[i * half : (i + 1) * half], batch), d)
                for i, d in enumerate(devices)]  # fmt: skip

    hand_state, hand_step = hand_central(loss, tx, params, devices)
    variants = {"hand central": (hand_state, hand_step, [halves(b) for b in host])}
    strategies = {
        "single device": pk.SingleDevice(),
        "pk.CentralStorage": pk.CentralStorage(2),
        "pk.ParameterServer(2)": pk.ParameterServer(2, devices=2),
    }
    for name, strategy in strategies.items():
        step = strategy.step(loss)
        variants[name] = (strategy.init(params, tx), lambda s, b, step=step: step(s, b)[0],
                          [strategy.place_batch(b) for b in host])  # fmt: skip
    jax.block_until_ready([batches for _, _, batches in variants.values()])
    states = {name: state for name, (state, _, _) in variants.items()}
    position = dict.fromkeys(variants, 0)

    def advance(name: str, count: int) -> None:
        _, fn, batches = variants[name]
        for _ in range(count):
            states[name] = fn(states[name], batches[position[name]])
            position[name] += 1
            jax.block_until_ready(states[name])

    turns = {name: functools.partial(advance, name) for name in variants}
    per_step = take_turns(turns, args.rounds, args.chunk)

    def host_params(name):
        state = states[name]
        tree = state[0] if name == "hand central" else strategies[name].unreplicate(state.params)
        return jax.tree.leaves(jax.device_get(tree))

    reference = host_params("hand central")
    diffs = {}
    for name in strategies:
        leaves = host_params(name)
        diffs[name] = max_abs_diff(leaves, reference)
        same = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(leaves, reference, strict=True))
        if name != "single device" and not same:
            raise SystemExit(f"{name} ended {diffs[name]:.2e} away from the hand-written central storage.")

    rows = summarize(per_step, "hand central")
    for name, row in rows.items():
        row["max_diff_to_hand"] = diffs.get(name, 0.0)
    print(f"{'variant':<24}{'median ms':>11}{'p10':>8}{'p90':>8}{'/ hand':>8}{'max |dp|':>11}")
    for name, r in rows.items():
        print(f"{name:<24}{r['median_ms']:>11.2f}{r['p10_ms']:>8.2f}{r['p90_ms']:>8.2f}"
              f"{r['ratio_to_hand']:>8.3f}{r['max_diff_to_hand']:>11.2e}")  # fmt: skip
    record = {
        "what": "central storage and parameter servers against a hand-written central storage",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
        "machine": platform.platform(), "device": f"{len(devices)} simulated CPU devices",
        "model": "MLP 784-1024-1024-10, SGD", "args": vars(args), "rows": rows,
        "seconds": {name: t for name, t in per_step.items()},
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
