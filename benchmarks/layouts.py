"""One process or several: data parallelism over 4 devices as 1x4, 2x2 and 4x1, beside the cost model.

The same global batch trains with ``pk.MultiWorkerMirrored`` over 4 simulated CPU
devices laid out as 1 process x 4 devices (no network), 2 processes x 2 devices and
4 processes x 1 device, the processes joined by ``pk.distributed.launch`` (gloo over
loopback). In every layout the script measures, process 0 reporting:

1. all-reduce: ``lax.psum`` over all 4 devices (in ``jax.shard_map``) of float32
   arrays of several sizes, median seconds of each;
2. compute: the same gradient computation without any collective (each device its own
   gradients of its quarter of the batch), median step seconds;
3. the training step: ``pk.MultiWorkerMirrored``, median step seconds; then, from the
   same initial parameters, ``--check-steps`` steps (5) of it and of ``pk.SingleDevice``
   on the same batches, whose parameters must agree (rtol 1e-5, atol 1e-6). Longer runs
   of this model part by more: a ReLU whose input lies within rounding of zero flips
   under another summation order (measured with ``pk.Mirrored(4)``: every parameter
   within 1.5e-8 for 14 steps, then a jump to 2.6e-6 at step 15), a real difference
   of float32 arithmetic, not of the strategy.

Then the cost model is calibrated, not told: ``pk.costmodel.fit_link`` fits one link
to 1x4's all-reduce times (devices of one process: the "inside" link) and one to 4x1's
(every device its own process: the loopback "network" link). With those two links the
model predicts 2x2's all-reduces, which were not fitted, under two readings: a flat
ring over the 4 devices, and hierarchical (inside each process, then across). It also
predicts each layout's step as the layout's measured compute plus the all-reduce of
the gradients, read the way that fits 2x2's all-reduces better (the update and the
rest, which the model leaves out, are the remainder).

Run: ``.venv/bin/python benchmarks/layouts.py`` (about two minutes on 2 cores); it
prints the tables and writes ``benchmarks/results/layouts.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path

LAYOUTS = ((1, 4), (2, 2), (4, 1))  # processes x devices each
SIZES = (4_000, 64_000, 1_000_000, 4_000_000)  # bytes per device in each timed all-reduce


def _median_seconds(fn, *args, repeats: int) -> float:
    import numpy as np

    from parallelkit.timing import timed

    timed(fn, *args)  # compile and warm up
    timed(fn, *args)
    return float(np.median([timed(fn, *args)[1] for _ in range(repeats)]))


def _global(mesh, spec, host):
    """A global array of the same host value in every process, cut by ``spec``."""
    import jax
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _worker(args: argparse.Namespace) -> None:
    import parallelkit as pk

    pk.distributed.initialize()
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from parallelkit.bench import _measure, _model

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows: dict = {"processes": jax.process_count(), "devices": n, "allreduce_s": {}}

    summed = jax.jit(jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    for size in SIZES:
        x = _global(mesh, P("data"), np.ones((n, size // 4), np.float32))
        rows["allreduce_s"][str(size)] = _median_seconds(summed, x, repeats=args.repeats)

    loss, params, _, dataset = _model("wide")
    size = args.batch_per_device * n
    batches = list(pk.data.batches(dataset, size, steps=1 + args.warmup + args.steps, seed=0))

    def own_gradients(p, batch):  # each device its own gradients: the compute without the all-reduce
        grads, _ = jax.grad(loss, has_aux=True)(p, batch)
        return jax.tree.map(lambda g: g[None], grads)

    compute = jax.jit(jax.shard_map(own_gradients, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
    replicated = jax.tree.map(lambda leaf: _global(mesh, P(), np.asarray(leaf)), params)
    first = jax.tree.map(lambda a: _global(mesh, P("data"), np.asarray(a)), batches[0])
    rows["compute_s"] = _median_seconds(compute, replicated, first, repeats=args.repeats)
    rows["param_bytes"] = int(sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(params)))

    strategy = pk.MultiWorkerMirrored()
    _, _, seconds = _measure(strategy, loss, params, batches, args.warmup)
    rows["step_s"] = float(np.median(seconds))
    rows["max_param_diff"], rows["equals_single"] = _against_single(strategy, loss, params, batches[: args.check_steps])
    if jax.process_index() == 0:
        Path(args.child_out).write_text(json.dumps(rows))


def _against_single(strategy, loss, params, batches) -> tuple[float, bool]:
    """Train ``strategy`` and SingleDevice (on this process's first device) on ``batches``; compare."""
    import jax
    import numpy as np
    import optax

    import parallelkit as pk
    from parallelkit.tour import max_abs_diff

    def train(s):
        state, step = s.init(params, optax.sgd(0.01)), s.step(loss)
        for batch in batches:
            state, _ = step(state, batch)
        return jax.tree.leaves(s.unreplicate(state.params))

    ours, single = train(strategy), train(pk.SingleDevice(jax.local_devices()[0]))
    same = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, single, strict=True))
    return max_abs_diff(ours, single), same


def _run(args: argparse.Namespace, processes: int, per_process: int) -> dict:
    from parallelkit.distributed import launch

    forward = ["--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch-per-device", str(args.batch_per_device), "--check-steps", str(args.check_steps)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "layout.json"
        command = [sys.executable, __file__, "--worker", "--child-out", str(out), *forward]
        launch(command, processes, per_process, timeout=args.timeout, stream=False)
        return json.loads(out.read_text())


def predictions(measured: dict[str, dict]) -> dict:
    """The calibrated links and, per layout, the model's all-reduce and step times beside the measured ones."""
    from parallelkit import costmodel as cm

    sizes = [float(s) for s in SIZES]

    def times(key: str) -> list[float]:
        return [measured[key]["allreduce_s"][str(s)] for s in SIZES]

    inside = cm.fit_link(4, sizes, times("1x4"), "fitted: devices in one process")
    network = cm.fit_link(4, sizes, times("4x1"), "fitted: loopback between processes")
    clusters = {"1x4": cm.Cluster(1, 4, inside), "2x2": cm.Cluster(2, 2, inside, network),
                "4x1": cm.Cluster(4, 1, inside, network)}  # fmt: skip

    def error(key: str, algorithm: str) -> float:  # mean relative error over the sizes
        got = [cm.allreduce_seconds(clusters[key], s, algorithm) for s in sizes]
        return sum(abs(g - t) / t for g, t in zip(got, times(key), strict=True)) / len(sizes)

    reading = min(("ring", "hierarchical"), key=lambda a: error("2x2", a))  # what 2x2's all-reduces support
    out: dict = {"inside": inside.__dict__, "network": network.__dict__, "reading": reading, "layouts": {}}
    for key, cluster in clusters.items():
        m = measured[key]
        gradients = cm.allreduce_seconds(cluster, m["param_bytes"], reading)
        out["layouts"][key] = {
            "allreduce_measured_s": times(key),
            "allreduce_ring_s": [cm.allreduce_seconds(cluster, s, "ring") for s in sizes],
            "allreduce_hierarchical_s": [cm.allreduce_seconds(cluster, s, "hierarchical") for s in sizes],
            "error_ring": error(key, "ring"),
            "error_hierarchical": error(key, "hierarchical"),
            "compute_s": m["compute_s"],
            "gradient_allreduce_s": gradients,
            "step_predicted_s": m["compute_s"] + gradients,
            "step_measured_s": m["step_s"],
            "max_param_diff": m["max_param_diff"],
            "equals_single": m["equals_single"],
        }
    return out


def _table(result: dict) -> str:
    inside, network = result["inside"], result["network"]
    lines = [
        f"inside one process: {inside['GBps']:.2f} GB/s, {inside['latency_us']:.0f} us (fitted on 1x4)",
        f"between processes:  {network['GBps']:.2f} GB/s, {network['latency_us']:.0f} us (fitted on 4x1)",
        "",
        f"{'layout':<8}{'bytes/device':>14}{'measured ms':>13}{'ring ms':>10}{'hier. ms':>10}",
    ]
    errors = []
    for key, r in result["layouts"].items():
        for size, m, ring, hier in zip(
            SIZES, r["allreduce_measured_s"], r["allreduce_ring_s"], r["allreduce_hierarchical_s"], strict=True
        ):
            lines.append(f"{key:<8}{size:>14,}{m * 1e3:>13.3f}{ring * 1e3:>10.3f}{hier * 1e3:>10.3f}")
        errors.append(f"{key}: ring {r['error_ring']:.0%}, hierarchical {r['error_hierarchical']:.0%}")
    lines += ["mean relative error: " + "; ".join(errors), f"the steps below use the {result['reading']} reading"]
    lines += ["", f"{'layout':<8}{'compute ms':>12}{'+ all-reduce':>14}{'= predicted':>13}{'measured':>10}{'equal':>7}"]
    for key, r in result["layouts"].items():
        lines.append(
            f"{key:<8}{r['compute_s'] * 1e3:>12.2f}{r['gradient_allreduce_s'] * 1e3:>14.2f}"
            f"{r['step_predicted_s'] * 1e3:>13.2f}{r['step_measured_s'] * 1e3:>10.2f}{str(r['equals_single']):>7}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-per-device", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20, help="timed all-reduces and compute steps per median")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check-steps", type=int, default=5, help="steps trained again to compare with SingleDevice")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for each layout")
    parser.add_argument("--out", default="benchmarks/results/layouts.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    import jax

    measured = {}
    for processes, per_process in LAYOUTS:
        print(f"layouts: {processes} process(es) x {per_process} device(s) ...", flush=True)
        measured[f"{processes}x{per_process}"] = _run(args, processes, per_process)
    result = predictions(measured)
    print(_table(result))
    record = {
        "jax": jax.__version__, "platform": platform.platform(), "processor": platform.processor(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "simulated": "CPU devices; processes joined by gloo over loopback", "args": vars(args),
        "sizes": SIZES, "measured": measured, **result,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
