"""The planner checked against the compiler and the clock, beside published configurations, and timed itself.

1. **Memory.** A small GPT (``pk.models.GPT``: width 64, 8 heads, 4 layers, MLP 256, 64 tokens,
   vocabulary 256; a batch of 16 sequences, float32, Adam) on 8 simulated CPU devices: every
   layout of 8 devices that the kit can run (``pk.planner.unsupported`` is None), each with 1 or
   2 accumulation steps where it has no pipeline, is built (``layout.strategy()``), and its
   compiled step's memory per device (``pk.inspect.memory_per_device``: arguments, outputs and
   temporaries) is set beside the planner's (``pk.planner.memory_per_device``,
   ``precision="fp32"``). A pipeline runs several programs per stage, not one to read, so
   pipelines are timed but not compared.
2. **Time.** Each of those layouts, and one device, is built and trains two untimed steps; then
   ``--rounds`` rounds (4) time ``--steps`` steps (5) of every layout in turn, side by side,
   and each layout's time is the median of its 20 steps. The planner predicts each on
   ``pk.planner.Cluster.measured()``: this machine's ceilings, its matrix-product FLOP/s shared
   by the simulated devices, its all-reduce's latency and bandwidth as a ring's link; the
   compute efficiency is the one device's step's (its model FLOPs over its measured seconds
   and the measured peak: a measured input, stated). Recorded: the rank correlation
   (Spearman) of predicted and measured times, and the measured time of the planner's first
   choice (the fastest predicted, ties to the simpler layout, as ``plan`` ranks) over the
   measured best, with every layout tied with it and theirs.
3. **Published configurations.** torchtitan's published runs of Llama 3 8B on 8 H100s (FSDP)
   and Llama 3 70B on 256 H100s (FSDP x tensor parallelism), and MaxText's Llama 2 70B on 512
   TPU v5p chips (FSDP): the planner's memory per device and MFU for their layout beside the
   published memory and throughput (:data:`PUBLISHED`, marked as published, with sources), and
   the planner's own first choice on the same chips.
4. **Speed.** Seconds to plan Llama 3 70B on 1,024 H100s (128 machines of 8), median of 3.

Run: ``.venv/bin/python benchmarks/planner.py`` (a few minutes on 2 cores); it prints the tables
and writes ``benchmarks/results/planner.json`` and its figure, ``planner.png`` (``--figure-only``
draws the figure again from the saved record).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from interleaved import header, save

import parallelkit as pk

pk.simulate_devices(8)

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from parallelkit.planner import MODELS, Cluster, Layout, Transformer, check, plan, step_time, unsupported  # noqa: E402
from parallelkit.planner.search import layouts, simpler_first  # noqa: E402

GPT = {"max_length": 64, "dim": 64, "heads": 8, "depth": 4, "mlp_dim": 256}
BATCH = 16
TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 820504e)"
# As published: tokens a second per GPU on H100s (torchtitan's runs: 96 GB HBM2e at a 500 W limit), bf16 without
# torch.compile or Float8 where published; the layout each names, in the planner's words.
MAXTEXT = "AI-Hypercomputer/maxtext docs/reference/models/tiering.md (commit 66266787)"
LLAMA2_70B = Transformer(80, 8192, 64, 28672, 32000, 4096, kv_heads=8, dropout=False, name="Llama 2 70B")
# As published: tokens a second per chip, and the layout each names, in the planner's words. torchtitan's H100s
# have 96 GB of HBM2e (at a 500 W limit), not the SXM datasheet's 80 GB.
PUBLISHED = [
    {"model": MODELS["llama3-8b"], "chip": "H100 SXM", "chips": 8, "per_node": 8, "memory": 96e9,
     "layout": Layout(data=8, zero=3, recompute="selective"), "batch": 16,
     "tokens_per_s_per_chip": 5762, "memory_gib": 82.4,
     "source": TORCHTITAN + ", Table 1: FSDP, local batch 2, selective AC, bf16 without torch.compile"},
    {"model": MODELS["llama3-70b"], "chip": "H100 SXM", "chips": 256, "per_node": 8, "memory": 96e9,
     "batch": 512, "tokens_per_s_per_chip": 829, "memory_gib": 71.9,
     "layout": Layout(data=32, zero=3, tensor=8, sequence_parallel=True, recompute="full"),
     "source": TORCHTITAN + ", Table 4: FSDP 32 x TP 8 (its tensor parallelism splits the norms' tokens: "
     "sequence parallelism), local batch 16, full AC, torch.compile and Float8 (not bf16 alone: the nearest "
     "it publishes)"},
    {"model": LLAMA2_70B, "chip": "TPU v5p", "chips": 512, "per_node": 512, "memory": None,
     "batch": 2048, "tokens_per_s_per_chip": 692, "memory_gib": None,
     "layout": Layout(data=512, zero=3, recompute="full"),
     "source": MAXTEXT + ": Llama 2 70B on 512 v5p chips, BF16, sequence 4096, 65.4 % MFU as it counts it; its "
     "config (benchmarks/maxtext_v5p_model_configs.py, llama2_70b_v5p_128): FSDP over every chip, 4 sequences a "
     "chip, remat policy save_dot_except_mlpwi (it keeps a few matrix products' outputs a layer: taken here as full "
     "recomputation, the nearest the planner names)"},
]  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout in each round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of timing, every layout in each")
    parser.add_argument("--out", default="benchmarks/results/planner.json")
    parser.add_argument("--figure-only", action="store_true", help="draw the figure from the saved record, no run")
    return parser


def runnable(shape: Transformer) -> list[Layout]:
    """Every layout of 8 devices the kit runs for ``shape`` and a batch of :data:`BATCH`, with 1 or 2 accumulations."""
    found = []
    for layout in layouts(shape, 8, BATCH):
        for accumulate in (1, 2) if layout.stages == 1 else (layout.microbatches,):
            variant = dataclasses.replace(layout, microbatches=accumulate)
            if unsupported(variant) is None and check(shape, variant, BATCH) is None and variant not in found:
                found.append(variant)
    return found


def build(layout: Layout, gpt: pk.models.GPT, batch: dict) -> dict:
    """One layout's step, trained twice (compiled, then once more), and its compiled memory per device (None for a
    pipeline)."""
    optimizer = optax.adam(1e-3)
    if layout.stages > 1:
        layers, params = pk.models.as_layers(gpt)
        strategy = layout.strategy(layers=layers)
        step, state = strategy.step(pk.models.cross_entropy), strategy.init(params, optimizer)
        compiled = None
    else:
        apply, params = pk.models.functional(gpt)
        strategy = layout.strategy() if layout.devices > 1 else pk.SingleDevice()
        step = strategy.step(pk.models.lm_loss(apply), accumulate=layout.accumulate)
        state = strategy.init(params, optimizer)
        compiled = pk.inspect.memory_per_device(step, state, batch).total
    for _ in range(2):
        state, _ = step(state, batch)
        jax.block_until_ready(state)
    return {"step": step, "state": state, "compiled_bytes": compiled, "seconds": []}


def time_steps(built: dict, batch: dict, steps: int) -> None:
    """``steps`` more steps of a built layout, each one's seconds added to its list."""
    for _ in range(steps):
        start = time.perf_counter()
        built["state"], _ = built["step"](built["state"], batch)
        jax.block_until_ready(built["state"])
        built["seconds"].append(time.perf_counter() - start)


def activation_slope() -> dict:
    """What the compiled single-device step keeps a layer and a sequence, beside the planner's count.

    Its temporaries at depths 4 and 8 with 16 sequences: their difference over 4 layers and 16
    sequences is what one more layer of one more sequence adds. The deeper model's state is four
    layers larger too; their gradients' temporaries (about 12.5 kB a layer and sequence here) are
    inside the difference.
    """
    corpus = pk.data.text(length=GPT["max_length"], max_bytes=50_000)
    batch = next(pk.data.batches(corpus, BATCH, steps=1))
    temps = {}
    for depth in (4, 8):
        apply, params = pk.models.functional(pk.models.GPT(256, **(GPT | {"depth": depth}), rngs=nnx.Rngs(0)))
        single = pk.SingleDevice()
        step, state = single.step(pk.models.lm_loss(apply)), single.init(params, optax.adam(1e-3))
        temps[depth] = pk.inspect.memory_per_device(step, state, batch).temp
    compiled = (temps[8] - temps[4]) / (4 * BATCH)
    shape = Transformer.from_gpt(pk.models.GPT(256, **GPT, rngs=nnx.Rngs(0)))
    planned = pk.planner.layer_activation_bytes(shape, 1, element_bytes=4)
    print(f"one layer of one sequence: compiled {compiled / 1e3:.1f} kB, planned {planned / 1e3:.1f} kB")
    return {"compiled_bytes": compiled, "planned_bytes": planned, "ratio": compiled / planned}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties broken by order)."""
    ranks = [np.argsort(np.argsort(x)) for x in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def against_the_compiler_and_the_clock(steps: int, rounds: int) -> dict:
    gpt = pk.models.GPT(256, **GPT, rngs=nnx.Rngs(0))
    shape = Transformer.from_gpt(gpt)
    corpus = pk.data.text(length=GPT["max_length"], max_bytes=50_000)
    batch = next(pk.data.batches(corpus, BATCH, steps=1))
    candidates = [Layout(), *runnable(shape)]
    built = [build(layout, gpt, batch) for layout in candidates]
    for _ in range(rounds):  # round by round, every layout in turn: drift on the machine reaches all of them alike
        for one in built:
            time_steps(one, batch, steps)
    seconds = [float(np.median(one["seconds"])) for one in built]
    cluster = Cluster.measured()
    single_s = seconds[0]
    efficiency = shape.flops_per_token() * BATCH * shape.seq / (single_s * 8 * cluster.peak_flops("fp32"))
    rows, layouts_run = [], candidates[1:]
    for layout, one, measured_s in zip(layouts_run, built[1:], seconds[1:], strict=True):
        planned = pk.planner.memory_per_device(shape, layout, BATCH, precision="fp32", optimizer="adam")
        predicted = step_time(shape, layout, cluster, BATCH, precision="fp32", efficiency=min(efficiency, 1.0))
        row = {"layout": layout.name, "planned_bytes": planned.total, "compiled_bytes": one["compiled_bytes"],
               "seconds": measured_s, "predicted_s": predicted.total,
               "predicted_binding": predicted.binding}  # fmt: skip
        if one["compiled_bytes"]:
            row["memory_ratio"] = planned.total / one["compiled_bytes"]
        rows.append(row)
        print(f"{layout.name:<44} memory planned/compiled {row.get('memory_ratio', float('nan')):6.2f}   "
              f"step measured {measured_s * 1e3:7.1f} ms, predicted {predicted.total * 1e3:7.1f} ms")  # fmt: skip
    measured, predicted = [r["seconds"] for r in rows], [r["predicted_s"] for r in rows]
    # the planner's order: the fastest predicted, ties to the simpler layout (as plan() ranks them)
    order = sorted(
        range(len(rows)), key=lambda i: (predicted[i], *simpler_first(layouts_run[i], rows[i]["planned_bytes"]))
    )
    first = order[0]
    tied = [i for i in order if predicted[i] == predicted[first]]
    ratios = [r["memory_ratio"] for r in rows if "memory_ratio" in r]
    return {
        "model": {"gpt": GPT, "vocab": 256, "batch": BATCH, "params": shape.params, "precision": "fp32"},
        "cluster": {"peak_flops_per_device": cluster.peak_flops("fp32"), "link_GBps": cluster.inside.GBps,
                    "link_latency_us": cluster.inside.latency_us, "memory_bytes": cluster.memory_bytes},
        "single_device_s": single_s,
        "efficiency": efficiency,
        "rows": rows,
        "memory_within_20pct": sum(abs(r - 1) <= 0.2 for r in ratios),
        "memory_compared": len(ratios),
        "memory_ratio_median": float(np.median(ratios)),
        "spearman": spearman(predicted, measured),
        "first_choice": rows[first]["layout"],
        "first_choice_over_best": measured[first] / min(measured),
        "tied_with_first": [rows[i]["layout"] for i in tied],
        "tied_over_best": [measured[i] / min(measured) for i in tied],
        "measured_best": rows[int(np.argmin(measured))]["layout"],
    }  # fmt: skip


def published() -> list[dict]:
    """The planner beside published runs: its memory and MFU for their layout, and its own choice."""
    out = []
    for item in PUBLISHED:
        model, chips, layout = item["model"], item["chips"], item["layout"]
        cluster = Cluster.published(item["chip"], per_node=item["per_node"], nodes=chips // item["per_node"])
        if item["memory"]:
            cluster = dataclasses.replace(cluster, memory_bytes=item["memory"])
        answer = plan(model, cluster, global_batch_tokens=item["batch"] * model.seq)
        memory = pk.planner.memory_per_device(model, layout, item["batch"])
        time_ = step_time(model, layout, cluster, item["batch"], efficiency=answer.efficiency)
        mfu = model.flops_per_token() * item["batch"] * model.seq / (time_.total * chips * cluster.bf16_flops)
        theirs = {
            "layout": layout.name,
            "tokens_per_s_per_chip": item["tokens_per_s_per_chip"],
            "mfu": item["tokens_per_s_per_chip"] * model.flops_per_token() / cluster.bf16_flops,
            "memory_bytes": item["memory_gib"] * 2**30 if item["memory_gib"] else None,
            "source": item["source"],
        }
        out.append({
            "model": model.name, "chip": item["chip"], "chips": chips, "batch_sequences": item["batch"],
            "published": theirs,
            "planner_for_their_layout": {"memory_bytes": memory.total, "memory": str(memory), "mfu": mfu,
                                         "binds": time_.binding, "fits": answer.assess(layout).fits},
            "planner_best": {"layout": answer.best.name, "mfu": answer.ranked[0].mfu,
                             "memory_bytes": answer.ranked[0].memory.total, "binds": answer.ranked[0].time.binding},
            "efficiency_assumed": answer.efficiency,
        })  # fmt: skip
        print(f"{model.name} on {chips} {item['chip']}, published: {layout.name}, {theirs['mfu']:.1%} MFU; "
              f"the planner for it: {mfu:.1%}, {memory.total / 1e9:.1f} GB; its choice: {answer.best.name} at "
              f"{answer.ranked[0].mfu:.1%}")  # fmt: skip
    return out


def planning_speed() -> dict:
    cluster = Cluster.published("H100 SXM", per_node=8, nodes=128)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        answer = plan(MODELS["llama3-70b"], cluster, global_batch_tokens=16 * 2**20)
        seconds.append(time.perf_counter() - start)
    weighed = len(answer.ranked) + len(answer.rejected)
    print(f"plan for Llama 3 70B on 1,024 H100s: {np.median(seconds):.2f} s ({weighed} layouts weighed)")
    return {"devices": 1024, "median_s": float(np.median(seconds)), "layouts_weighed": weighed,
            "best": answer.best.name}  # fmt: skip


def figure(record: dict, path: str) -> None:
    """Memory planned against compiled (the 20 % band shaded) and step time predicted against measured, per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["validation"]["rows"]
    families = ("tensor", "context", "stages", "ZeRO", "data")
    colour = dict(zip(families, ("tab:red", "tab:green", "tab:purple", "tab:orange", "tab:blue"), strict=True))

    def family(name: str) -> str:
        return next(f for f in families if f in name)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    compared = [r for r in rows if r["compiled_bytes"]]
    top = 1.1 * max(max(r["compiled_bytes"], r["planned_bytes"]) for r in compared) / 1e6
    line = np.array([0, top])
    left.fill_between(line, 0.8 * line, 1.2 * line, color="0.9", label="within 20 %")
    left.plot(line, line, color="0.5", lw=0.8)
    for r in compared:
        left.scatter(r["compiled_bytes"] / 1e6, r["planned_bytes"] / 1e6, color=colour[family(r["layout"])], s=18)
    left.set(xlabel="compiled (MB a device)", ylabel="planner (MB a device)", xlim=(0, top), ylim=(0, top),
             title=f"memory: {len(compared)} layouts (pipelines have no one program)")  # fmt: skip
    for r in rows:
        right.scatter(r["predicted_s"] * 1e3, r["seconds"] * 1e3, color=colour[family(r["layout"])], s=18)
    v = record["validation"]
    right.set(xlabel="predicted step (ms)", ylabel="measured step (ms)",
              title=f"time: {len(rows)} layouts, Spearman {v['spearman']:.2f}")  # fmt: skip
    for name in families:
        right.scatter([], [], color=colour[name], label=name if name != "data" else "data alone")
    right.legend(fontsize=8)
    left.legend(fontsize=8, loc="upper left")
    fig.suptitle("The planner against the compiler and the clock: a small GPT on 8 simulated CPU devices")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"saved {path}")


def main() -> None:
    args = _parser().parse_args()
    if args.figure_only:
        figure(json.loads(Path(args.out).read_text()), str(Path(args.out).with_suffix(".png")))
        return
    record = header("planner", args)
    record["activation_slope"] = activation_slope()
    record["validation"] = against_the_compiler_and_the_clock(args.steps, args.rounds)
    v = record["validation"]
    print(f"memory within 20%: {v['memory_within_20pct']} of {v['memory_compared']}; Spearman {v['spearman']:.2f}; "
          f"first choice {v['first_choice']} measures {v['first_choice_over_best']:.2f} x the best "
          f"({v['measured_best']})")  # fmt: skip
    record["published"] = published()
    record["speed"] = planning_speed()
    save(record, args.out)
    figure(record, str(Path(args.out).with_suffix(".png")))


if __name__ == "__main__":
    main()
