"""``python -m parallelkit bench``: every strategy over 1, 2, 4 and 8 devices, and over processes.

Each row is checked against one device; results are a table, JSON (``--out``) and a PNG."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

MODELS = ("small", "wide")  # digits MLP 64-64-64-10; synthetic 784-1024-1024-10
LEARNING_RATE = 0.01  # plain SGD, for every strategy and its SingleDevice reference


@dataclass(frozen=True)
class _BenchRow:
    strategy: str
    devices: int
    processes: int
    global_batch: int
    compile_s: float
    median_step_ms: float
    p10_step_ms: float
    p90_step_ms: float
    samples_per_s: float
    speedup: float | None  # SingleDevice's median step / this median, same global batch, same cores (set by main)
    bytes_per_step: float | None  # per replica, measured (None: the strategy cannot say)
    memory_per_device: int | None  # bytes, from XLA's memory analysis (None: not one program)
    max_param_diff: float  # max |param - SingleDevice param| after the run
    equals_single: bool  # every parameter within rtol 1e-5, atol 1e-6 of SingleDevice's


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m parallelkit bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", help="device counts, one child each (default 1 2 4 8)")
    parser.add_argument("--processes", default=None, help="process layouts PxD, e.g. '2x2 4x1' (default 2x2), or none")
    parser.add_argument("--strategies", nargs="+", help="only these (names as in the table; SingleDevice always runs)")
    parser.add_argument("--model", choices=MODELS, default="small")
    parser.add_argument("--batch-per-device", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 and 4 devices, 2x2 processes, 5 steps: for CI")
    parser.add_argument("--cores-as-devices", action="store_true", help="one core's worth of threads per device")
    parser.add_argument("--out", default="benchmarks/results/bench.json", help="JSON here, the PNG beside it")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for each child process")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    return parser


def _model(name: str):
    """(loss, params, layers, layer params, dataset) of a named benchmark model."""
    from flax import nnx

    from .. import data, models

    if name == "wide":
        dataset, module = data.synthetic(4096, (784,), 10), models.MLP(784, (1024, 1024), 10, rngs=nnx.Rngs(0))
    else:
        dataset, module = data.digits(), models.MLP(64, (64, 64), 10, rngs=nnx.Rngs(0))
    apply, params = models.functional(module)
    layers = models.as_layers(module)
    return models.classifier_loss(apply), params, layers, dataset


def _strategies(n: int, only: Sequence[str] | None = None) -> list:
    """The catalog's bench entries that fit ``n`` devices (``only`` those named), the yardstick first and always.

    On one device the yardstick (:func:`parallelkit.strategies.catalog.reference`) runs alone.
    """
    from ..strategies import catalog

    yardstick = catalog.reference()
    fits = [e for e in catalog.entries(bench=True) if e is not yardstick and 1 < n and e.min_devices <= n]
    return [yardstick, *(e for e in fits if not only or e.name in only)]


def _run(strategy, loss, params, batches, warmup: int = 0, against=None):
    """The :class:`~parallelkit.run.compare.Run` of training ``strategy`` on ``batches`` with the bench's SGD, the
    next batches placed ahead (:func:`parallelkit.run.prefetch`); compared with ``against`` when given."""
    import optax

    from ..run.compare import run_side_by_side

    name = repr(strategy)
    runs = run_side_by_side({name: strategy}, loss, params, optax.sgd(LEARNING_RATE), batches, warmup=warmup,
                            prefetch=2, against=against)  # fmt: skip
    return runs[name]


def _extras(strategy, loss, params, batch) -> tuple[float | None, int | None]:
    """(bytes per replica per step, memory per device) where the strategy can say."""
    import optax

    from ..measure.inspect import memory_per_device

    state = strategy.init(params, optax.sgd(LEARNING_RATE))
    try:
        traffic = strategy.traffic(loss, state, batch)
        moved = float(sum(f.measured for f in traffic.flows))
    except NotImplementedError:
        moved = None
    try:
        memory = memory_per_device(strategy.step(loss), state, batch).total
    except (NotImplementedError, AttributeError, TypeError):  # several programs: no one analysis
        memory = None
    return moved, memory


def _row(name: str, n: int, processes: int, run, extras) -> _BenchRow:
    """A row of one :class:`~parallelkit.run.compare.Run`; ``extras``: what :func:`_extras` found."""
    times = run.times
    return _BenchRow(
        name, n, processes, times.batch_size, times.first_step_seconds, times.median * 1e3,
        times.percentile(10) * 1e3, times.percentile(90) * 1e3, times.samples_per_second, None, *extras,
        run.max_param_diff, run.equals_reference,
    )  # fmt: skip


def _child(args: argparse.Namespace) -> list[dict]:
    import parallelkit as pk

    n = args.child
    pk.simulate_devices(n, cores_as_devices=args.cores_as_devices)

    loss, params, layers, dataset = _model(args.model)
    size = args.batch_per_device * n
    batches = list(pk.data.batches(dataset, size, steps=1 + args.warmup + args.steps, seed=0))
    rows, reference = [], None
    for entry in _strategies(n, args.strategies):
        strategy = entry.make(n, layers.apply) if entry.layers else entry.make(n)
        model_loss, model_params = (pk.models.cross_entropy, layers.params) if entry.layers else (loss, params)
        extras = _extras(strategy, model_loss, model_params, batches[0])
        against = reference
        if entry.layers:  # the same layers composed on one device
            single_loss = pk.pipeline.sequential_loss(layers.apply, pk.models.cross_entropy)
            against = _run(pk.SingleDevice(), single_loss, layers.params, batches).params
        run = _run(strategy, model_loss, model_params, batches, args.warmup, against)
        reference = run.params if reference is None else reference  # SingleDevice runs first
        rows.append(asdict(_row(entry.name, n, 1, run, extras)))
    return rows


def _worker(args: argparse.Namespace) -> None:
    """One process of a multi-process layout; process 0 writes the row."""
    import parallelkit as pk

    pk.distributed.initialize()
    import jax

    loss, params, _, dataset = _model(args.model)
    n = jax.device_count()
    size = args.batch_per_device * n
    batches = list(pk.data.batches(dataset, size, steps=1 + args.warmup + args.steps, seed=0))
    single = _run(pk.SingleDevice(jax.local_devices()[0]), loss, params, batches).params
    run = _run(pk.MultiWorkerMirrored(), loss, params, batches, args.warmup, single)  # this process's replica
    row = _row("MultiWorkerMirrored", n, jax.process_count(), run, (None, None))
    if jax.process_index() == 0:
        Path(args.child_out).write_text(json.dumps([asdict(row)]))


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--batch-per-device", str(args.batch_per_device), "--steps", str(args.steps),
            "--warmup", str(args.warmup)] + (["--cores-as-devices"] if args.cores_as_devices else []) + (
            ["--strategies", *args.strategies] if args.strategies else [])  # fmt: skip


def _run_child(args: argparse.Namespace, n: int = 0, layout: tuple[int, int] | None = None) -> list[dict]:
    """The rows of a child process with ``n`` devices, or of the processes of ``layout`` (processes, devices each)."""
    from ..run.distributed import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        role = ["--worker"] if layout else ["--child", str(n)]
        command = [sys.executable, "-m", "parallelkit.course.bench", *role, "--child-out", str(out), *_forward(args)]
        if layout:
            env = {"PJRT_NPROC": str(layout[1])} if args.cores_as_devices else None
            launch(command, *layout, timeout=args.timeout, env=env, stream=False)
        else:
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
            done = subprocess.run(command, env=env, timeout=args.timeout, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"The benchmark child for {n} device(s) failed (exit {done.returncode}); see above.")
        return json.loads(out.read_text())


def parse_layouts(text: str | None) -> list[tuple[int, int]]:
    """``"2x2 4x1"`` as ``[(2, 2), (4, 1)]`` (processes x devices each); ``"none"``: no multi-process rows."""
    if text == "none":
        return []
    layouts = []
    for part in (text or "2x2").split():
        p, _, d = part.partition("x")
        if not (p.isdigit() and d.isdigit() and int(p) >= 2 and int(d) >= 1):
            raise SystemExit(f"--processes {part!r}: write PxD, P >= 2 processes of D devices (e.g. 2x2).")
        layouts.append((int(p), int(d)))
    return layouts


def yardsticks(cores_as_devices: bool) -> dict[str, str]:
    """What each ratio of the table is measured against, in the given mode."""
    if cores_as_devices:
        same = "one device on the same n cores (the child's pool of n threads, which XLA spreads its work over)"
        one = "one device on one core (a pool of one thread)"
    else:
        same = "one device on the same cores (every core, as the simulated devices share them)"
        one = "one device on every core"
    return {
        "speedup": f"SingleDevice's median step / this row's, same global batch, same child: {same}",
        "throughput_ratio": f"samples/s / SingleDevice's samples/s in the 1-device child: {one}",
        "scaling_efficiency": "throughput_ratio / devices (1.0: perfect weak scaling)",
    }


def add_ratios(rows: list[dict]) -> None:
    """Set each row's ``speedup``, ``throughput_ratio`` and ``scaling_efficiency`` (see :func:`yardsticks`)."""
    from ..strategies import catalog

    yardstick = catalog.reference().name
    singles = {r["devices"]: r for r in rows if r["strategy"] == yardstick and r["processes"] == 1}
    one = singles.get(1)
    for r in rows:
        same = singles.get(r["devices"])  # same global batch, same cores
        r["speedup"] = None if same is None else same["median_step_ms"] / r["median_step_ms"]
        r["throughput_ratio"] = None if one is None else r["samples_per_s"] / one["samples_per_s"]
        r["scaling_efficiency"] = None if one is None else r["throughput_ratio"] / r["devices"]


def unequal_rows(rows: list[dict]) -> list[str]:
    """The rows whose parameters did not end within rtol 1e-5, atol 1e-6 of their SingleDevice reference."""
    return [
        f"{r['strategy']} on {r['devices']} device(s) in {r['processes']} process(es): "
        f"max |dp| {r['max_param_diff']:.2e}"
        for r in rows
        if r["equals_single"] is not True
    ]


def format_table(rows: list[dict], cores_as_devices: bool = False) -> str:
    """The rows as a text table, with what each ratio is measured against below it."""
    head = (f"{'strategy':<20}{'dev':>4}{'proc':>5}{'batch':>6}{'compile s':>10}{'step ms':>9}{'samples/s':>11}"
            f"{'speed-up':>9}{'thru x':>7}{'scaling':>8}{'bytes/step':>12}{'mem/device':>12}{'max |dp|':>10}"
            f"{'=1dev':>6}")  # fmt: skip

    def cell(value, spec: str, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"

    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['strategy']:<20}{r['devices']:>4}{r['processes']:>5}{r['global_batch']:>6}{r['compile_s']:>10.2f}"
            f"{r['median_step_ms']:>9.2f}{r['samples_per_s']:>11.0f}{cell(r['speedup'], '.2f', 9)}"
            f"{cell(r.get('throughput_ratio'), '.2f', 7)}{cell(r.get('scaling_efficiency'), '.2f', 8)}"
            f"{cell(r['bytes_per_step'], ',.0f', 12)}{cell(r['memory_per_device'], ',', 12)}"
            f"{cell(r['max_param_diff'], '.1e', 10)}{'yes' if r['equals_single'] else 'NO':>6}"
        )
    ratios = yardsticks(cores_as_devices)
    lines += ["", f"speed-up: {ratios['speedup']}", f"thru x: {ratios['throughput_ratio']}",
              f"scaling: {ratios['scaling_efficiency']}",
              "=1dev: every parameter within rtol 1e-5, atol 1e-6 of SingleDevice's on the same batches"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(_child(args)))
        return 0
    if args.worker:
        _worker(args)
        return 0
    if args.quick:
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 1)
    counts = args.devices or ([1, 4] if args.quick else [1, 2, 4, 8])
    layouts = parse_layouts(args.processes)
    rows: list[dict] = []
    for n in counts:
        print(f"bench: {n} device(s) ...", flush=True)
        rows += _run_child(args, n)
    for processes, per_process in layouts:
        print(f"bench: {processes} processes x {per_process} device(s) ...", flush=True)
        rows += _run_child(args, layout=(processes, per_process))
    add_ratios(rows)
    print(format_table(rows, args.cores_as_devices))
    _save(args, argv, counts, layouts, rows)
    if bad := unequal_rows(rows):
        print(
            f"bench: FAILED: {len(bad)} row(s) did not end with SingleDevice's parameters (rtol 1e-5, atol 1e-6), "
            "so their times are of another computation than one device's (marked equals_single: false in the "
            "JSON):\n  " + "\n  ".join(bad),
            file=sys.stderr,
        )
        return 1
    return 0


def _save(args: argparse.Namespace, argv: list[str], counts, layouts, rows: list[dict]) -> None:
    import jax

    from ..viz.bench import bench_figure

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mode = "cores as devices" if args.cores_as_devices else "shared cores"
    result = {
        "what": "python -m parallelkit bench" + (" --quick" if args.quick else ""),
        "command": " ".join(["python -m parallelkit bench", *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__, "machine": platform.machine(), "processor": platform.processor(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "device": "simulated CPU devices" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind,
        "mode": mode, "model": args.model, "batch_per_device": args.batch_per_device,
        "steps": args.steps, "warmup": args.warmup, "devices": counts, "processes": [list(x) for x in layouts],
        "yardsticks": yardsticks(args.cores_as_devices), "all_equal_single": not unequal_rows(rows),
        "rows": rows,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    figure = bench_figure(rows, title=f"{result['device']} ({mode}), {args.model} model")
    figure.savefig(out.with_suffix(".png"), dpi=100)
    print(f"Saved {out} and {out.with_suffix('.png')}.")


if __name__ == "__main__":
    sys.exit(main())
