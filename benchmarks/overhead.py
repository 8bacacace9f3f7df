"""What does parallelkit's wrapper cost? The library's step against the same step by hand.

For each device count, a fresh child process (the simulated device count is fixed
per process) trains one model on the same data from the same initial parameters
with five variants:

- ``lib-jit``:   ``pk.Mirrored(backend="jit")``, the library;
- ``hand-jit``:  ``jax.jit`` with ``NamedSharding`` (batch ``P("data")``, state ``P()``),
                 the same loss and Optax update written out here, the state donated;
- ``lib-pmap``:  ``pk.Mirrored(backend="pmap")``, the library;
- ``hand-pmap``: ``jax.pmap`` with ``lax.pmean`` on gradients and metrics written out here;
- ``lib-parallel``: ``pk.Parallel(data=n)``, the step that composes every axis, on its one data axis,
                 against ``lib-jit``, the preset it generalises (the ``composed`` row: its ratio is
                 composed/preset, not library/hand).

The compiled programs are the same, so any difference in step time is the
library's Python wrapper (``Step.__call__``, ``place_batch``, ``check_divisible``).
After the run the script asserts that each hand-written variant ends with the
library's parameters (rtol 1e-5, atol 1e-6): a benchmark comparing different
computations would be worthless.

Timing: the first call of each variant (trace + compile + one step) is reported
apart; then a few untimed warm-up steps; then ``--steps`` timed steps, the
variants interleaved round-robin so that drifting machine noise hits all of them
alike, each step timed up to ``jax.block_until_ready`` on its output state. By
default each round takes a fresh seeded permutation of the five variants (``--order
random``), so that no variant always runs in one place or after one neighbour: with
five variants the alternation A, B, C, D, E / E, B, A, D, C always ran the hand-written
jit step right after a jit step and the library's after a pmap step in half the rounds,
and measured the jit pair about 0.02 above what random orders measure on the same
machine; ``--order fixed`` is plain A, B, C, D, E. Host batches are
NumPy arrays generated before any timing, and the garbage collector is off while
timing. The ratio library/hand is reported two ways: the ratio of the medians,
and the median of the per-round ratios (each round's steps ran back to back, so
this one cancels slow drifts best).

    .venv/bin/python benchmarks/overhead.py                  # devices 2 4 8, 60 steps
    .venv/bin/python benchmarks/overhead.py --devices 8 --steps 200
    .venv/bin/python benchmarks/overhead.py --steps 3000 --repeats 3   # the recorded run: 3 runs per device count
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 1.02
VARIANTS = ("lib-jit", "hand-jit", "lib-pmap", "hand-pmap", "lib-parallel")
PAIRS = (("jit", "lib-jit", "hand-jit"), ("pmap", "lib-pmap", "hand-pmap"), ("composed", "lib-parallel", "lib-jit"))
RTOL, ATOL = 1e-5, 1e-6
ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[2, 4, 8], help="device counts, one child process each"
    )
    parser.add_argument("--steps", type=int, default=60, help="timed steps per variant (at least 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after the compiling first step")
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument(
        "--order", choices=("fixed", "alternate", "rotate", "random"), default="random",
        help="order of the variants within each timed round (see _round_order)",
    )  # fmt: skip
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="fresh child processes per device count, taken in turns (2 4 8 2 4 8 ...): the run-to-run spread",
    )  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/overhead.json", help="where the JSON results go")
    parser.add_argument(
        "--raw", metavar="DIR",
        help="also keep every step's seconds, one JSON file per child run, in DIR (the record keeps the summaries)",
    )  # fmt: skip
    parser.add_argument("--child", type=int, metavar="N", help=argparse.SUPPRESS)  # internal: run one device count
    parser.add_argument("--child-out", help=argparse.SUPPRESS)  # internal: the child's JSON file
    return parser


# --------------------------------------------------------------------------- child


def _round_order(r: int, order: str, rng) -> tuple[str, ...]:
    """The variants' order in timed round ``r``.

    - ``fixed``: A, B, C, D, E every round (lib-jit, hand-jit, lib-pmap, hand-pmap, lib-parallel).
    - ``alternate``: A, B, C, D, E then E, B, A, D, C: each variant follows its own
      backend's other variant in half the rounds and the other backend in the rest; the composed
      step runs last, then first.
    - ``rotate``: start each round one variant later (the cyclic order stays).
    - ``random``: a fresh permutation each round (seeded).
    """
    if order == "fixed":
        return VARIANTS
    if order == "alternate":
        return VARIANTS if r % 2 == 0 else (VARIANTS[4], VARIANTS[1], VARIANTS[0], VARIANTS[3], VARIANTS[2])
    if order == "rotate":
        shift = r % len(VARIANTS)
        return VARIANTS[shift:] + VARIANTS[:shift]
    return tuple(VARIANTS[i] for i in rng.permutation(len(VARIANTS)))


def _child(args: argparse.Namespace) -> dict:
    """Run the five variants on ``args.child`` devices; return the raw results."""
    import parallelkit as pk

    pk.simulate_devices(args.child)  # before anything else touches JAX

    import functools

    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = args.child
    all_devices = jax.devices()
    summary = pk.device_summary()
    info = {
        "devices": n,
        "platform": summary.platform,
        "device_kind": all_devices[0].device_kind,
        "simulated": summary.platform == "cpu" and summary.device_count > 1,
        "jax_version": jax.__version__,
    }
    if len(all_devices) < n:
        return {**info, "skipped": f"only {len(all_devices)} {summary.platform} device(s)"}
    devices = all_devices[:n]

    # The same data, model, initial parameters and optimizer for every variant.
    dataset = pk.data.digits()
    apply, params0 = pk.models.build(args.model, dataset.input_shape, dataset.num_classes)
    loss_fn = pk.models.classifier_loss(apply)
    tx = optax.adam(args.learning_rate)
    total = 1 + args.warmup + args.steps
    host_batches = list(pk.data.batches(dataset, args.batch_size, steps=total))  # NumPy, before any timing
    if len(host_batches) != total:
        raise SystemExit(f"digits gives only {len(host_batches)} batches of {args.batch_size}; ask for fewer steps.")

    # ---- the library
    lib_jit_strategy = pk.Mirrored(n, backend="jit")
    lib_pmap_strategy = pk.Mirrored(n, backend="pmap")
    lib_parallel_strategy = pk.Parallel(data=n, devices=devices)
    lib_jit_step, lib_pmap_step = lib_jit_strategy.step(loss_fn), lib_pmap_strategy.step(loss_fn)
    lib_parallel_step = lib_parallel_strategy.step(loss_fn)

    # ---- by hand: the same loss and the same Optax update, written out
    def sgd_step(state, batch, sync=lambda tree: tree):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        grads, metrics = sync((grads, {"loss": loss, **aux}))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    def fresh_state():  # copies, as the steps donate their input state
        params = jax.tree.map(lambda x: np.array(x, copy=True), params0)
        return {"step": np.zeros((), np.int32), "params": params, "opt_state": tx.init(params)}

    mesh = Mesh(np.array(devices), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    hand_jit_fn = jax.jit(
        sgd_step, in_shardings=(replicated, split), out_shardings=(replicated, replicated), donate_argnums=0
    )

    def hand_jit_step(state, batch):
        return hand_jit_fn(state, jax.device_put(batch, split))

    hand_pmap_fn = jax.pmap(
        functools.partial(sgd_step, sync=functools.partial(jax.lax.pmean, axis_name="data")),
        axis_name="data", devices=devices, out_axes=(0, None), donate_argnums=0,
    )  # fmt: skip
    per_replica = args.batch_size // n

    def hand_pmap_step(state, batch):
        return hand_pmap_fn(state, {k: v.reshape(n, per_replica, *v.shape[1:]) for k, v in batch.items()})

    def hand_pmap_state():  # one copy per device along a leading axis
        return jax.tree.map(lambda x: jax.device_put(np.stack([np.asarray(x)] * n), split), fresh_state())

    steps = {"lib-jit": lib_jit_step, "hand-jit": hand_jit_step, "lib-pmap": lib_pmap_step, "hand-pmap": hand_pmap_step,
             "lib-parallel": lib_parallel_step}  # fmt: skip
    states = {
        "lib-parallel": lib_parallel_strategy.init(params0, tx),
        "lib-jit": lib_jit_strategy.init(params0, tx),
        "hand-jit": jax.device_put(fresh_state(), replicated),
        "lib-pmap": lib_pmap_strategy.init(params0, tx),
        "hand-pmap": hand_pmap_state(),
    }
    jax.block_until_ready(states)

    # Process-wide one-time costs (backend start, first dispatch, first collective) are paid
    # here by a throwaway program, so that they do not land on whichever variant runs first.
    jax.block_until_ready(jax.jit(lambda x: x.sum(), in_shardings=split)(np.ones((n, 2), np.float32)))
    jax.block_until_ready(jax.pmap(lambda x: jax.lax.psum(x, "i"), "i", devices=devices)(np.ones(n)))

    # First call: trace + compile + one step, per variant.
    first = {}
    for name in VARIANTS:
        start = time.perf_counter()
        states[name], _ = steps[name](states[name], host_batches[0])
        jax.block_until_ready(states[name])
        first[name] = time.perf_counter() - start
    for batch in host_batches[1 : 1 + args.warmup]:
        for name in VARIANTS:
            states[name], _ = steps[name](states[name], batch)
            jax.block_until_ready(states[name])

    # Timed steps, interleaved round-robin.
    rng = np.random.default_rng(0)
    seconds = {name: [] for name in VARIANTS}
    metrics = {}
    gc.collect()
    gc.disable()  # a collection mid-step would land on one variant only
    try:
        for r, batch in enumerate(host_batches[1 + args.warmup :]):
            for name in _round_order(r, args.order, rng):
                step, state = steps[name], states[name]
                start = time.perf_counter()
                state, metrics[name] = step(state, batch)
                jax.block_until_ready(state)
                seconds[name].append(time.perf_counter() - start)
                states[name] = state
    finally:
        gc.enable()

    # The same computation, or the comparison means nothing.
    final = {
        "lib-jit": lib_jit_strategy.unreplicate(states["lib-jit"]).params,
        "hand-jit": jax.device_get(states["hand-jit"]["params"]),
        "lib-pmap": lib_pmap_strategy.unreplicate(states["lib-pmap"]).params,
        "hand-pmap": jax.tree.map(lambda x: np.asarray(x)[0], jax.device_get(states["hand-pmap"]["params"])),
        "lib-parallel": lib_parallel_strategy.unreplicate(states["lib-parallel"]).params,
    }
    max_diff = {}

    def max_abs_diff(a, b) -> float:
        leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in leaves)

    for backend, lib, hand in PAIRS:
        if jax.tree.structure(final[hand]) != jax.tree.structure(final[lib]):
            raise RuntimeError(f"{hand} and {lib} hold differently structured parameters.")
        for x, y in zip(jax.tree.leaves(final[hand]), jax.tree.leaves(final[lib]), strict=True):
            np.testing.assert_allclose(
                x, y, rtol=RTOL, atol=ATOL, err_msg=f"{hand} and {lib} computed different things"
            )
        max_diff[backend] = max_abs_diff(final[hand], final[lib])
    max_diff["jit_vs_pmap"] = max_abs_diff(final["lib-jit"], final["lib-pmap"])
    steps_done = {
        "lib-jit": int(states["lib-jit"].step),
        "hand-jit": int(states["hand-jit"]["step"]),
        "lib-pmap": int(np.asarray(states["lib-pmap"].step)[0]),
        "hand-pmap": int(np.asarray(states["hand-pmap"]["step"])[0]),
        "lib-parallel": int(states["lib-parallel"].step),
    }
    if set(steps_done.values()) != {total}:
        raise RuntimeError(f"Every variant should have taken {total} steps: {steps_done}")

    return {
        **info,
        "first_step_seconds": first,
        "step_seconds": seconds,
        "final_loss": {name: float(np.asarray(m["loss"])) for name, m in metrics.items()},
        "max_param_diff": max_diff,
    }


# --------------------------------------------------------------------------- statistics and table


def _summarise(raw: dict) -> dict:
    import numpy as np

    out = {k: v for k, v in raw.items() if k != "step_seconds"}
    if "skipped" in raw:
        return out
    secs = {name: np.asarray(s) for name, s in raw["step_seconds"].items()}
    out["variants"] = {
        name: {
            "first_step_s": raw["first_step_seconds"][name],
            "median_ms": float(np.median(s) * 1e3),
            "p10_ms": float(np.percentile(s, 10) * 1e3),
            "p90_ms": float(np.percentile(s, 90) * 1e3),
            "mean_ms": float(np.mean(s) * 1e3),
            "min_ms": float(np.min(s) * 1e3),
        }
        for name, s in secs.items()
    }
    out["ratios"] = {}
    for backend, lib, hand in PAIRS:
        per_round = secs[lib] / secs[hand]
        ratio = float(np.median(secs[lib]) / np.median(secs[hand]))
        out["ratios"][backend] = {
            "median_ratio": ratio,  # median(lib) / median(hand)
            "per_round_median_ratio": float(np.median(per_round)),
            "per_round_p10": float(np.percentile(per_round, 10)),
            "per_round_p90": float(np.percentile(per_round, 90)),
            "overhead_us": float((np.median(secs[lib]) - np.median(secs[hand])) * 1e6),
            "within_target": bool(float(np.median(per_round)) <= TARGET_RATIO and ratio <= TARGET_RATIO),
        }
    return out


def _table(res: dict, args: argparse.Namespace) -> str:
    kind = "simulated CPU devices" if res["simulated"] else f"{res['platform']} devices ({res['device_kind']})"
    head = (
        f"== {res['devices']} {kind}: {args.model}, global batch {args.batch_size}, "
        f"{args.steps} timed steps, order {args.order}"
    )
    if "skipped" in res:
        return f"{head}\n   skipped: {res['skipped']}"
    lines = [head, f"{'variant':<11}{'first step s':>13}{'median ms':>11}{'p10 ms':>9}{'p90 ms':>9}{'final loss':>12}"]
    for name, v in res["variants"].items():
        lines.append(
            f"{name:<11}{v['first_step_s']:>13.3f}{v['median_ms']:>11.3f}{v['p10_ms']:>9.3f}{v['p90_ms']:>9.3f}{res['final_loss'][name]:>12.5f}"
        )
    ratio_head = f"{'library/hand':<13}{'median ratio':>13}{'per-round ratio [p10, p90]':>30}{'overhead us':>13}"
    lines.append(f"{ratio_head}   target <= {TARGET_RATIO}")
    for backend, r in res["ratios"].items():
        spread = f"{r['per_round_median_ratio']:.3f} [{r['per_round_p10']:.3f}, {r['per_round_p90']:.3f}]"
        verdict = "ok" if r["within_target"] else "ABOVE"
        lines.append(f"{backend:<13}{r['median_ratio']:>13.3f}{spread:>30}{r['overhead_us']:>13.1f}   {verdict}")
    diffs = res["max_param_diff"]
    lines.append(
        f"max |param diff| after the run: hand-jit vs lib-jit {diffs['jit']:.1e}, "
        f"hand-pmap vs lib-pmap {diffs['pmap']:.1e}, lib-parallel vs lib-jit {diffs['composed']:.1e} (asserted "
        f"allclose, rtol {RTOL}, atol {ATOL}); "
        f"lib-jit vs lib-pmap {diffs['jit_vs_pmap']:.1e}"
    )
    return "\n".join(lines)


def _across_runs(results: list[dict]) -> dict:
    """Per device count and backend: each run's per-round ratio, and their median, minimum and maximum."""
    import numpy as np

    summary: dict = {}
    for res in results:
        if "skipped" in res:
            continue
        for backend, r in res["ratios"].items():
            summary.setdefault(str(res["devices"]), {}).setdefault(backend, []).append(r["per_round_median_ratio"])
    return {
        n: {
            backend: {
                "per_round_ratios": runs,
                "median": float(np.median(runs)),
                "min": min(runs),
                "max": max(runs),
                "within_target": bool(np.median(runs) <= TARGET_RATIO),
            }
            for backend, runs in backends.items()
        }
        for n, backends in summary.items()
    }


def _summary_table(summary: dict, repeats: int) -> str:
    lines = [f"== across {repeats} runs: per-round ratio library/hand (composed: pk.Parallel/Mirrored jit), median "
             "[min, max] of the runs"]  # fmt: skip
    lines.append(f"{'devices':<9}" + "".join(f"{backend:>26}" for backend, _, _ in PAIRS))
    for n, backends in summary.items():
        cells = [f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]" for r in backends.values()]
        lines.append(f"{n:<9}" + "".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------- parent


def _run_child(n: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "child.json"
        count_flag = "--xla_force_host_platform_device_count"
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count_flag)]
        env = {**os.environ, "XLA_FLAGS": " ".join([*flags, f"{count_flag}={n}"])}
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--child", str(n), "--child-out", str(out),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--model", args.model,
            "--batch-size", str(args.batch_size), "--learning-rate", str(args.learning_rate), "--order", args.order,
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"The child for {n} devices failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 50:
        raise SystemExit(f"--steps must be at least 50 for stable medians and percentiles, got {args.steps}.")
    if args.child is not None:
        result = _child(args)
        Path(args.child_out).write_text(json.dumps(result))
        return 0

    bad = [n for n in args.devices if n < 1 or args.batch_size % n]
    if bad:
        raise SystemExit(f"--batch-size {args.batch_size} must split evenly over every device count; not over {bad}.")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}.")
    started = time.perf_counter()
    results = []
    for repeat in range(args.repeats):
        for n in args.devices:
            raw = _run_child(n, args)
            if args.raw:  # the per-step samples, on request: the record keeps medians, spreads and counts
                Path(args.raw).mkdir(parents=True, exist_ok=True)
                (Path(args.raw) / f"overhead-{n}-devices-run-{repeat}.json").write_text(json.dumps(raw))
            res = {"repeat": repeat, **_summarise(raw)}
            results.append(res)
            print(_table(res, args), flush=True)
            print()
    summary = _across_runs(results)
    if args.repeats > 1:
        print(_summary_table(summary, args.repeats))
    print(
        f"Target: library/hand-written step time <= {TARGET_RATIO} for each backend, and the composed step over the "
        "preset it generalises too (the per-round ratio, the median over the rounds of the interleaved run, is the "
        "robust figure)."
    )
    if any(r["simulated"] for r in results):
        print(
            "These are simulated CPU devices sharing one processor "
            f"({os.cpu_count()} cores here): the times show per-step overheads, not multi-device speed-ups."
        )
    first = next((r for r in results if "skipped" not in r), results[0])
    payload = {
        "benchmark": "overhead",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": first["jax_version"],
        "platform": first["platform"],
        "device_kind": first["device_kind"],
        "simulated": any(r["simulated"] for r in results),
        "host": {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count()},
        "target_ratio": TARGET_RATIO,
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "child_out")},
        "wall_seconds": time.perf_counter() - started,
        "summary": summary,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"Saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
