"""Central storage and parameter servers against a hand-written central storage in plain JAX.

MLP 784-1024-1024-10, SGD, global batch 256 (synthetic data), 2 simulated devices,
every variant's batches placed before the clock starts. Four variants train from the
same parameters on the same batches:

- ``single device``: ``pk.SingleDevice``, the whole batch on one device (the floor);
- ``hand central``: the naive central storage written out: the parameters and the
  optimizer state on device 0, ``jax.device_put`` of the parameters to each device,
  a jitted gradient per device on its half of the batch, the gradients
  ``jax.device_put`` back to device 0, one jitted update of their mean there;
- ``hand central, host memory``: the same with the state in the ``pinned_host`` memory
  beside device 0, the update reading it from there and writing it back
  (``out_shardings``), as notebook 03 writes it: what ``pk.CentralStorage`` does;
- ``pk.CentralStorage``: the library's, state in host memory (see its module);
- ``pk.ParameterServer(2)``: the state cut into 2 shards, each in its own host memory.

The variants take turns, ``--chunk`` blocked steps at a time, ``--rounds`` times, the
order reversed every other round; the table gives the median over rounds of the
chunk's time per step and its ratio to ``hand central``. The run stops with an error
unless the library's variants end with the hand-written one's parameters (rtol 1e-5,
atol 1e-6): they add the same per-device gradients. SingleDevice's largest difference
is reported (it sums the whole batch in another order).

Then it times each stage of one step on its own, blocking after each (``--stage-steps``
times, medians): the pull, the workers' gradients, the push and the update, for the
library and for the host-memory hand-written version; with ``--trace DIR`` it also
records a profiler trace of a few library steps and lists the events that took longest.

    .venv/bin/python benchmarks/central.py            # about half a minute on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import json
import platform
import time
from pathlib import Path

from interleaved import summarize, take_turns

import parallelkit as pk

pk.simulate_devices(2)

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from parallelkit.course.bench import _model  # noqa: E402
from parallelkit.course.tour import max_abs_diff  # noqa: E402
from parallelkit.strategies.offdevice.rows import push_rows  # noqa: E402


def hand_central(loss, tx, params, devices, memory_kind=None):
    """(state, stages) of central storage written by hand: the state beside ``devices[0]``, one update there.

    ``memory_kind=None`` keeps the state in device 0's own memory; ``"pinned_host"`` in the
    host memory beside it, where the update reads it from and writes it back to.
    ``stages`` are the step's four stages (pull, gradients, push, update); :func:`chain`
    makes them one step.
    """
    owner, n = devices[0], len(devices)
    storage, compute = SingleDeviceSharding(owner, memory_kind=memory_kind), SingleDeviceSharding(owner)
    workers = [SingleDeviceSharding(d) for d in devices]  # their default (device) memory
    grad = jax.jit(jax.grad(lambda p, b: loss(p, b)[0]))

    def mean_and_update(state, *grads):
        params, opt_state = jax.device_put(state, compute)
        mean = jax.tree.map(lambda *g: sum(g[1:], g[0]) / n, *grads)
        updates, opt_state = tx.update(mean, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    update = jax.jit(mean_and_update, out_shardings=storage, donate_argnums=0)
    stages = {
        "pull": lambda state, halves: (state, [jax.device_put(state[0], w) for w in workers], halves),
        "gradients": lambda state, pulled, halves: (state, [grad(p, h) for p, h in zip(pulled, halves, strict=True)]),
        "push": lambda state, grads: (state, jax.device_put(grads, compute)),
        "update": lambda state, grads: update(state, *grads),
    }
    state = jax.tree.map(lambda x: jnp.array(x, copy=True), (params, tx.init(params)))  # the step donates it
    return jax.device_put(state, storage), stages


def library_stages(strategy: pk.CentralStorage, loss):
    """The four stages of ``strategy``'s step, as :func:`hand_central` gives its own (the step's own code)."""
    fn = strategy.step(loss).fn
    push = functools.partial(push_rows, owner=fn.push_update.compute)
    return {
        "pull": lambda state, batch: (state, fn.pull(state), batch),
        "gradients": lambda state, pulled, batch: (state, fn.compute(pulled[0], batch, *pulled[1:])),
        "push": lambda state, rows: (state, push(rows)),
        "update": lambda state, pushed: fn.push_update.program()(state, pushed)[0],
    }


def chain(stages):
    """The stages as one step ``(state, batch) -> state``."""

    def step(state, batch):
        out = (state, batch)
        for stage in stages.values():
            out = stage(*out)
        return out

    return step


def time_stages(stages, state, batches, count: int):
    """(state, median ms of each stage): ``count`` steps, blocking after every stage."""
    seconds = {name: [] for name in stages}
    for i in range(count):
        out = (state, batches[i % len(batches)])
        for name, stage in stages.items():
            start = time.perf_counter()
            out = jax.block_until_ready(stage(*out))
            seconds[name].append(time.perf_counter() - start)
        state = out
    return state, {name: float(np.median(t)) * 1e3 for name, t in seconds.items()}


def trace_summary(step, state, batches, where: str, top: int = 12):
    """(state, the ``top`` profiler events by time per step) over a few blocked library steps, after one untimed."""
    state = jax.block_until_ready(step(state, batches[0])[0])  # compiled before the trace starts
    with jax.profiler.trace(where, create_perfetto_trace=True):
        for batch in batches:
            state = jax.block_until_ready(step(state, batch)[0])
    trace = max(Path(where).rglob("*.trace.json.gz"), key=lambda f: f.stat().st_mtime)
    events = json.loads(gzip.decompress(trace.read_bytes()))
    totals: dict[str, float] = {}
    for event in events["traceEvents"] if isinstance(events, dict) else events:
        if event.get("ph") == "X":
            totals[event["name"]] = totals.get(event["name"], 0.0) + event.get("dur", 0) / 1e3 / len(batches)
    return state, dict(sorted(totals.items(), key=lambda kv: -kv[1])[:top])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--stage-steps", type=int, default=30)
    parser.add_argument("--trace", default=None, help="also record a profiler trace of library steps here")
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

    split = [halves(b) for b in host]
    variants = {}
    for name, kind in (("hand central", None), ("hand central, host memory", "pinned_host")):
        hand_state, hand_stages = hand_central(loss, tx, params, devices, kind)
        variants[name] = (hand_state, chain(hand_stages), split)
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
        tree = state[0] if name.startswith("hand") else strategies[name].unreplicate(state.params)
        return jax.tree.leaves(jax.device_get(tree))

    reference = host_params("hand central")
    diffs = {}
    for name in [*strategies, "hand central, host memory"]:
        leaves = host_params(name)
        diffs[name] = max_abs_diff(leaves, reference)
        same = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(leaves, reference, strict=True))
        if name != "single device" and not same:
            raise SystemExit(f"{name} ended {diffs[name]:.2e} away from the hand-written central storage.")

    rows = summarize(per_step, "hand central")
    host_floor = rows["hand central, host memory"]["median_ms"]
    for name, row in rows.items():
        row["max_diff_to_hand"] = diffs.get(name, 0.0)
        row["ratio_to_hand_host_memory"] = row["median_ms"] / host_floor
    print(f"{'variant':<28}{'median ms':>11}{'p10':>8}{'p90':>8}{'/ hand':>8}{'/ hand host':>13}{'max |dp|':>11}")
    for name, r in rows.items():
        print(f"{name:<28}{r['median_ms']:>11.2f}{r['p10_ms']:>8.2f}{r['p90_ms']:>8.2f}{r['ratio_to_hand']:>8.3f}"
              f"{r['ratio_to_hand_host_memory']:>13.3f}{r['max_diff_to_hand']:>11.2e}")  # fmt: skip

    library = strategies["pk.CentralStorage"]
    hand_state, hand_stages = hand_central(loss, tx, params, devices, "pinned_host")  # a fresh state
    stages = {}
    _, stages["hand central, host memory"] = time_stages(hand_stages, hand_state, split, args.stage_steps)
    library_state, stages["pk.CentralStorage"] = time_stages(
        library_stages(library, loss), library.init(params, tx), variants["pk.CentralStorage"][2], args.stage_steps
    )
    print(f"\nstage, blocked alone (median ms of {args.stage_steps})")
    for name, times in stages.items():
        print(f"{name:<28}" + "".join(f"{stage} {ms:.2f}  " for stage, ms in times.items()))
    trace = None
    if args.trace:
        _, trace = trace_summary(library.step(loss), library_state, variants["pk.CentralStorage"][2][:3], args.trace)
        print("\nlongest profiler events per library step (ms; nested events overlap):")
        for name, ms in trace.items():
            print(f"{ms:9.2f}  {name[:90]}")
    record = {
        "what": "central storage and parameter servers against a hand-written central storage",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "jax": jax.__version__,
        "machine": platform.platform(), "device": f"{len(devices)} simulated CPU devices",
        "model": "MLP 784-1024-1024-10, SGD", "args": {**vars(args), "trace": bool(args.trace)},
        "rows": rows, "stages_ms": stages, "trace_ms_per_step": trace,
        "seconds": {name: t for name, t in per_step.items()},
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
