"""Expert parallelism: the all-to-alls' bytes from the compiled step beside the formula, the expert weights each
device holds, tokens per expert, and step times on 2, 4 and 8 simulated devices.

The MoE GPT (``pk.models.GPT(..., experts=8, top_k=2, capacity_factor=1.25)``: 2 blocks,
width 64, 4 heads, experts of width 128) on the kit's corpus (``pk.data.text``), 16 sequences
of 64 tokens a step, Adam (learning rate 3e-3, ``eps`` 1e-3: see below). For ``n`` in 2,
4 and 8 the script builds ``pk.ExpertParallel(expert=n)`` and the model with
``groups=n``, and reads from the compiled step:

- the all-to-alls (``pk.inspect.collectives``): their count and payload per device, and
  the bytes each device sends, ``(n-1)/n`` of the payloads, beside the formula: four
  all-to-alls per block (to the experts and back, forward and backward), each of one
  group's dispatched slots, ``pk.experts.dispatch_bytes``;
- the bytes of expert weights each device holds (its shards of the placed parameters)
  beside all of them;

then trains ``--check-steps`` steps under ``ExpertParallel`` and under ``SingleDevice``
with the same ``groups`` and stops unless the parameters agree (rtol 1e-5, atol 1e-6), and
records the tokens per expert of every block at those steps (the router's choices, before
capacity) and the dropped fraction. Adam's ``eps`` is 1e-3, ``10^5`` times optax's default:
with 1e-8, ``g / (sqrt(v) + eps)`` gives a near-zero gradient a full-size update, so the
last-bit differences of the two programs' summation orders grow past the tolerance (measured
on 8 devices: 51 of the 337,152 parameters after 10 steps; none with 1e-3, or with SGD).
Last it times the six steps (each strategy for each ``n``) in turns
(``interleaved.take_turns``). The devices are simulated: all of them share this machine's
cores (2 here), so the times show what the exchange costs on a CPU, not a speed-up.

    .venv/bin/python benchmarks/experts.py          # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os

from interleaved import header, save, summarize, take_turns

import parallelkit as pk

pk.simulate_devices(8)

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from parallelkit.models.layers.experts import dispatch_bytes  # noqa: E402

DEVICES = (2, 4, 8)
MODEL = dict(max_length=64, dim=64, heads=4, depth=2, mlp_dim=128, experts=8, top_k=2, capacity_factor=1.25)
EXPERT_WEIGHTS = ("w_in", "w_out", "b_in", "b_out")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds")
    parser.add_argument("--chunk", type=int, default=3, help="steps per variant per round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--check-steps", type=int, default=10, help="steps trained by both strategies and compared")
    parser.add_argument("--out", default="benchmarks/results/experts.json")
    return parser


def expert_bytes_per_device(params) -> tuple[int, int]:
    """(bytes of expert weights on the first device, bytes of all expert weights)."""
    leaves = [block["moe"][name] for block in params["blocks"].values() for name in EXPERT_WEIGHTS]
    first = min(leaves[0].sharding.device_set, key=lambda d: d.id)
    held = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == first)
    return held, sum(leaf.nbytes for leaf in leaves)


def main() -> None:
    args = _parser().parse_args()
    corpus = pk.data.text(length=MODEL["max_length"])
    batches = list(pk.data.batches(corpus, args.batch_size, steps=args.check_steps))
    tx = optax.adam(3e-3, eps=1e-3)  # not 1e-8: near-zero gradients' rounding would get full-size updates
    tokens_per_group = {n: args.batch_size * MODEL["max_length"] // n for n in DEVICES}

    rows, variants = {}, {}
    for n in DEVICES:
        apply, params = pk.models.functional(pk.models.GPT(256, **MODEL, groups=n, rngs=nnx.Rngs(0)))
        loss_fn = pk.models.lm_loss(apply)
        strategy = pk.ExpertParallel(expert=n, devices=jax.devices()[:n])
        state = strategy.init(params, tx)
        step = strategy.step(loss_fn)
        found = [c for c in pk.inspect.collectives(step, state, batches[0]) if c.op == "all-to-all"]
        slots = dispatch_bytes(tokens_per_group[n], MODEL["dim"], MODEL["experts"], MODEL["top_k"],
                               MODEL["capacity_factor"])  # fmt: skip
        exchanges = 4 * MODEL["depth"]
        held, whole = expert_bytes_per_device(state.params)

        split = pk.fit(strategy, loss_fn, params, tx, batches)
        reference = pk.fit(pk.SingleDevice(), loss_fn, params, tx, batches)
        for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(reference.params), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        routed = split.history.metric("tokens_per_expert")  # (steps, blocks, experts)

        rows[n] = {
            "devices": n,
            "tokens_per_group": tokens_per_group[n],
            "all_to_all_count": len(found),
            "all_to_all_payload_bytes": sum(c.bytes for c in found),
            "all_to_all_sent_bytes": sum(c.bytes for c in found) * (n - 1) / n,
            "formula_sent_bytes": exchanges * slots * (n - 1) / n,
            "formula": "4 x blocks x dispatch_bytes(tokens per group) x (n-1)/n",
            "expert_weight_bytes_per_device": held,
            "expert_weight_bytes": whole,
            "tokens_per_expert_per_step": routed.tolist(),
            "dropped_fraction_per_step": split.history.metric("dropped_fraction").tolist(),
            "max_param_diff": max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(reference.params), strict=True)
            ),
        }
        for label, strat in ((f"ExpertParallel({n})", strategy), (f"SingleDevice groups={n}", pk.SingleDevice())):
            holder, run = {"state": strat.init(params, tx)}, strat.step(loss_fn)

            def advance(count, run=run, holder=holder):
                for _ in range(count):
                    holder["state"], _ = run(holder["state"], batches[0])
                    jax.block_until_ready(holder["state"])

            variants[label] = advance

    timed = summarize(take_turns(variants, args.rounds, args.chunk), hand="SingleDevice groups=2")
    print(f"MoE GPT {MODEL}, batch {args.batch_size} x {MODEL['max_length']} tokens; simulated CPU devices "
          f"sharing {os.cpu_count()} cores")  # fmt: skip
    head = f"{'n':>3}{'a2a':>5}{'sent B (HLO)':>14}{'formula B':>12}{'experts B/dev':>15}{'of B':>10}"
    print(head + f"{'dropped':>9}{'EP ms':>8}{'1-dev ms':>10}")
    for n, row in rows.items():
        row["expert_parallel_ms"] = timed[f"ExpertParallel({n})"]
        row["single_device_ms"] = timed[f"SingleDevice groups={n}"]
        ep, one = row["expert_parallel_ms"]["median_ms"], row["single_device_ms"]["median_ms"]
        print(f"{n:>3}{row['all_to_all_count']:>5}{row['all_to_all_sent_bytes']:>14,.0f}"
              f"{row['formula_sent_bytes']:>12,.0f}{row['expert_weight_bytes_per_device']:>15,}"
              f"{row['expert_weight_bytes']:>10,}{np.mean(row['dropped_fraction_per_step']):>9.3f}"
              f"{ep:>8.1f}{one:>10.1f}")  # fmt: skip
    for n, row in rows.items():
        last = np.asarray(row["tokens_per_expert_per_step"])[-1]
        for block, counts in enumerate(last):
            print(f"tokens per expert at step {args.check_steps}, {n} devices, block {block}: "
                  f"{counts.astype(int).tolist()}")  # fmt: skip

    record = {
        **header("experts", args),
        "model": MODEL,
        "rows": {str(n): row for n, row in rows.items()},
    }
    save(record, args.out)


if __name__ == "__main__":
    main()
