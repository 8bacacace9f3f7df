"""Recomputation: the TPU compiler's memory beside the planner's count, for none, selective and full.

A GPT (``pk.models.GPT``: width 256, 8 heads, 4 blocks, MLP 1024, 512 tokens, vocabulary 256) trains
with SGD under ``pk.Parallel(data=4, recompute=...)`` on the 4 chips of a TPU v5e 2x2 topology,
compiled ahead of time (``pk.aot.compile``: nothing runs, nothing is timed), 8 sequences a step (2 a
chip), float32. For each recomputation the record sets side by side:

- the compiled program's peak memory per chip and its arguments (the parameters, the optimizer state
  and the batch's slice), and their difference: what the step holds beyond its inputs;
- the planner's count for the same layout, as a program compiled whole (``pk.planner.memory_per_device(...,
  fused=True)``: its parameters, the larger of its gradients and its activations with the logits, and one
  layer's backward pass), and its activations, logits and that working set alone, the part recomputation
  changes;
- the compiled FLOPs per chip (the recomputed products show there).

Run: ``.venv/bin/python benchmarks/recompute.py`` (about a minute on 2 cores); it prints the table and
writes ``benchmarks/results/recompute.json``. It needs libtpu (``pip install "parallelkit[tpu]"``).
"""

from __future__ import annotations

import argparse

from interleaved import header, save

import parallelkit as pk

pk.simulate_devices(1)

import jax.numpy as jnp  # noqa: E402  (after the device count is set)
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from parallelkit.models import RECOMPUTE  # noqa: E402
from parallelkit.planner import Layout, ModelShape  # noqa: E402

GPT = {"max_length": 512, "dim": 256, "heads": 8, "depth": 4, "mlp_dim": 1024}
TOPOLOGY, CHIPS, BATCH = "v5e:2x2", 4, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/recompute.json")
    args = parser.parse_args()
    if not pk.aot.available():
        raise SystemExit('libtpu is not installed: pip install "parallelkit[tpu]"')
    model = pk.models.GPT(256, **GPT, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    shape = ModelShape.from_gpt(model)
    tokens = jnp.zeros((BATCH, GPT["max_length"]), jnp.int32)
    target = pk.aot.devices(TOPOLOGY)
    rows = []
    print(f"{'recompute':<10}{'peak MB':>9}{'args MB':>9}{'beyond MB':>10}{'planned MB':>11}{'planned act MB':>15}"
          f"{'GFLOP':>8}")  # fmt: skip
    for name in RECOMPUTE:
        strategy = pk.Parallel(data=CHIPS, recompute=name, devices=target)
        compiled = pk.aot.compile(
            strategy, pk.models.lm_loss(apply), params, optax.sgd(0.1), {"x": tokens, "y": tokens}
        )
        planned = pk.planner.memory_per_device(shape, Layout(data=CHIPS, recompute=name), BATCH, precision="fp32",
                                               optimizer="sgd", fused=True)  # fmt: skip
        memory = compiled.memory
        row = {"recompute": name, "peak_bytes": memory.peak, "argument_bytes": memory.arguments,
               "beyond_arguments_bytes": memory.peak - memory.arguments, "planned_bytes": planned.total,
               "planned_activation_bytes": planned.activations + planned.logits + planned.buffers,
               "planned_buffer_bytes": planned.buffers, "flops": compiled.flops}  # fmt: skip
        rows.append(row)
        mb = [row[key] / 1e6 for key in ("peak_bytes", "argument_bytes", "beyond_arguments_bytes", "planned_bytes",
                                          "planned_activation_bytes")]  # fmt: skip
        print(f"{name:<10}" + "".join(f"{x:>{w}.2f}" for x, w in zip(mb, (9, 9, 10, 11, 15), strict=True))
              + f"{compiled.flops / 1e9:>8.3f}")  # fmt: skip
    save({**header("recompute", args), "gpt": GPT, "topology": TOPOLOGY, "batch": BATCH, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
