"""What the benchmarks share: variants timed in turns, and the fields every record opens with.

Scripts in this folder import it as a sibling module (``from interleaved import ...``).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def take_turns(
    variants: dict[str, Callable[[int], None]], rounds: int, chunk: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Each variant's seconds per step, one value per round.

    ``variants[name](count)`` runs ``count`` steps, blocking on each. Every variant first
    runs ``warmup`` steps untimed (compile, warm up); then, ``rounds`` times, each runs
    ``chunk`` steps in turn, the order reversed every other round so that none always
    goes first. The garbage collector is off while timing.
    """
    for advance in variants.values():
        advance(warmup)
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    gc.disable()
    try:
        for r in range(rounds):
            for name in variants if r % 2 == 0 else reversed(variants):
                start = time.perf_counter()
                variants[name](chunk)
                per_step[name].append((time.perf_counter() - start) / chunk)
    finally:
        gc.enable()
    return per_step


def summarize(per_step: dict[str, list[float]], hand: str) -> dict[str, dict[str, float]]:
    """Median, p10 and p90 ms per step of each variant, and its median over variant ``hand``'s."""
    floor = float(np.median(per_step[hand]))
    return {
        name: {
            "median_ms": float(np.median(t)) * 1e3,
            "p10_ms": float(np.percentile(t, 10)) * 1e3,
            "p90_ms": float(np.percentile(t, 90)) * 1e3,
            "ratio_to_hand": float(np.median(t)) / floor,
        }
        for name, t in per_step.items()
    }


def header(benchmark: str, args: Any) -> dict:
    """A record's opening fields: which benchmark, when, on which JAX and platform, simulated or not, the host, the
    command line's arguments (JAX must already be started with the device count the script asked for)."""
    import jax

    return {
        "benchmark": benchmark,
        "date": datetime.date.today().isoformat(),
        "jax_version": jax.__version__,
        "platform": jax.devices()[0].platform,
        "simulated": jax.devices()[0].platform == "cpu",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "args": vars(args),
    }


def save(record: dict, out: str) -> None:
    """Write ``record`` as JSON to ``out`` (its folder made if missing) and say where."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {out}")
