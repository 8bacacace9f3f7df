"""What does a live view cost per step? The dashboard's callback, timed on its own.

``pk.viz.TimingDashboard`` and ``pk.viz.StrategyRace`` promise not to slow
the steps they measure: they record every step but redraw at most every
``min_interval`` seconds. This script calls ``TimingDashboard.on_step_end`` in widget
mode (no notebook needed: the widgets are built, their display goes nowhere) between
``--steps`` fake steps of 1 ms (a sleep, outside the timed call), and reports the median and p99 cost of one call,
from the best of ``--repeats`` runs, beside the redraw count.

    .venv/bin/python benchmarks/dashboard.py          # a few seconds
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import platform
import time
from pathlib import Path

import numpy as np


def one_run(steps: int, min_interval: float) -> tuple[np.ndarray, int]:
    import parallelkit as pk
    from parallelkit.viz import TimingDashboard

    dash = TimingDashboard(batch_size=64, mode="widget", min_interval=min_interval)
    with contextlib.redirect_stdout(io.StringIO()):  # outside a notebook, display() prints the widget's repr
        dash.on_train_begin(pk.run.training.RunInfo("bench", 1, steps, False))
    costs = np.empty(steps)
    for i in range(1, steps + 1):
        time.sleep(0.001)  # the step itself
        record = pk.StepRecord(i, {"loss": 1.0 / i}, 0.001, compiled=i == 1)
        start = time.perf_counter()
        dash.on_step_end(record)
        costs[i - 1] = time.perf_counter() - start
    with contextlib.redirect_stdout(io.StringIO()):
        dash.on_train_end(None, interrupted=False)
    return costs, dash.redraws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-interval", type=float, default=0.3)
    parser.add_argument("--out", default="benchmarks/results/dashboard.json")
    args = parser.parse_args()
    runs = [one_run(args.steps, args.min_interval) for _ in range(args.repeats)]
    costs, redraws = min(runs, key=lambda run: float(np.median(run[0])))
    median_us, p99_us = np.median(costs) * 1e6, np.percentile(costs, 99) * 1e6
    print(f"TimingDashboard.on_step_end, widget mode, {args.steps} steps (best of {args.repeats} runs):")
    print(f"  median {median_us:.1f} us, p99 {p99_us:.1f} us, max {costs.max() * 1e3:.1f} ms, {redraws} redraws")
    record = {
        "benchmark": "dashboard",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"python": platform.python_version(), "machine": platform.machine()},
        "args": vars(args),
        "median_us": median_us,
        "p99_us": p99_us,
        "max_ms": costs.max() * 1e3,
        "redraws": redraws,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"Saved {args.out}")


if __name__ == "__main__":
    main()
