"""Pipeline schedules measured: the bubble of GPipe, 1F1B, interleaved 1F1B and ZB-H1 beside their plans.

An MLP 64-1024-1024-1024-10 (four layers; wide, so that each pass takes milliseconds), global
batch 512, SGD, cut into **2 stages** on 2 simulated CPU devices, each device running on one
thread (``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1``): on a 2-core
machine the two stages then really run at once, which a measured bubble needs (notebook 09
says why). For each schedule and each microbatch count in ``--microbatches`` the script
trains ``--steps`` steps after one that compiles, and records, from each step's timeline
(``step.timeline``):

- **measured**: the share of stage-time idle (``timeline.bubble_fraction()``), median over
  the steps;
- **formula**: GPipe and 1F1B ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v m+p-1)`` (``v = 2``),
  ZB-H1 ``(p-1)/(3m+p-1)`` (its idle time is one forward pass per stage-boundary where 1F1B's is
  a forward and a backward, for passes of equal length);
- **replayed**: the schedule's plan played again with the pass durations this run measured
  (the median forward, backward and weight pass of each kind, ``schedules.timed``): what the
  plan predicts for these passes, which need not be the formula's equal lengths (here a pass
  that computes a gradient recomputes its stage's forward pass first; the first stage's ZB-H1
  backward pass has no gradient to compute: its input is the batch);
- the most bytes each stage kept for its backward passes (``timeline.peak_stashed_bytes()``).

Every run's parameters are checked against ``pk.SingleDevice`` (rtol 1e-5, atol 1e-6) after
its steps. The host costs of a pass (a thread wakes, dispatches, waits) are in the measured
bubble and not in the formula, so the margin between them is reported, not assumed.

    .venv/bin/python benchmarks/pipeline.py          # under a minute on 2 cores
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"

from interleaved import header, save  # noqa: E402

import parallelkit as pk  # noqa: E402

pk.simulate_devices(2)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from parallelkit.strategies.pipeline import schedules  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1}  # schedule -> chunks per stage
STAGES, WIDTH, BATCH = 2, 1024, 512


def formula(schedule: str, m: int, p: int = STAGES) -> float:
    """The textbook bubble for passes of equal length (a backward pass twice a forward one)."""
    v = SCHEDULES[schedule]
    return (p - 1) / (3 * m + p - 1) if schedule == "zb-h1" else (p - 1) / (v * m + p - 1)


def replayed(plan: list[schedules.Slot], timelines: list) -> float:
    """The plan's bubble with each kind of pass lasting its median measured duration."""
    durations = {
        kind: float(np.median([s.end - s.start for t in timelines for s in t.slots if s.kind == kind]))
        for kind in {s.kind for s in plan}
    }
    virtual = 1 + max(s.chunk for s in plan)
    orders = [[(*item, 0)[:3] for item in order] for order in schedules.stage_orders(plan)]
    return schedules.bubble_fraction(schedules.timed(orders, durations, virtual))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run, after one that compiles")
    parser.add_argument("--out", default="benchmarks/results/pipeline.json")
    args = parser.parse_args()
    data = pk.data.digits()
    layers, params = pk.models.as_layers(pk.models.MLP(64, (WIDTH,) * 3, data.num_classes, rngs=nnx.Rngs(0)))
    batches = list(pk.data.batches(data, BATCH, steps=args.steps + 1))
    single = pk.SingleDevice()
    expected, one = (
        single.init(params, optax.sgd(0.1)),
        single.step(pk.pipeline.sequential_loss(layers, pk.models.cross_entropy)),
    )
    for batch in batches:
        expected, _ = one(expected, batch)

    rows = []
    print(f"{'schedule':<12}{'m':>3}{'measured':>10}{'replayed':>10}{'formula':>9}  peak stash KiB per stage")
    for m in args.microbatches:
        for schedule, virtual in SCHEDULES.items():
            pipe = pk.Pipeline(layers, STAGES, m, schedule, virtual=virtual)
            state, step = pipe.init(params, optax.sgd(0.1)), pipe.step(pk.models.cross_entropy)
            timelines = []
            for i, batch in enumerate(batches):
                state, _ = step(state, batch)
                if i:  # the first step compiles
                    timelines.append(step.timeline)
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected.params), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{pipe}")
            row = {
                "schedule": schedule, "virtual": virtual, "microbatches": m,
                "measured": float(np.median([t.bubble_fraction() for t in timelines])),
                "replayed": replayed(pipe.planned(), timelines), "formula": formula(schedule, m),
                "peak_stashed_bytes": timelines[-1].peak_stashed_bytes(),
                "step_ms": float(np.median([schedules.makespan(t.slots) for t in timelines])) * 1e3,
            }  # fmt: skip
            rows.append(row)
            stash = ", ".join(f"{b / 1024:.0f}" for b in row["peak_stashed_bytes"].values())
            print(
                f"{schedule:<12}{m:>3}{row['measured']:>10.3f}{row['replayed']:>10.3f}{row['formula']:>9.3f}  {stash}"
            )
    save({**header("pipeline", args), "stages": STAGES, "width": WIDTH, "batch": BATCH, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
