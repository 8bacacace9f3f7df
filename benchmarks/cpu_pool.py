"""What does sizing XLA's CPU thread pool for simulated devices cost?

``pk.simulate_devices(n)`` sets ``PJRT_NPROC=2n`` on machines with fewer cores, so that
a loop that never waits cannot deadlock XLA's CPU runtime (see ``parallelkit.core.devices``).
The larger pool also means more threads competing for the same cores. This script
measures the step time both ways, on the workloads where the deadlock was seen:

- ``digits-mlp``: the README's model (digits MLP, Adam, global batch 64), 8 devices;
- ``wide-mlp``: an MLP 784-1024-1024-10, SGD, global batch 256, 2 devices.

The pool size is fixed when JAX starts, so every measurement is a fresh child process:
``pool=cores`` (``PJRT_NPROC`` set to the core count, XLA's default) and ``pool=2n``
alternate, ``--repeats`` times each. Each child times ``--steps`` steps of
``pk.Mirrored(backend="jit")`` after the compiling one, each up to ``block_until_ready``,
and reports the median; the table gives the median over the repeats and the ratio.

    .venv/bin/python benchmarks/cpu_pool.py                 # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"digits-mlp": 8, "wide-mlp": 2}


def _child(workload: str, steps: int) -> float:
    import numpy as np

    import parallelkit as pk

    pk.simulate_devices(WORKLOADS[workload])
    import jax
    import optax
    from flax import nnx

    if workload == "wide-mlp":
        data = pk.data.synthetic(2048, (784,), 10)
        apply, params = pk.models.functional(pk.models.MLP(784, (1024, 1024), 10, rngs=nnx.Rngs(0)))
        tx, size = optax.sgd(0.05), 256
    else:
        data = pk.data.digits()
        apply, params = pk.models.build("mlp", data.input_shape, data.num_classes)
        tx, size = optax.adam(1e-3), 64
    strategy = pk.Mirrored(backend="jit")
    state, step = strategy.init(params, tx), strategy.step(pk.models.classifier_loss(apply))
    seconds = []
    for batch in pk.data.batches(data, size, steps=steps + 1):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds[1:]))


def _measure(workload: str, pool: str, steps: int) -> float:
    from parallelkit.core.devices import _cores

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
    if pool == "cores":
        env["PJRT_NPROC"] = str(_cores())  # a value set by the user is kept: XLA's default pool size
    out = subprocess.run(
        [sys.executable, __file__, "--child", workload, "--steps", str(steps)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env, check=True,
    )  # fmt: skip
    return float(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/cpu_pool.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(_child(args.child, args.steps))
        return
    import numpy as np

    from parallelkit.core.devices import _cores

    results = {}
    for workload, devices in WORKLOADS.items():
        runs = {"cores": [], "2n": []}
        for _ in range(args.repeats):
            for pool in runs:  # alternate, so that machine drift hits both alike
                runs[pool].append(_measure(workload, pool, args.steps))
        medians = {pool: float(np.median(v)) for pool, v in runs.items()}
        results[workload] = {
            "devices": devices,
            "pool_threads": {"cores": max(_cores(), devices), "2n": max(_cores(), 2 * devices)},
            "median_step_ms": {pool: m * 1e3 for pool, m in medians.items()},
            "runs_ms": {pool: [x * 1e3 for x in v] for pool, v in runs.items()},
            "ratio_2n_to_cores": medians["2n"] / medians["cores"],
        }
    print(f"{'workload':<11} {'devices':>7} {'pool=cores ms':>14} {'pool=2n ms':>11} {'2n/cores':>9}")
    for name, r in results.items():
        ms = r["median_step_ms"]
        print(f"{name:<11} {r['devices']:>7} {ms['cores']:>14.2f} {ms['2n']:>11.2f} {r['ratio_2n_to_cores']:>9.2f}")
    print(f"{_cores()} cores; simulated CPU devices; median over {args.repeats} child processes of each.")
    record = {
        "benchmark": "cpu_pool",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cores": _cores()},
        "args": vars(args),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"Saved {args.out}")


if __name__ == "__main__":
    main()
