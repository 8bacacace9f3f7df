"""Mixed precision and gradient accumulation: step time and bytes per device, float32 / bf16 / fp16 x accumulate 1 / 4.

An MLP 64-512-512-10 on the digits, Adam, global batch 256, in one process with 8
simulated CPU devices: ``pk.SingleDevice`` (one of them) and ``pk.Mirrored(8)``, each with
``precision=None`` (float32), ``pk.Precision.bf16()`` and ``pk.Precision.fp16()``, and
``accumulate=1`` and ``4``: twelve compiled steps. For each the script reads from the
compiled program what one device holds (``pk.inspect.memory_per_device``: arguments,
temporaries) and the bytes it all-reduces (``pk.inspect.collectives``), then times all
twelve in turns (``interleaved.take_turns``: ``--rounds`` rounds of ``--chunk`` steps, the
order reversed every other round; medians).

The defaults cost nothing: the script asserts that ``step(loss_fn)`` and
``step(loss_fn, precision=None, accumulate=1)`` compile to the same program text, and it
times the default Mirrored step against the same step written by hand (``jax.jit`` with
``NamedSharding``, the state donated; ``benchmarks/overhead.py`` measures that ratio at
length). Simulated devices share this machine's cores, and its CPU has no 16-bit matrix
units that XLA uses: the times say what each option costs here, not on a GPU.

    .venv/bin/python benchmarks/precision.py          # under a minute on 2 cores
"""

from __future__ import annotations

import argparse

from interleaved import header, save, summarize, take_turns

import parallelkit as pk

pk.simulate_devices(8)

import jax  # noqa: E402  (after the device count is set)
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

PRECISIONS = {"float32": None, "bf16": pk.Precision.bf16(), "fp16": pk.Precision.fp16()}
ACCUMULATE = (1, 4)
TARGET_RATIO = 1.02


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds")
    parser.add_argument("--chunk", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--out", default="benchmarks/results/precision.json")
    return parser


def hand_mirrored(loss_fn, tx, params, devices):
    """(advance, state) of the default Mirrored step written by hand: ``jax.jit`` with shardings."""
    mesh = pk.mesh.make_mesh(devices, data=len(devices))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def step(state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, {"loss": loss, **aux}

    jitted = jax.jit(step, in_shardings=(replicated, split), out_shardings=(replicated, replicated), donate_argnums=0)
    state = jax.device_put({"params": params, "opt_state": tx.init(params)}, replicated)
    return jitted, state, split


def zero3_temporaries(loss_fn, tx, params, batch, count: int) -> dict:
    """ZeRO-3's temporaries per device under float32 and bf16, read from the compiled program (no timing).

    On an Auto mesh the bf16 step differentiates one copy of the parameters per replica
    (``ReplicaCopies``), so that each replica's gradient is cast back to float32 before the
    reduce-scatter: a whole float32 gradient per device. JAX's reduced and unreduced types would
    let an Explicit mesh reduce once without it; JAX 0.10 refuses them beside a bias, so the
    Explicit bf16 step is refused, and its reason recorded.
    """
    out = {}
    for label, strategy, precision in (
        ("FullySharded(3) float32", pk.FullySharded(3, 8), None),
        ("FullySharded(3) bf16", pk.FullySharded(3, 8), pk.Precision.bf16()),
        ("FullySharded(3) float32 explicit", pk.FullySharded(3, 8, explicit=True), None),
        ("FullySharded(3) bf16 explicit", pk.FullySharded(3, 8, explicit=True), pk.Precision.bf16()),
    ):
        try:
            step = strategy.step(loss_fn, precision=precision)
        except ValueError as refusal:
            out[label] = {"refused": str(refusal)}
            continue
        use = pk.inspect.memory_per_device(step, strategy.init(params, tx), batch)
        out[label] = {"temp_bytes": use.temp, "temp_bytes_per_parameter": use.temp / count}
    return out


def main() -> None:
    args = _parser().parse_args()
    data = pk.data.digits()
    apply, params = pk.models.functional(pk.models.MLP(64, (512, 512), data.num_classes, rngs=nnx.Rngs(0)))
    loss_fn = pk.models.classifier_loss(apply)
    tx = optax.adam(1e-3)
    batch = next(pk.data.batches(data, args.batch_size, steps=1))
    count = sum(x.size for x in jax.tree.leaves(params))

    strategies = {"SingleDevice": pk.SingleDevice(), "Mirrored(8)": pk.Mirrored(8)}
    for name, strategy in strategies.items():  # the defaults compile today's program
        state = strategy.init(params, tx)
        default = strategy.step(loss_fn).lower(state, batch).as_text()
        explicit = strategy.step(loss_fn, precision=None, accumulate=1).lower(state, batch).as_text()
        assert default == explicit, f"{name}: precision=None, accumulate=1 lowers to another program"

    zero3 = zero3_temporaries(loss_fn, tx, params, batch, count)  # first: the hand-written step donates params
    variants, rows = {}, {}
    for sname, strategy in strategies.items():
        for pname, precision in PRECISIONS.items():
            for k in ACCUMULATE:
                label = f"{sname} {pname} accumulate={k}"
                step = strategy.step(loss_fn, precision=precision, accumulate=k)
                state = strategy.init(params, tx)
                use = pk.inspect.memory_per_device(step, state, batch)
                reduced = [c for c in pk.inspect.collectives(step, state, batch) if c.op == "all-reduce"]
                rows[label] = {
                    "strategy": sname, "precision": pname, "accumulate": k,
                    "argument_bytes": use.argument, "temp_bytes": use.temp, "total_bytes": use.total,
                    "allreduce_count": len(reduced), "allreduce_bytes": sum(c.bytes for c in reduced),
                }  # fmt: skip
                holder = {"state": state}

                def advance(n, step=step, holder=holder):
                    for _ in range(n):
                        holder["state"], _ = step(holder["state"], batch)
                        jax.block_until_ready(holder["state"])

                variants[label] = advance
    jitted, hand_state, split = hand_mirrored(loss_fn, tx, params, strategies["Mirrored(8)"].devices)
    hand = {"state": hand_state}

    def advance_hand(n):
        for _ in range(n):
            hand["state"], _ = jitted(hand["state"], jax.device_put(batch, split))
            jax.block_until_ready(hand["state"])

    variants["hand-written Mirrored(8) float32"] = advance_hand
    timed = summarize(take_turns(variants, args.rounds, args.chunk), hand="hand-written Mirrored(8) float32")

    print(f"MLP 64-512-512-10 ({count:,} parameters), Adam, batch {args.batch_size}; {jax.devices()[0].platform}")
    print(f"{'variant':<36}{'ms/step':>9}{'vs f32':>8}{'args MB':>9}{'temp MB':>9}{'all-reduces':>12}{'AR MB':>8}")
    for label, row in rows.items():
        base = timed[f"{row['strategy']} float32 accumulate=1"]["median_ms"]
        row.update(timed[label])
        row["ratio_to_float32"] = row["median_ms"] / base
        mb = {key: row[key] / 1e6 for key in ("argument_bytes", "temp_bytes", "allreduce_bytes")}
        print(f"{label:<36}{row['median_ms']:>9.2f}{row['ratio_to_float32']:>8.2f}{mb['argument_bytes']:>9.2f}"
              f"{mb['temp_bytes']:>9.2f}{row['allreduce_count']:>12}{mb['allreduce_bytes']:>8.2f}")  # fmt: skip
    default_ratio = timed["Mirrored(8) float32 accumulate=1"]["ratio_to_hand"]
    print(f"default Mirrored(8) step / hand-written: {default_ratio:.3f} (target {TARGET_RATIO})")

    for label, row in zero3.items():
        print(f"{label:<36} temporaries {row.get('temp_bytes_per_parameter', float('nan')):.2f} B per parameter"
              + (f" (refused: {row['refused']})" if "refused" in row else ""))  # fmt: skip

    record = {
        **header("precision", args),
        "parameters": count,
        "rows": rows,
        "zero3_temporaries": zero3,
        "hand_written_ms": timed["hand-written Mirrored(8) float32"]["median_ms"],
        "default_over_hand": default_ratio,
        "target_ratio": TARGET_RATIO,
    }
    save(record, args.out)


if __name__ == "__main__":
    main()
