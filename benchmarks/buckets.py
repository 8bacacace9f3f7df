"""Gradient buckets: step time against bucket size, measured here and by the alpha-beta model.

1. **Measured.** An MLP 64-256x12-10 (26 parameter leaves, about 0.74 million parameters,
   3 MB of float32 gradients) on the digits, SGD with momentum (Adam turns a gradient within
   rounding of zero into a whole step, so that the order of a sum alone can move a parameter
   by its learning rate), global batch 256, trained with
   ``pk.Mirrored(4, bucket_bytes=b)`` on 4 simulated CPU devices for every ``b`` of
   :data:`CAPS` (``None``: one all-reduce). For each the script reads the compiled step's
   all-reduces (``pk.inspect.collectives``: their count must be the bucket plan's,
   ``strategy.gradient_buckets``, whose buckets follow the backward pass: the head's first),
   checks that 3 steps end on ``pk.SingleDevice``'s parameters (rtol 1e-5, atol 1e-6), then
   times every variant in turns (``interleaved.take_turns``: ``--rounds`` rounds of
   ``--chunk`` steps; medians).
2. **Predicted on this machine.** ``pk.planner.Cluster.measured()`` fits the alpha-beta
   link to this machine's measured all-reduces; ``pk.costmodel.bucket_timeline`` plays
   each plan's buckets over it with no overlap (XLA's CPU backend runs collectives and
   compute one after another), and the one-bucket step's (``bucket_bytes=10**9``, the same
   program as the others with one bucket) measured time less its predicted all-reduce is
   taken as the compute: predicted step = compute + the buckets' all-reduces.
   ``bucket_bytes=None`` is the default step: ``lax.pmean`` of the gradients' tree, which XLA
   combines into one all-reduce of 28 arrays (26 gradients, the loss and the accuracy), not
   one flat vector.
3. **Predicted on GPUs.** The same model for GPT-2 XL's gradients (1.56 billion float32
   parameters, 6.2 GB; ``pk.planner.MODELS``) on one machine of 8 H100s
   (``pk.planner.Cluster.published("H100 SXM")``: NVLink's datasheet bandwidth), equal buckets
   from 1 MB to one bucket. Each GPU trains on one sequence of 1,024 tokens at 40 % of its
   bf16 peak (``6 N`` FLOPs a token, PaLM's count), two thirds of it in the backward pass,
   during which the buckets can be reduced: the exposed all-reduce time, latency-bound at
   the small end, unhidden at the large end. PyTorch DDP's default bucket (25 MB) and
   Horovod's fusion buffer (128 MiB, ``HOROVOD_FUSION_THRESHOLD``'s default since v0.21.0) are
   in the list. A model, not a measurement.

    .venv/bin/python benchmarks/buckets.py          # about a minute on 2 cores
"""

from __future__ import annotations

import argparse

from interleaved import header, save, summarize, take_turns

import parallelkit as pk

pk.simulate_devices(4)

import jax  # noqa: E402  (after the device count is set)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

CAPS = (None, 1_000, 30_000, 300_000, 1_000_000, 10**9)  # bytes per bucket; None: pmean, 10**9: one bucket
DDP_MB, HOROVOD_MB = 25, 128 * 2**20 / 1e6  # Horovod's default is 128 MiB (134.2 MB) since v0.21.0
GPU_CAPS_MB = (1, 4, 16, DDP_MB, 64, HOROVOD_MB, 256, 1024)
TOKENS, EFFICIENCY = 1024, 0.4  # per GPU per step, and the share of the bf16 peak, in the GPU model (stated)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds")
    parser.add_argument("--chunk", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/buckets.json")
    return parser


def measured(args: argparse.Namespace) -> tuple[dict, int]:
    """Each cap's bucket plan, compiled all-reduces and median step, and the parameter count."""
    data = pk.data.digits()
    apply, params = pk.models.functional(pk.models.MLP(64, (256,) * 12, data.num_classes, rngs=nnx.Rngs(0)))
    loss_fn, tx = pk.models.classifier_loss(apply), optax.sgd(0.1, momentum=0.9)
    batches = list(pk.data.batches(data, args.batch_size, steps=3))
    reference = pk.SingleDevice().init(params, tx)
    one = pk.SingleDevice().step(loss_fn)
    for batch in batches:
        reference, _ = one(reference, batch)

    rows, variants = {}, {}
    for cap in CAPS:
        strategy = pk.Mirrored(4, bucket_bytes=cap)
        step, state = strategy.step(loss_fn), strategy.init(params, tx)
        found = [c for c in pk.inspect.collectives(step, state, batches[0]) if c.op == "all-reduce"]
        plan = strategy.gradient_buckets(loss_fn, state, batches[0])
        assert len(found) == len(plan), f"bucket_bytes={cap}: {len(found)} all-reduces, plan {len(plan)}"
        trained = state
        for batch in batches:
            trained, _ = step(trained, batch)
        ours, theirs = jax.tree.leaves(strategy.unreplicate(trained.params)), jax.tree.leaves(reference.params)
        for a, b in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"bucket_bytes={cap}")
        label = f"bucket_bytes={cap}"
        rows[label] = {"bucket_bytes": cap, "plan_bytes": plan, "allreduce_bytes": [c.bytes for c in found]}
        holder = {"state": strategy.init(params, tx)}

        def advance(n, step=step, holder=holder):
            for _ in range(n):
                holder["state"], _ = step(holder["state"], batches[0])
                jax.block_until_ready(holder["state"])

        variants[label] = advance
    for label, timing in summarize(take_turns(variants, args.rounds, args.chunk), hand="bucket_bytes=None").items():
        rows[label].update(timing)
    return rows, sum(x.size for x in jax.tree.leaves(params))


def predicted_here(rows: dict) -> dict:
    """The model's step per cap on this machine's fitted link, no overlap, compute from the one-bucket step."""
    cluster = pk.planner.Cluster.measured()
    single = rows[f"bucket_bytes={CAPS[-1]}"]
    compute_s = single["median_ms"] / 1e3 - pk.costmodel.bucket_timeline(cluster, single["allreduce_bytes"]).exposed_s
    for row in rows.values():
        timeline = pk.costmodel.bucket_timeline(cluster, row["allreduce_bytes"])
        row["predicted_ms"] = 1e3 * (compute_s + timeline.exposed_s)
        row["predicted_allreduce_ms"] = 1e3 * timeline.communication_s
    return {
        "link": {"GBps": cluster.inside.GBps, "latency_us": cluster.inside.latency_us},
        "compute_ms": compute_s * 1e3,
    }


def predicted_on_gpus() -> dict:
    """Exposed all-reduce time of GPT-2 XL's gradients on 8 H100s against the bucket size."""
    model = pk.planner.MODELS["gpt2-xl"]
    total = 4 * model.params  # float32 gradients
    cluster = pk.planner.Cluster.published("H100 SXM", per_node=8)
    backward_s = 2 / 3 * 6 * model.params * TOKENS / (EFFICIENCY * cluster.bf16_flops)
    rows = []
    for cap_mb in (*GPU_CAPS_MB, total / 1e6):
        cap = cap_mb * 1e6
        count = int(-(-total // cap))
        buckets = [cap] * (count - 1) + [total - cap * (count - 1)]
        timeline = pk.costmodel.bucket_timeline(cluster, buckets, backward_s=backward_s)
        rows.append({"bucket_mb": cap_mb, "buckets": count, "exposed_ms": timeline.exposed_s * 1e3,
                     "allreduce_ms": timeline.communication_s * 1e3})  # fmt: skip
    return {
        "model": "gpt2-xl", "gradient_bytes": total, "cluster": f"8 x {cluster.chip} (datasheet NVLink)",
        "tokens": TOKENS, "efficiency": EFFICIENCY, "backward_s": backward_s, "rows": rows,
        "ddp_default_mb": DDP_MB, "horovod_default_mb": HOROVOD_MB,
    }  # fmt: skip


def main() -> None:
    args = _parser().parse_args()
    rows, count = measured(args)
    here = predicted_here(rows)
    print(f"MLP 64-256x12-10 ({count:,} parameters), SGD, batch {args.batch_size}, Mirrored over 4 simulated devices")
    print(f"{'bucket_bytes':>13}{'buckets':>9}{'measured ms':>13}{'predicted ms':>14}{'all-reduces ms':>16}")
    for row in rows.values():
        print(f"{row['bucket_bytes']!s:>13}{len(row['plan_bytes']):>9}{row['median_ms']:>13.2f}"
              f"{row['predicted_ms']:>14.2f}{row['predicted_allreduce_ms']:>16.2f}")  # fmt: skip
    gpus = predicted_on_gpus()
    print(f"\nmodel: GPT-2 XL's {gpus['gradient_bytes'] / 1e9:.1f} GB of gradients on {gpus['cluster']}, "
          f"{gpus['backward_s'] * 1e3:.1f} ms backward pass")  # fmt: skip
    print(f"{'bucket MB':>10}{'buckets':>9}{'exposed ms':>12}{'all-reduces ms':>16}")
    for row in gpus["rows"]:
        print(f"{row['bucket_mb']:>10.0f}{row['buckets']:>9}{row['exposed_ms']:>12.1f}{row['allreduce_ms']:>16.1f}")
    save({**header("buckets", args), "parameters": count, "rows": rows, "here": here, "gpus": gpus}, args.out)


if __name__ == "__main__":
    main()
