"""The cost model's compute against the clock: the tour's step, predicted from its FLOPs, then measured.

The model and step are the tour's (``python -m parallelkit tour``): the MLP on the
digits, Adam (learning rate 1e-3), a global batch of 64, on ``pk.SingleDevice`` (one
device, no communication, so the cost model's prediction is its compute alone):

- **FLOPs and bytes**: ``pk.inspect.flops(step, state, batch)``, XLA's count for the
  compiled step (the optimizer update included);
- **ceilings**: ``pk.measure_ceilings(quick=False, cache=False)``, this machine's float32
  matmul FLOP/s and memory bytes/s, measured in this run;
- **prediction**: ``pk.costmodel.predict`` of a ``Workload`` with ``flops_per_sample``
  = the step's FLOPs over its batch, ``peak_flops`` = the measured matmul rate and
  ``efficiency=1`` (the peak, the model's default), beside the roofline's bound
  ``max(FLOPs / peak, bytes / bandwidth)``;
- **measured**: ``pk.fit`` for ``--steps`` steps, ``--rounds`` times; the median step
  time of each round, and the median of those.

The ratio measured / predicted is the point: the FLOPs give a floor that a step of
this size is far above (a small step spends its time calling the program and starting
each operation, not on arithmetic), so ``1 / ratio`` is the ``efficiency`` a
``Workload`` would need to predict this step: its FLOPs utilisation by XLA's count (the
optimizer's update included) over the measured float32 matmul rate. That is not PaLM's
MFU (``roofline.mfu``: ``6 N`` FLOPs over a datasheet peak).

    .venv/bin/python benchmarks/roofline.py       # about ten seconds on 2 cores

It prints a table and writes ``benchmarks/results/roofline.json``, with the machine's
load average: on a shared machine the measured time is the first figure to move.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import jax
import numpy as np
import optax

import parallelkit as pk
from parallelkit.measure import costmodel, roofline

MODEL, BATCH, LEARNING_RATE = "mlp", 64, 1e-3  # the tour's defaults (python -m parallelkit tour)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round, after one compiling step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/roofline.json")
    args = parser.parse_args()

    dataset = pk.data.digits()
    apply, params = pk.models.build(MODEL, dataset.input_shape, dataset.num_classes)
    loss_fn = pk.models.classifier_loss(apply)
    strategy = pk.SingleDevice()
    batch = next(pk.data.batches(dataset, BATCH, steps=1))
    cost = pk.inspect.flops(strategy.step(loss_fn), strategy.init(params, optax.adam(LEARNING_RATE)), batch)
    machine = pk.measure_ceilings(quick=False, cache=False)
    peak, bandwidth = machine.matmul_f32.value, machine.memory.value

    work = costmodel.Workload(
        param_bytes=pk.models.param_bytes(params),
        batch_per_device=BATCH,
        flops_per_sample=cost.flops / BATCH,
        peak_flops=peak,
    )
    one_device = costmodel.Cluster(1, 1, costmodel.PRESETS["pcie4"])  # one device sends nothing: the link is unused
    predicted = costmodel.predict(work, one_device, "single").step_s
    bound = max(cost.flops / peak, cost.bytes_accessed / bandwidth)  # the roofline's floor, FLOPs or bytes
    point_regime = roofline.regime(cost.intensity, peak, bandwidth)

    rounds = []
    for _ in range(args.rounds):
        batches = pk.data.batches(dataset, BATCH, steps=args.steps + 1)
        run = pk.fit(strategy, loss_fn, params, optax.adam(LEARNING_RATE), batches)
        rounds.append(run.history.times.median)
    measured = float(np.median(rounds))

    start = time.perf_counter()  # after the timed rounds, so that it cannot disturb them
    pk.measure_ceilings(cache=False)  # the default, quick measurement on the devices JAX has: how long it takes
    quick_seconds = time.perf_counter() - start

    rows = [
        ("measured (median of rounds)", measured),
        ("predicted: FLOPs / peak (cost model)", predicted),
        ("roofline: max(FLOPs / peak, bytes / bandwidth)", bound),
    ]
    print(f"tour step: {MODEL}, batch {BATCH}, Adam, SingleDevice; {cost.flops:,.0f} FLOPs, "
          f"{cost.bytes_accessed:,.0f} bytes accessed ({cost.intensity:.2f} FLOPs/byte, {point_regime})")  # fmt: skip
    print(f"ceilings: {peak / 1e9:.1f} GFLOP/s float32 matmul, {bandwidth / 1e9:.1f} GB/s memory")
    print(f"the default (quick) pk.measure_ceilings() on {len(jax.devices())} device(s) took {quick_seconds:.1f} s")
    for label, seconds in rows:
        print(f"  {label:<50}{seconds * 1e6:>10.1f} us   measured / this = {measured / seconds:>8.1f}")
    print(
        f"implied efficiency for the cost model to match: {predicted / measured:.2%} "
        "(FLOPs utilisation: XLA's count over the measured peak)"
    )

    record = {
        "what": "the tour's SingleDevice step: measured median step time against the cost model's FLOPs prediction",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": os.getloadavg(),
        "args": vars(args) | {"model": MODEL, "batch_size": BATCH, "optimizer": f"adam({LEARNING_RATE})"},
        "flops": cost.flops,
        "bytes_accessed": cost.bytes_accessed,
        "intensity": cost.intensity,
        "regime": point_regime,
        "peak_flops": peak,
        "memory_bandwidth": bandwidth,
        "ceilings": machine.key,
        "quick_ceilings_s": quick_seconds,
        "quick_ceilings_devices": len(jax.devices()),
        "predicted_s": predicted,
        "roofline_s": bound,
        "measured_s": measured,
        "rounds_s": rounds,
        "ratio": measured / predicted,
        "ratio_to_roofline": measured / bound,
        "implied_efficiency": predicted / measured,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
