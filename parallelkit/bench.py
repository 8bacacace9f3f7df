"""``python -m parallelkit bench``: every strategy over 1, 2, 4 and 8 devices, and over processes.

For each device count a fresh child process (the simulated device count is fixed
when JAX starts) trains the same model, from the same initial parameters, on the
same global batches (``--batch-per-device`` x devices examples) with every strategy
that fits that many devices, SingleDevice among them on the same global batch: its
median is the yardstick of that child's ratios. Each strategy's first call (trace,
compile, one step) is timed apart; after ``--warmup`` steps, ``--steps`` steps are
timed one by one, each up to ``jax.block_until_ready``, with the next batch placed
by :func:`parallelkit.prefetch` before the clock starts. The strategies run one
after another, not interleaved: the ratios carry the machine's drift over a child's
run (``benchmarks/strategies.py`` interleaves, for finer comparisons).

Also per strategy, where it can say: the bytes one step moves per replica
(``strategy.traffic``: batch, collectives, copies between memories), the memory one
device needs (``pk.inspect.memory_per_device``), and the largest difference from
SingleDevice's parameters after the run, with whether every parameter is within
rtol 1e-5, atol 1e-6 of them (``equals_single``). Multi-process rows run
:class:`~parallelkit.MultiWorkerMirrored` under :func:`parallelkit.distributed.launch`
(gloo over loopback); their ratio uses SingleDevice from the child with as many devices.

Two ratios: ``speed-up`` is SingleDevice's median step over the strategy's on the
same global batch in the same child; ``scaling`` is weak-scaling efficiency,
samples/s over (devices x the samples/s of SingleDevice in the one-device child),
1.0 being perfect. With ``--cores-as-devices`` the one-device child has one core and
an ``n``-device child ``n``, so ``scaling`` measures real data-parallel speed-up.

Results: a table on stdout, JSON (``--out``) and a PNG of samples/s beside it.
``--quick`` runs 1 and 4 devices and 2 processes x 2 devices, a few steps each: for CI.
``--cores-as-devices`` gives each simulated device one core's worth of threads
(:func:`parallelkit.simulate_devices`), for device counts up to the core count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

MODELS = ("small", "wide")  # digits MLP 64-64-64-10; synthetic 784-1024-1024-10


@dataclass(frozen=True)
class BenchRow:
    strategy: str
    devices: int
    processes: int
    global_batch: int
    compile_s: float
    median_step_ms: float
    p10_step_ms: float
    p90_step_ms: float
    samples_per_s: float
    speedup: float | None  # SingleDevice's median step / this median, on the same global batch (set by main)
    bytes_per_step: float | None  # per replica, measured (None: the strategy cannot say)
    memory_per_device: int | None  # bytes, from XLA's memory analysis (None: not one program)
    max_param_diff: float | None  # max |param - SingleDevice param| (None: another parameter layout)
    equals_single: bool | None  # every parameter within rtol 1e-5, atol 1e-6 of SingleDevice's (None: as above)


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

    from . import data, models

    if name == "wide":
        dataset, module = data.synthetic(4096, (784,), 10), models.MLP(784, (1024, 1024), 10, rngs=nnx.Rngs(0))
    else:
        dataset, module = data.digits(), models.MLP(64, (64, 64), 10, rngs=nnx.Rngs(0))
    apply, params = models.functional(module)
    layers = models.as_layers(module)
    return models.classifier_loss(apply), params, layers, dataset


def _strategies(n: int, layers) -> dict[str, Callable]:
    """Every strategy that fits ``n`` devices, by name (SingleDevice first: the yardstick)."""
    import parallelkit as pk

    made: dict[str, Callable] = {"SingleDevice": pk.SingleDevice}
    if n == 1:
        return made
    made |= {
        "Mirrored(jit)": lambda: pk.Mirrored(n, backend="jit"),
        "Mirrored(pmap)": lambda: pk.Mirrored(n, backend="pmap"),
        "Mirrored(ring)": lambda: pk.Mirrored(n, allreduce="ring"),
        "CentralStorage": lambda: pk.CentralStorage(n),
        "PS(2 shards)": lambda: pk.ParameterServer(2, devices=n),
        "TensorParallel": lambda: pk.TensorParallel(n),
        "FullySharded(3)": lambda: pk.FullySharded(3, n),
    }
    if n >= 4:
        made["Hybrid(data x 2)"] = lambda: pk.Hybrid(n // 2, 2)
    made["Pipeline(2 stages)"] = lambda: pk.Pipeline(layers.apply, 2, microbatches=4, data=n // 2)
    return made


def _measure(strategy, loss, params, batches, warmup: int):
    """(state, compile s, step seconds) of training ``strategy`` on ``batches``."""
    import jax
    import optax

    from .prefetch import prefetch

    state, step = strategy.init(params, optax.sgd(0.01)), strategy.step(loss)
    seconds, feed = [], prefetch(batches, strategy)
    for batch in feed:
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        seconds.append(time.perf_counter() - start)
    return state, seconds[0], seconds[1 + warmup :]


def _extras(strategy, loss, params, batch) -> tuple[float | None, int | None]:
    """(bytes per replica per step, memory per device) where the strategy can say."""
    import optax

    from .inspect import memory_per_device

    state = strategy.init(params, optax.sgd(0.01))
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


def _row(name, n, processes, size, compile_s, seconds, extras, trained=None, reference=None) -> BenchRow:
    """A row; ``trained`` and ``reference`` (SingleDevice's) parameters, where comparable, give the difference."""
    import jax
    import numpy as np

    from .tour import max_abs_diff

    median = float(np.median(seconds))
    comparable = trained is not None and reference is not None
    pairs = zip(jax.tree.leaves(trained), jax.tree.leaves(reference), strict=True) if comparable else ()
    same = comparable and all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    return BenchRow(
        name, n, processes, size, compile_s, median * 1e3,
        float(np.percentile(seconds, 10)) * 1e3, float(np.percentile(seconds, 90)) * 1e3,
        size / median, None, *extras,
        max_abs_diff(trained, reference) if comparable else None, same if comparable else None,
    )  # fmt: skip


def _child(args: argparse.Namespace) -> list[dict]:
    import parallelkit as pk

    n = args.child
    pk.simulate_devices(n, cores_as_devices=args.cores_as_devices)
    import jax

    loss, params, layers, dataset = _model(args.model)
    size = args.batch_per_device * n
    batches = list(pk.data.batches(dataset, size, steps=1 + args.warmup + args.steps, seed=0))
    rows, reference = [], None
    for name, make in _strategies(n, layers).items():
        if args.strategies and name != "SingleDevice" and name not in args.strategies:
            continue
        strategy = make()
        is_pipe = isinstance(strategy, pk.Pipeline)
        model_loss, model_params = (pk.models.cross_entropy, layers.params) if is_pipe else (loss, params)
        extras = (None, None) if is_pipe else _extras(strategy, model_loss, model_params, batches[0])
        state, compile_s, seconds = _measure(strategy, model_loss, model_params, batches, args.warmup)
        trained = jax.device_get(strategy.unreplicate(state.params)) if not is_pipe else None
        reference = trained if reference is None else reference  # SingleDevice runs first
        rows.append(asdict(_row(name, n, 1, size, compile_s, seconds, extras, trained, reference)))
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
    strategy = pk.MultiWorkerMirrored()
    _, compile_s, seconds = _measure(strategy, loss, params, batches, args.warmup)
    row = _row("MultiWorkerMirrored", n, jax.process_count(), size, compile_s, seconds, (None, None))
    if jax.process_index() == 0:
        Path(args.child_out).write_text(json.dumps([asdict(row)]))


def _forward(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--batch-per-device", str(args.batch_per_device), "--steps", str(args.steps),
            "--warmup", str(args.warmup)] + (["--cores-as-devices"] if args.cores_as_devices else []) + (
            ["--strategies", *args.strategies] if args.strategies else [])  # fmt: skip


def _run_child(args: argparse.Namespace, n: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "parallelkit.bench", "--child", str(n), "--child-out", str(out)]
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}
        done = subprocess.run([*command, *_forward(args)], env=env, timeout=args.timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"The benchmark child for {n} device(s) failed (exit {done.returncode}); see above.")
        return json.loads(out.read_text())


def _run_layout(args: argparse.Namespace, processes: int, per_process: int) -> list[dict]:
    from .distributed import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "parallelkit.bench", "--worker", "--child-out", str(out), *_forward(args)]
        env = {"PJRT_NPROC": str(per_process)} if args.cores_as_devices else None
        launch(command, processes, per_process, timeout=args.timeout, env=env, stream=False)
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


def format_table(rows: list[dict]) -> str:
    """The rows as a text table."""
    head = (f"{'strategy':<20}{'dev':>4}{'proc':>5}{'batch':>6}{'compile s':>10}{'step ms':>9}{'samples/s':>11}"
            f"{'speed-up':>9}{'scaling':>8}{'bytes/step':>12}{'mem/device':>12}{'max |dp|':>10}")  # fmt: skip

    def cell(value, spec: str, width: int) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"

    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['strategy']:<20}{r['devices']:>4}{r['processes']:>5}{r['global_batch']:>6}{r['compile_s']:>10.2f}"
            f"{r['median_step_ms']:>9.2f}{r['samples_per_s']:>11.0f}{cell(r['speedup'], '.2f', 9)}"
            f"{cell(r.get('scaling_efficiency'), '.2f', 8)}"
            f"{cell(r['bytes_per_step'], ',.0f', 12)}{cell(r['memory_per_device'], ',', 12)}"
            f"{cell(r['max_param_diff'], '.1e', 10)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
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
        rows += _run_layout(args, processes, per_process)
    singles = {r["devices"]: r for r in rows if r["strategy"] == "SingleDevice"}  # one per child
    one = singles.get(1)
    for r in rows:
        reference = singles.get(r["devices"])  # same global batch
        r["speedup"] = None if reference is None else reference["median_step_ms"] / r["median_step_ms"]
        # weak scaling against one device: throughput_N / (N x throughput_1)
        r["scaling_efficiency"] = None if one is None else r["samples_per_s"] / (r["devices"] * one["samples_per_s"])
    print(format_table(rows))
    _save(args, counts, layouts, rows)
    return 0


def _save(args: argparse.Namespace, counts, layouts, rows: list[dict]) -> None:
    import jax

    from .viz.bench import bench_figure

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mode = "cores as devices" if args.cores_as_devices else "shared cores"
    result = {
        "what": "python -m parallelkit bench" + (" --quick" if args.quick else ""),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__, "machine": platform.machine(), "processor": platform.processor(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "device": "simulated CPU devices" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind,
        "mode": mode, "model": args.model, "batch_per_device": args.batch_per_device,
        "steps": args.steps, "warmup": args.warmup, "devices": counts, "processes": [list(x) for x in layouts],
        "rows": rows,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    figure = bench_figure(rows, title=f"{result['device']} ({mode}), {args.model} model")
    figure.savefig(out.with_suffix(".png"), dpi=100)
    print(f"Saved {out} and {out.with_suffix('.png')}.")


if __name__ == "__main__":
    sys.exit(main())
