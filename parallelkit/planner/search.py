"""Every layout the kit can run, for a model, a cluster and a batch: each one's memory and step time, ranked.

:func:`plan` enumerates the layouts (:func:`layouts`): every way to split the devices over
``tensor``, ``expert``, ``context``, ``stages`` and ``data``, with each ZeRO stage, with and
without sequence parallelism, each context method, each pipeline schedule at a few
microbatch counts (1, 2, 4, 8 per stage). For each it tries recomputation off, selective and
full, and gradient accumulation over more microbatches (each count that splits a replica's
sequences evenly, fewest first) when the batch does not fit, and keeps the fastest
variant that fits in ``(1 - reserve)`` of a device's memory; a layout with none that fits is
kept as rejected, with by how much it misses. The rest are ranked by model FLOPs utilisation
(MFU: the model's FLOPs a second, over the devices' peak): the same order as tokens a second;
ties go to the simpler layout (:func:`simpler_first`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..measure.roofline import flops_utilisation
from .cluster import Cluster
from .layout import Layout, check, memory_per_device
from .memory import CONTEXT_METHODS, RECOMPUTE, SCHEDULES, Memory
from .model import Transformer
from .steptime import StepTime, step_time

RESERVE = 0.1  # the share of a device's memory left to the framework, its allocator and what the model leaves out


@dataclass(frozen=True)
class Candidate:
    """One layout's verdict: its memory, its step time and MFU when it fits, why not when it does not."""

    layout: Layout
    batch: int  # sequences a step: the requested batch rounded down to a multiple of the replicas
    memory: Memory
    time: StepTime | None = None  # None: rejected
    mfu: float = 0.0
    rejected: str | None = None

    @property
    def fits(self) -> bool:
        return self.rejected is None


def simpler_first(layout: Layout, memory_bytes: float) -> tuple[int, int, float]:
    """How :func:`~.plan.plan` orders layouts whose predicted MFU ties: fewer accumulation steps, then a lower
    ZeRO stage, then less memory. Each microbatch and each sharded collective costs launches and smaller
    operations that the step time leaves out, so among equals the simpler layout goes first.
    """
    return layout.accumulate, layout.zero, memory_bytes


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(model: Transformer, devices: int) -> Iterator[dict[str, int]]:
    """Every ``(tensor, expert, context, stages, data)`` whose product is ``devices`` that the model splits into."""
    for tensor in divisors(devices):
        for expert in divisors(devices // tensor):
            for context in divisors(devices // (tensor * expert)):
                rest = devices // (tensor * expert * context)
                for stages in divisors(rest):
                    mesh = dict(tensor=tensor, expert=expert, context=context, stages=stages, data=rest // stages)
                    if check(model, Layout(**mesh), expert * mesh["data"]) is None:
                        yield mesh


def layouts(model: Transformer, devices: int, batch: int) -> Iterator[Layout]:
    """Every layout :func:`plan` weighs, before recomputation and accumulation are chosen."""
    for mesh in meshes(model, devices):
        replicas = mesh["data"] * mesh["expert"]
        if replicas > batch:
            continue
        sharded = mesh["data"] * mesh["context"] * mesh["expert"] > 1
        stages = mesh["stages"]
        per_replica = batch // replicas
        pipelines = [(s, stages * k) for s in SCHEDULES for k in (1, 2, 4, 8) if per_replica % (stages * k) == 0]
        for zero in range(4) if sharded else [0]:
            for sp in (False, True) if mesh["tensor"] > 1 else [False]:
                for method in CONTEXT_METHODS if mesh["context"] > 1 else ["ring"]:
                    for schedule, m in pipelines if stages > 1 else [("1f1b", 1)]:
                        yield Layout(**mesh, zero=zero, sequence_parallel=sp, context_method=method,
                                     schedule=schedule, microbatches=m)  # fmt: skip


def assess(
    model: Transformer, layout: Layout, cluster: Cluster, batch: int, *, precision: str, optimizer: str,
    efficiency: float, overlap: str, reserve: float,
) -> Candidate:  # fmt: skip
    """``layout`` exactly as given: its memory, and its step time and MFU when it fits in the memory kept free."""
    used = batch // layout.replicas * layout.replicas
    if reason := check(model, layout, used):
        return Candidate(layout, used, Memory(0, 0, 0, 0), rejected=reason)
    memory = memory_per_device(model, layout, used, precision=precision, optimizer=optimizer)
    budget = (1 - reserve) * cluster.memory_bytes
    if memory.total > budget:
        return Candidate(layout, used, memory, rejected=too_large(memory, budget))
    time = step_time(model, layout, cluster, used, precision=precision, efficiency=efficiency, overlap=overlap)
    per_device = model.flops_per_token() * used * model.seq / cluster.devices
    return Candidate(
        layout, used, memory, time, flops_utilisation(per_device, time.total, cluster.peak_flops(precision))
    )


def too_large(memory: Memory, budget: float, smallest: str = "") -> str:
    """Why a layout is rejected for its memory; ``smallest``: the variant named, when it is the smallest tried."""
    at = f" even at its smallest ({smallest})" if smallest else ""
    return f"needs {memory.total / 1e9:.1f} GB a device{at}: {(memory.total - budget) / 1e9:.1f} GB over the " \
           f"{budget / 1e9:.1f} GB usable"  # fmt: skip


def weigh(model: Transformer, layout: Layout, cluster: Cluster, batch: int, **options) -> Candidate:
    """The fastest variant of ``layout`` (recomputation, accumulation) that fits (:func:`assess`), or why none does."""
    best, smallest = None, None
    for recompute in RECOMPUTE:
        variant = replace(layout, recompute=recompute)
        # accumulation steps, fewest first: each count that splits a replica's sequences (a pipeline's are its own)
        for accumulate in divisors(batch // layout.replicas) if layout.stages == 1 else [layout.microbatches]:
            trial = replace(variant, microbatches=accumulate)
            verdict = assess(model, trial, cluster, batch, **options)
            if verdict.memory.total and (smallest is None or verdict.memory.total < smallest.memory.total):
                smallest = verdict
            if verdict.fits:
                if best is None or verdict.mfu > best.mfu:
                    best = verdict
                break  # more accumulation only adds time
    if best is not None:
        return best
    if smallest is None:
        return Candidate(layout, batch, Memory(0, 0, 0, 0), rejected=check(model, layout, batch) or "cannot split")
    budget = (1 - options["reserve"]) * cluster.memory_bytes
    return replace(smallest, rejected=too_large(smallest.memory, budget, smallest.layout.name))
