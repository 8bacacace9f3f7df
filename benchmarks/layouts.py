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

What ran, read rather than guessed: process 0 parses the compiled HLO of the ``psum``
program and of the training step and records each all-reduce's replica groups (and the
devices, with their processes, in mesh order), and the launcher's log gives the gloo
contexts the CPU runtime formed ("[Gloo] Rank r is connected to k peer ranks", one line
per rank it hosts). The HLO names which devices reduce together, not how: on CPU that is
the runtime's choice. Within one process it is XLA's in-process communicator; across
processes, XLA's gloo communicator runs gloo's ring algorithm over one gloo rank per
device (``xla/backends/cpu/collectives/gloo_communicator.cc`` sets
``gloo::AllreduceOptions::Algorithm::RING``), so two devices of one process also
exchange over gloo's TCP transport.

Then the cost model is calibrated, not told: ``pk.costmodel.fit_link`` fits one link
to 1x4's all-reduce times (devices of one process: the "inside" link) and one to 4x1's
(every device its own process: the loopback "network" link). With those two links the
model predicts 2x2's all-reduces, which were not fitted, under two formulas: a flat
ring over the 4 devices, and hierarchical (inside each process, then across); which
one fits better is recorded as a fit (``better_fit``), not as what ran. Each layout's
step is predicted as its measured compute plus the all-reduce of the gradients as a
flat ring, the algorithm the runtime runs (the update and the rest, which the model
leaves out, are the remainder).

Run: ``.venv/bin/python benchmarks/layouts.py`` (about two minutes on 2 cores); it
prints the tables and writes ``benchmarks/results/layouts.json``, and exits with status 1
if a layout's parameters left SingleDevice's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import tempfile
from pathlib import Path

LAYOUTS = ((1, 4), (2, 2), (4, 1))  # processes x devices each
SIZES = (4_000, 64_000, 1_000_000, 4_000_000)  # bytes per device in each timed all-reduce
# the replica_groups attribute in each form XLA prints
_REPLICA_GROUPS = re.compile(
    r"replica_groups=(\{\{[0-9,{}]*\}\}"  # {{0,1,2,3}}
    r"|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?"  # [1,4]<=[4]
    r"|mesh\[[^\]]*\]\s*\{[^}]*\})"  # mesh['axis_0'=4,'axis_1'=1] {'axis_0'}
)
_GLOO_RANK = re.compile(r"\[Gloo\] Rank (\d+) is connected to (\d+) peer ranks")


def _median_seconds(fn, *args, repeats: int) -> float:
    import numpy as np

    from parallelkit.measure.timing import timed

    timed(fn, *args)  # compile and warm up
    timed(fn, *args)
    return float(np.median([timed(fn, *args)[1] for _ in range(repeats)]))


def _global(mesh, spec, host):
    """A global array of the same host value in every process, cut by ``spec``."""
    import jax
    from jax.sharding import NamedSharding

    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def allreduces(hlo_text: str) -> list[dict]:
    """Each all-reduce of a compiled program: its replica groups as XLA wrote them, group size and bytes.

    >>> allreduces("%ar = f32[8]{0} all-reduce(f32[8]{0} %g), channel_id=1, replica_groups={{0,1,2,3}}, x")
    [{'replica_groups': '{{0,1,2,3}}', 'group_size': 4, 'bytes': 32}]
    """
    from parallelkit.measure.inspect import parse_collectives

    found = []
    for line in hlo_text.splitlines():
        parsed = [c for c in parse_collectives(line) if c.op == "all-reduce"]
        if parsed and (groups := _REPLICA_GROUPS.search(line)):
            found.append({"replica_groups": groups.group(1), "group_size": parsed[0].group_size,
                          "bytes": parsed[0].bytes})  # fmt: skip
    return found


def gloo_ranks(output: str) -> list[dict]:
    """The gloo ranks a process's runtime log reports: ``[{"rank": r, "peers": k}, ...]``, in order."""
    return [{"rank": int(r), "peers": int(k)} for r, k in _GLOO_RANK.findall(output)]


def _worker(args: argparse.Namespace) -> None:
    import parallelkit as pk

    pk.distributed.initialize()
    import jax
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from parallelkit.course.bench import LEARNING_RATE, _model, _run
    from parallelkit.measure.inspect import compiled_text

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows: dict = {"processes": jax.process_count(), "devices": n, "allreduce_s": {}, "hlo": {}}

    summed = jax.jit(jax.shard_map(lambda v: lax.psum(v, "data"), mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    for size in SIZES:
        x = _global(mesh, P("data"), np.ones((n, size // 4), np.float32))
        rows["allreduce_s"][str(size)] = _median_seconds(summed, x, repeats=args.repeats)
    rows["hlo"]["psum"] = allreduces(compiled_text(summed, x))

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
    rows["mesh"] = [[d.id, d.process_index] for d in strategy.mesh.devices.flat]  # position -> device, process
    state = strategy.init(params, optax.sgd(LEARNING_RATE))
    rows["hlo"]["step"] = allreduces(compiled_text(strategy.step(loss), state, batches[0]))
    rows["step_s"] = float(_run(strategy, loss, params, batches, args.warmup).times.median)
    checked = batches[: args.check_steps]
    single = _run(pk.SingleDevice(jax.local_devices()[0]), loss, params, checked).params
    check = _run(strategy, loss, params, checked, against=single)
    rows["max_param_diff"], rows["equals_single"] = check.max_param_diff, check.equals_reference
    if jax.process_index() == 0:
        Path(args.child_out).write_text(json.dumps(rows))


def _run(args: argparse.Namespace, processes: int, per_process: int) -> dict:
    from parallelkit.run.distributed import launch

    forward = ["--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch-per-device", str(args.batch_per_device), "--check-steps", str(args.check_steps)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "layout.json"
        command = [sys.executable, __file__, "--worker", "--child-out", str(out), *forward]
        reports = launch(command, processes, per_process, timeout=args.timeout, stream=False)
        measured = json.loads(out.read_text())
    measured["gloo_ranks"] = [gloo_ranks(report.output) for report in reports]  # one list per process
    return measured


def what_ran(m: dict) -> str:
    """What a layout's compiled all-reduces and its runtime log say ran, in one sentence."""
    devices = m["devices"]
    found = [a for program in m["hlo"].values() for a in program]
    groups = " and ".join(sorted({a["replica_groups"] for a in found}))
    whole = found and all(a["group_size"] == devices for a in found)
    text = f"HLO: {len(found)} all-reduce(s) in the psum program and the step, replica groups {groups}" + (
        f", one group of all {devices} devices" if whole else ""
    )
    if m["processes"] == 1:
        return text + "; runtime: one process, XLA's in-process communicator"
    ranks = [sorted(r["rank"] for r in lines if r["peers"] + 1 == devices) for lines in m["gloo_ranks"]]
    if not any(ranks):
        return text + f"; runtime: the log showed no gloo context of {devices} ranks"
    hosted = ", ".join(f"process {p} ranks {r}" for p, r in enumerate(ranks))
    return (
        text + f"; runtime: one gloo context of {devices} ranks, one per device ({hosted}), so gloo's ring runs "
        "over all of them, with no reduction inside each process first"
    )


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

    better_fit = min(("ring", "hierarchical"), key=lambda a: error("2x2", a))  # a fit, not what ran
    out: dict = {"inside": inside.__dict__, "network": network.__dict__, "better_fit": better_fit, "layouts": {}}
    for key, cluster in clusters.items():
        m = measured[key]
        gradients = cm.allreduce_seconds(cluster, m["param_bytes"], "ring")  # the runtime runs a flat ring
        out["layouts"][key] = {
            "what_ran": what_ran(m),
            "allreduce_measured_s": times(key),
            "allreduce_ring_s": [cm.allreduce_seconds(cluster, s, "ring") for s in sizes],
            "allreduce_hierarchical_s": [cm.allreduce_seconds(cluster, s, "hierarchical") for s in sizes],
            "error_ring": error(key, "ring"),
            "error_hierarchical": error(key, "hierarchical"),
            "compute_s": m["compute_s"],
            "gradient_allreduce_s": gradients,
            "step_predicted_s": m["compute_s"] + gradients,
            "step_measured_s": m["step_s"],
            "step_error": (m["compute_s"] + gradients - m["step_s"]) / m["step_s"],  # predicted vs measured
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
    lines += ["mean relative error: " + "; ".join(errors), f"better fit to 2x2: {result['better_fit']} (a fit)"]
    lines += [f"{key}: {r['what_ran']}" for key, r in result["layouts"].items()]
    lines += ["the steps below predict the gradients' all-reduce as a flat ring, as the runtime runs it"]
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
    if differ := [key for key, r in result["layouts"].items() if not r["equals_single"]]:
        print(f"layouts: FAILED: MultiWorkerMirrored left SingleDevice's parameters in {differ} "
              "(rtol 1e-5, atol 1e-6): those steps time another computation.", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
