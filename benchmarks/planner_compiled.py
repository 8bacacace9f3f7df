"""The planner's memory beside the TPU compiler's, for published-like shapes: Llama 3 8B and 70B sized GPTs.

The kit's GPT (``pk.models.GPT``) at the width, heads, MLP width and vocabulary of Llama 3 8B (4096, 32,
14336, 128256) and 70B (8192, 64, 28672, 128256) trains with AdamW in float32 under the layouts torchtitan ran
them with: FSDP (ZeRO-3 over
every chip) for the 8B, FSDP x tensor (ZeRO-3 over data, Megatron's tensor parallelism with sequence
parallelism over 8) for the 70B, each under recomputation none, selective and full. Each step is compiled ahead
of time for a TPU v5p topology (``pk.aot.compile``: parameters and batch as ``jax.ShapeDtypeStruct``, nothing is
allocated, nothing runs, nothing is timed) and the compiler's memory per chip (arguments, temporaries, peak) is
set beside the planner's count for the same layout and the same model shape
(``pk.planner.memory_per_device(..., fused=True)`` with ``ModelShape.from_gpt``: the count for a program
compiled whole, ``parallelkit/planner/memory.py``'s "A fused program"; its parameters, gradients, optimizer
state, activations, logits and buffers).

Float32, not bf16: under ZeRO-3 the kit's bf16 step differentiates a copy of the parameters on each replica,
"at the price of a whole float32 gradient on each device while it is reduced" (``parallelkit/core/precision.py``),
a cost of the kit's precision policy rather than of the layout, which float32 training does not pay.

How the kit's GPT differs from Llama 3, and so what is compiled and counted: a GELU MLP of two matrices (not
SwiGLU's three), multi-head attention (no grouped key-value heads), layer norms with biases, learned positions
and an untied head; its attention is not fused (it computes float32 scores of ``s x s`` per head). The planner's
shape has the same dimensions (``ModelShape.from_gpt``), so both sides count the same model. Sequences are 2048
tokens, not Llama 3's 8192: at 8192 the unfused attention's float32 scores of one layer's backward pass (8.6 GB
an array for one sequence) are most of what the compiler holds (2 blocks of the 8B-sized GPT under selective
recomputation on 4 chips: a 63.6 GB peak), a cost of the kit's attention rather than of the layout; at 2048 they
are 16 times smaller.

What keeps the compiles within reach of 2 cores:

- **Depth.** The GPT's blocks are a Python loop, so the program grows with every block. The 8B-sized GPT is
  compiled at its 32 blocks and at 8; the 70B-sized one at 4 and 8 blocks, and its 80 blocks' figures are the
  8 blocks' plus 72 times the increment of a block between 4 and 8 (``compiled_at_depth``, with
  ``measured_at_depth`` false). Fewer blocks mislead: at 1 and 2 blocks the peak falls while the loss's
  vocabulary-wide arrays are live and does not grow with a block's activations.
- **Chips.** The memory per chip of ZeRO-3 depends on the number of chips only through the state's share:
  with the same sequences per chip the activations and the logits are the same. The default topologies are the
  smallest that hold the layouts' model-parallel axes (``--chips 64,256`` compiles the published chip counts,
  v5p:4x4x4 and v5p:4x8x8: 1 and 2 blocks of the 8B-sized GPT took 59 and 128 s to compile for v5p:4x4x4 here);
  the planner counts the same layout on the same chips either way.

Run: ``.venv/bin/python benchmarks/planner_compiled.py`` (the 32-block compiles take 5 to 9 minutes each on 2
shared cores, the whole run about an hour); ``--compiled benchmarks/results/planner_compiled.json`` recounts a
record's compiled figures in seconds, after a change of the accounting. It prints the table and writes
``benchmarks/results/planner_compiled.json``. It needs libtpu (``pip install "parallelkit[tpu]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from interleaved import header, save

import parallelkit as pk

pk.simulate_devices(1)

import jax  # noqa: E402  (after the device count is set)
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from parallelkit.models import RECOMPUTE  # noqa: E402
from parallelkit.planner import Layout, ModelShape  # noqa: E402


@dataclass(frozen=True)
class Case:
    """A published-like shape, the layout it ran with, and the TPU topology it is compiled for."""

    name: str
    dims: dict  # pk.models.GPT's keywords, besides depth and max_length
    layers: int  # the published depth
    depths: tuple  # the depths compiled: the published one, or two from whose difference it is reached
    layout: dict  # Layout's keywords, but data (the chips over the model-parallel ones)
    model_parallel: int  # chips each model-parallel group spans (tensor)
    topologies: dict  # chips -> a v5p topology of that many chips
    seq: int = 2048
    per_replica: int = 1  # sequences each data replica trains a step


LLAMA3_VOCAB = 128256
CASES = (
    Case("Llama 3 8B-like, FSDP", {"dim": 4096, "heads": 32, "mlp_dim": 14336}, 32, (8, 32), {"zero": 3}, 1,
         {4: "v5p:2x2x1", 64: "v5p:4x4x4"}),
    Case("Llama 3 70B-like, FSDP x tensor 8", {"dim": 8192, "heads": 64, "mlp_dim": 28672}, 80, (4, 8),
         {"zero": 3, "tensor": 8, "sequence_parallel": True}, 8, {16: "v5p:2x2x4", 256: "v5p:4x8x8"}),
)  # fmt: skip
MEASURED = ("arguments", "temporaries", "peak")


def gpt_shapes(case: Case, depth: int) -> tuple:
    """The GPT's apply function and its parameters as shapes: nothing is allocated."""
    model = nnx.eval_shape(
        lambda: pk.models.GPT(LLAMA3_VOCAB, max_length=case.seq, depth=depth, **case.dims, rngs=nnx.Rngs(0))
    )
    apply, params = pk.models.functional(model)
    return model, apply, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def layout(case: Case, chips: int, recompute: str) -> Layout:
    return Layout(data=chips // case.model_parallel, recompute=recompute, **case.layout)


def compiled(case: Case, chips: int, depth: int, recompute: str) -> dict:
    """The compiler's memory per chip (bytes) for ``depth`` blocks, and the seconds the compile took."""
    _, apply, params = gpt_shapes(case, depth)
    plan = layout(case, chips, recompute)
    tokens = jax.ShapeDtypeStruct((plan.data * case.per_replica, case.seq), jnp.int32)
    strategy = pk.Parallel(data=plan.data, zero=plan.zero, tensor=plan.tensor, sequence_parallel=plan.sequence_parallel,
                           recompute=recompute, devices=pk.aot.devices(case.topologies[chips]))  # fmt: skip
    start = time.perf_counter()
    step = pk.aot.compile(strategy, pk.models.lm_loss(apply), params, optax.adamw(1e-4), {"x": tokens, "y": tokens})
    memory = step.memory
    return {**{key: getattr(memory, key) for key in MEASURED}, "compile_s": round(time.perf_counter() - start, 1)}


def planned(case: Case, chips: int, depth: int, recompute: str, fused: bool = True) -> dict:
    """The planner's count per chip (bytes), by component, for the compiled model's shape at ``depth`` blocks:
    for a fused program, or (``fused=False``) by Korthikanti et al.'s accounting, the count before the compiler's
    corrections."""
    model, _, _ = gpt_shapes(case, 1)
    shape = dataclasses.replace(ModelShape.from_gpt(model), layers=depth)
    plan = layout(case, chips, recompute)
    memory = pk.planner.memory_per_device(shape, plan, plan.data * case.per_replica, precision="fp32", fused=fused)
    return {"params": memory.params, "grads": memory.grads, "optimizer": memory.optimizer,
            "activations": memory.activations, "logits": memory.logits, "buffers": memory.buffers,
            "gathered": memory.gathered, "total": memory.total}  # fmt: skip


def at_depth(low: int, high: int, figures: dict, layers: int) -> dict:
    """The compiled figures at ``layers`` blocks: measured, or the deeper compile's plus its increment a block."""
    if str(layers) in figures:
        return {key: figures[str(layers)][key] for key in MEASURED}
    a, b = figures[str(low)], figures[str(high)]
    return {key: b[key] + (layers - high) * (b[key] - a[key]) / (high - low) for key in MEASURED}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", default="", help="chips of each case, comma-separated (default: the smallest)")
    parser.add_argument("--recompute", default=",".join(RECOMPUTE), help="recomputations to compile")
    parser.add_argument("--cases", default="", help="indices of CASES to run, comma-separated (default: all)")
    parser.add_argument("--compiled", default="", help="a record whose compiled figures to recount (compiles nothing)")
    parser.add_argument("--out", default="benchmarks/results/planner_compiled.json")
    args = parser.parse_args()
    reuse = {(r["case"], r["chips"], r["recompute"]): r["compiled"] for r in _rows(args.compiled)}
    if not reuse and not pk.aot.available():
        raise SystemExit('libtpu is not installed: pip install "parallelkit[tpu]"')
    chips = [int(c) for c in args.chips.split(",")] if args.chips else [min(case.topologies) for case in CASES]
    picked = [int(i) for i in args.cases.split(",")] if args.cases else range(len(CASES))
    rows = []
    print(f"{'case':<36}{'chips':>6}{'recompute':>10}{'args GB':>9}{'peak GB':>9}{'planned GB':>11}{'ratio':>7}")
    for index in picked:
        case, n = CASES[index], chips[index]
        for recompute in args.recompute.split(","):
            if args.compiled and (case.name, n, recompute) not in reuse:
                print(f"{case.name:<36}{n:>6}{recompute:>10}  not compiled in {args.compiled}: skipped")
                continue
            figures = reuse.get((case.name, n, recompute)) or {
                str(depth): compiled(case, n, depth, recompute) for depth in case.depths
            }
            full = at_depth(*case.depths, figures, case.layers)
            count = planned(case, n, case.layers, recompute)
            row = {"case": case.name, "chips": n, "topology": case.topologies[n], "layers": case.layers,
                   "seq": case.seq, "layout": layout(case, n, recompute).name, "recompute": recompute,
                   "compiled": figures, "compiled_at_depth": full, "measured_at_depth": str(case.layers) in figures,
                   "planned": count, "ratio": count["total"] / full["peak"],
                   "planned_unfused": planned(case, n, case.layers, recompute, fused=False)}  # fmt: skip
            rows.append(row)
            gb = [full["arguments"] / 1e9, full["peak"] / 1e9, count["total"] / 1e9]
            cells = "".join(f"{x:>{w}.2f}" for x, w in zip(gb, (9, 9, 11), strict=True))
            print(f"{case.name:<36}{n:>6}{recompute:>10}{cells}{row['ratio']:>7.2f}", flush=True)
            save({**header("planner_compiled", args), "libtpu": _libtpu(), "rows": rows}, args.out)


def _rows(path: str) -> list:
    return json.loads(Path(path).read_text())["rows"] if path else []


def _libtpu() -> str:
    from importlib.metadata import version

    return version("libtpu")


if __name__ == "__main__":
    main()
