"""Every strategy side by side: step time, first-step (compile) time, bytes moved, same parameters.

For each device count a fresh child process (the simulated device count is fixed
per process) trains the same model on the same NumPy batches from the same initial
parameters with every strategy of ``pk.tour.STRATEGIES`` (SingleDevice, Mirrored
jit and pmap, CentralStorage, ParameterServer sync and async, TensorParallel,
FullySharded, MultiWorkerMirrored in this process). The first call of each (trace +
compile + one step) is reported apart; after a few untimed warm-up steps, ``--steps``
timed steps run with the strategies interleaved round by round (a fresh random order
each round, seeded), so that machine noise hits all of them alike. Each step is
timed up to ``jax.block_until_ready`` on its output state, with the garbage
collector off. Reported: median, p10, p90 step time, the ratio of medians to
SingleDevice and to Mirrored(jit), and max |param - SingleDevice param| at the end
(the run stops with an error above rtol 1e-5 / atol 1e-6: comparing different
computations would be worthless; the asynchronous parameter server, which differs by
design, is reported but not checked).

On simulated CPU devices (one processor split into N "devices") these times show
what each strategy's extra work costs (copies between memories, more programs per
step), never multi-device speed-ups.

    .venv/bin/python benchmarks/strategies.py                   # devices 2 4 8, 60 steps
    .venv/bin/python benchmarks/strategies.py --devices 8 --steps 200
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RTOL, ATOL = 1e-5, 1e-6


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8], help="one child process each")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per strategy (at least 50)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the strategies in each round")
    parser.add_argument("--out", default="benchmarks/results/strategies.json")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    return parser


def _child(args: argparse.Namespace) -> dict:
    import parallelkit as pk

    pk.simulate_devices(args.child)

    import jax
    import optax

    dataset = pk.data.digits()
    apply, params = pk.models.build(args.model, dataset.input_shape, dataset.num_classes)
    loss_fn = pk.models.classifier_loss(apply)
    total = 1 + args.warmup + args.steps
    batches = list(pk.data.batches(dataset, args.batch_size, steps=total))
    if len(batches) != total:
        raise SystemExit(f"digits gives only {len(batches)} batches of {args.batch_size}; ask for fewer steps.")

    runs = pk.run_side_by_side(
        {name: make(args.child) for name, make in pk.tour.STRATEGIES.items()},
        loss_fn, params, optax.adam(1e-3), batches, warmup=args.warmup, interleave=True, seed=args.seed,
        reference="SingleDevice", meant_to_differ=pk.tour.MEANT_TO_DIFFER,
    )  # fmt: skip
    unequal = [f"{run.name} (max |dp| {run.max_param_diff:.1e})" for run in runs.values() if run.meant_to_equal
               and not run.equals_reference]  # fmt: skip
    if unequal:  # the asynchronous parameter server differs by design: reported, not checked
        raise SystemExit(f"These left SingleDevice's parameters (rtol {RTOL}, atol {ATOL}): {', '.join(unequal)}")
    summary = pk.device_summary()
    return {
        "devices": args.child,
        "platform": summary.platform,
        "simulated": summary.simulated,
        "jax_version": jax.__version__,
        "first_step_s": {name: run.times.first_step_seconds for name, run in runs.items()},
        "step_s": {name: list(run.times.step_seconds) for name, run in runs.items()},
        "max_param_diff": {name: run.max_param_diff for name, run in runs.items()},
    }


def _summarise(raw: dict) -> dict:
    import numpy as np

    median = {name: float(np.median(s)) for name, s in raw["step_s"].items()}
    rows = {
        name: {
            "first_step_s": raw["first_step_s"][name],
            "median_ms": median[name] * 1e3,
            "p10_ms": float(np.percentile(raw["step_s"][name], 10)) * 1e3,
            "p90_ms": float(np.percentile(raw["step_s"][name], 90)) * 1e3,
            "vs_single": median[name] / median["SingleDevice"],
            "vs_mirrored_jit": median[name] / median["Mirrored(jit)"],
            "max_param_diff": raw["max_param_diff"][name],
        }
        for name in raw["step_s"]
    }
    return {**{k: v for k, v in raw.items() if k != "step_s"}, "rows": rows, "raw_step_s": raw["step_s"]}


def _table(result: dict) -> str:
    head = (
        f"{'strategy':<16}{'first s':>9}{'median ms':>11}{'p10':>8}{'p90':>8}"
        f"{'/single':>9}{'/mirrored':>11}{'max |dp|':>10}"
    )
    lines = [f"{result['devices']} {result['platform']} devices (simulated: {result['simulated']})", head]
    for name, r in result["rows"].items():
        lines.append(
            f"{name:<16}{r['first_step_s']:>9.2f}{r['median_ms']:>11.3f}{r['p10_ms']:>8.3f}{r['p90_ms']:>8.3f}"
            f"{r['vs_single']:>9.2f}{r['vs_mirrored_jit']:>11.2f}{r['max_param_diff']:>10.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.child:
        Path(args.child_out).write_text(json.dumps(_child(args)))
        return
    if args.steps < 50:
        raise SystemExit("--steps must be at least 50 for a median worth quoting.")
    results = []
    for n in args.devices:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "child.json"
            command = [sys.executable, __file__, *(argv or sys.argv[1:]), "--child", str(n), "--child-out", str(out)]
            subprocess.run(command, check=True, cwd=ROOT)
            results.append(_summarise(json.loads(out.read_text())))
        print(_table(results[-1]), end="\n\n", flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "args": {k: v for k, v in vars(args).items() if not k.startswith("child")},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**meta, "results": results}, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
