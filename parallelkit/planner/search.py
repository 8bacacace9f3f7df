"""Every layout the kit can run, for a model, a cluster and a batch: each one's memory and step time, ranked.

:func:`plan` enumerates the layouts (:func:`layouts`): every way to split the devices over
``tensor``, ``expert``, ``context``, ``stages`` and ``data``, with each ZeRO stage, with and
without sequence parallelism, each context method, each pipeline schedule (interleaved 1F1B
with each number of chunks that splits a stage's layers). For each it weighs recomputation off,
selective and full, and gradient accumulation over more microbatches when the batch does not
fit (the fewest that fit, of the counts that split a replica's sequences evenly), a pipeline
at every such count from its stages up (:func:`_pipeline_counts`: :func:`weigh`), and keeps the
fastest variant that fits in ``(1 - reserve)`` of a device's memory; a layout with none that fits is
kept as rejected, with by how much it misses. The rest are ranked by model FLOPs utilisation
(MFU: the model's FLOPs a second, over the devices' peak): the same order as tokens a second;
ties go to the simpler layout (:func:`simpler_first`). Layouts are weighed from the highest bound on
their MFU down (:func:`ceilings`), and those whose bound falls below the :data:`TOP`-th best MFU found
are left (:func:`search`): the first :data:`TOP` are exactly the whole search's.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, replace

from ..measure.costmodel import links as _links
from ..measure.roofline import flops_utilisation
from . import kernels as _kernels
from . import layout as _layout
from . import steptime as _steptime
from .build import unsupported
from .cluster import Cluster
from .kernels import compute_seconds
from .layout import Layout, check, memory_per_device
from .memory import CONTEXT_METHODS, ELEMENT_BYTES, SCHEDULES, Memory
from .model import ModelShape
from .steptime import StepTime, bubble_share, communication_seconds, gradient_seconds, hidden_families, step_time

TOP = (
    10  # the first rows of the ranking plan() finds exactly (Plan.table's): layouts that could not reach them are left
)
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


@functools.lru_cache(maxsize=256)
def divisors(n: int) -> tuple[int, ...]:
    """Every divisor of ``n``, ascending, built from its prime factors (:func:`_prime_factors`).

    >>> divisors(12), len(divisors(10**15))
    ((1, 2, 3, 4, 6, 12), 256)
    """
    found = [1]
    for prime, power in _prime_factors(n).items():
        found = [d * prime**k for d in found for k in range(power + 1)]
    return tuple(sorted(found))


def _prime_factors(n: int) -> dict[int, int]:
    """``n``'s prime factors and their powers, by trial division: at most about ``sqrt(n) / 2`` divisions.

    >>> _prime_factors(360), _prime_factors(10**12 + 39)  # the second is a prime
    ({2: 3, 3: 2, 5: 1}, {1000000000039: 1})
    """
    factors: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
        p += 1 if p == 2 else 2  # 2, then the odd numbers
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return factors


def meshes(model: ModelShape, devices: int) -> Iterator[dict[str, int]]:
    """Every ``(tensor, expert, context, stages, data)`` whose product is ``devices`` that the model splits into."""
    for tensor in divisors(devices):
        for expert in divisors(devices // tensor):
            for context in divisors(devices // (tensor * expert)):
                rest = devices // (tensor * expert * context)
                for stages in divisors(rest):
                    mesh = dict(tensor=tensor, expert=expert, context=context, stages=stages, data=rest // stages)
                    if check(model, Layout(**mesh), expert * mesh["data"]) is None:
                        yield mesh


def layouts(model: ModelShape, devices: int, batch: int) -> Iterator[Layout]:
    """Every layout :func:`plan` weighs, before recomputation and accumulation are chosen."""
    for mesh in meshes(model, devices):
        yield from _mesh_layouts(model, mesh, batch)


def _mesh_layouts(model: ModelShape, mesh: dict[str, int], batch: int) -> Iterator[Layout]:
    """The layouts of one mesh (axis sizes) that :func:`plan` weighs: each ZeRO stage, sequence parallelism,
    context method and pipeline schedule; none when the mesh has more replicas than ``batch`` sequences."""
    replicas, layers = mesh["data"] * mesh["expert"], model.layers
    if replicas <= batch:
        sharded = mesh["data"] * mesh["context"] * mesh["expert"] > 1
        stages = mesh["stages"]
        per_replica = batch // replicas
        pipelines = [("1f1b", 1, 1)] if stages == 1 else list(schedules(layers, stages, per_replica))
        for zero in range(4) if sharded else [0]:
            for sp in (False, True) if mesh["tensor"] > 1 else [False]:
                for method in CONTEXT_METHODS if mesh["context"] > 1 else ["ring"]:
                    for schedule, virtual, m in pipelines:
                        yield Layout(**mesh, zero=zero, sequence_parallel=sp, context_method=method,
                                     schedule=schedule, microbatches=m, virtual=virtual)  # fmt: skip


def schedules(layers: int, stages: int, per_replica: int) -> Iterator[tuple[str, int, int]]:
    """(schedule, virtual, fewest microbatches) of each pipeline schedule :func:`plan` weighs for ``stages`` stages
    of ``layers`` layers: interleaved 1F1B with every number of chunks (2 or more) that splits a stage's layers
    evenly; none without microbatch counts (:func:`_pipeline_counts`)."""
    for schedule in SCHEDULES:
        chunks = [v for v in divisors(layers // stages) if v > 1 and layers % stages == 0]
        for virtual in chunks if schedule == "interleaved" else [1]:
            if counts := _pipeline_counts(stages, virtual, per_replica):
                yield schedule, virtual, counts[0]


@functools.lru_cache(maxsize=4096)
def _pipeline_counts(stages: int, virtual: int, per_replica: int) -> tuple[int, ...]:
    """The microbatch counts a pipeline of ``stages`` is weighed at: every divisor of a replica's sequences from
    ``stages`` up (fewer leave a stage idle for most of the step), multiples of ``stages`` under interleaved
    1F1B (``virtual > 1``, as Megatron-LM's schedule requires).

    >>> _pipeline_counts(12, 1, 256), _pipeline_counts(4, 2, 48)  # BLOOM's 12 stages, 256 sequences a replica
    ((16, 32, 64, 128, 256), (4, 8, 12, 16, 24, 48))
    """
    return tuple(m for m in divisors(per_replica) if m >= stages and (virtual == 1 or m % stages == 0))


def ceilings(
    model: ModelShape, group: Sequence[Layout], cluster: Cluster, batch: int, **options
) -> list[tuple[float, float]]:
    """The highest MFU each layout of ``group`` (the layouts of one mesh: :func:`_mesh_layouts`) could reach, and
    the highest it could reach with full recomputation.

    Its step time is at least the one this adds up, so its MFU is at most this, whatever :func:`weigh` then
    chooses (recomputation, accumulation). Each part is one that no such variant goes below:

    - compute without recomputation, at the layout's microbatches, with sequence parallelism and the group's
      highest ZeRO stage (recomputation only adds work; more microbatches make each kernel smaller, which never
      raises its share of the peak; sequence parallelism and ZeRO only split work); the second figure of each
      pair with full recomputation instead, the ceiling where only it fits (:func:`only_full_fits`);
    - the layout's pipeline bubble share of that compute (:func:`.steptime.bubble_share`) at its most
      microbatches (:func:`_pipeline_counts`);
    - the tensor, context (the layout's method) and expert collectives at the layout's microbatches (its
      fewest: one without a pipeline): ``m`` collectives of ``1/m`` the bytes each take longer as ``m`` grows
      (each round is a latency plus bytes over a bandwidth, :meth:`~parallelkit.measure.costmodel.Link.seconds`);
      the pipeline's sends at least 0;
    - the gradients' collectives of the layout's ZeRO stage at its fewest microbatches, unless they may hide
      (then at least 0); so the tensor, context and expert collectives that may (``overlap``).
    """
    precision, hides = options["precision"], hidden_families(options["overlap"])
    kernel = options.get("attention", "flash")
    first = replace(group[0], zero=0, sequence_parallel=False, schedule="1f1b", virtual=1, recompute="none")
    # the least compute: sequence parallelism splits the norms' work, ZeRO the optimizer's
    least = {"sequence_parallel": first.tensor > 1, "zero": max(layout.zero for layout in group)}
    timed, gradients, full = {}, {}, {}
    for method, m in {(layout.context_method, layout.microbatches) for layout in group}:
        like = replace(first, context_method=method, microbatches=m)
        compute = compute_seconds(model, replace(like, **least), cluster, batch, precision, options["efficiency"],
                                  kernel)[0]  # fmt: skip
        micro = batch // (like.replicas * m)
        timed[method, m] = compute, communication_seconds(model, like, cluster, micro, ELEMENT_BYTES[precision])
    used = batch // first.replicas * first.replicas
    per_device = model.flops_per_token() * used * model.seq / cluster.devices
    found = []
    for layout in group:
        at = (layout.context_method, layout.microbatches)
        compute, parts = timed[at]
        if at not in full:
            like = replace(first, context_method=at[0], microbatches=at[1], recompute="full", **least)
            full[at] = compute_seconds(model, like, cluster, batch, precision, options["efficiency"], kernel)[0]
        most = _pipeline_counts(layout.stages, layout.virtual, batch // layout.replicas)[-1] if layout.stages > 1 else 1
        stretch = 1 + bubble_share(layout) * layout.microbatches / most
        seconds = sum(parts.get(k, 0.0) for k in ("tensor", "context", "experts") if k not in hides)
        if "gradients" not in hides and "gradients" in parts:
            key = (layout.zero, layout.microbatches)
            if key not in gradients:
                like = replace(first, zero=layout.zero, microbatches=layout.microbatches)
                gradients[key] = gradient_seconds(model, like, cluster, ELEMENT_BYTES[precision])
            seconds += gradients[key]
        peak = cluster.peak_flops(precision)
        found.append((flops_utilisation(per_device, seconds + compute * stretch, peak),
                      flops_utilisation(per_device, seconds + full[at] * stretch, peak)))  # fmt: skip
    return found


def only_full_fits(model: ModelShape, layout: Layout, cluster: Cluster, batch: int, **options) -> bool:
    """Whether only full recomputation could fit ``layout``: selective does not fit even at its most microbatches
    (recomputing nothing needs more memory still); full may not fit either."""
    per_replica = batch // layout.replicas
    most = _pipeline_counts(layout.stages, layout.virtual, per_replica)[-1] if layout.stages > 1 else per_replica
    selective = replace(layout, recompute="selective", microbatches=most)
    used = batch // layout.replicas * layout.replicas
    if check(model, selective, used) is not None:
        return False
    memory = memory_per_device(model, selective, used, precision=options["precision"], optimizer=options["optimizer"],
                               loss=options.get("loss", "in_place"))  # fmt: skip
    return memory.total > (1 - options["reserve"]) * cluster.memory_bytes


def search(
    model: ModelShape, cluster: Cluster, batch: int, *, top: int | None = TOP, **options
) -> tuple[list[Candidate], int]:
    """Every layout's verdict that could rank among the ``top`` best MFUs (all of them when ``top`` is None),
    in :func:`layouts`'s order, and how many layouts were not weighed.

    The layouts are weighed from the highest :func:`ceilings` down; once ``top`` layouts the kit can build
    (:func:`.build.unsupported`) fit and the next layout's ceiling is below the ``top``-th best MFU found
    among them, it and every one after it is left: none could reach the first ``top`` (a tie could: ties are
    weighed); a layout that fits only with full recomputation is left when its ceiling with it is below. The
    first ``top`` of the ranking are then exactly those of the search that weighs everything.
    """
    found = [layout for mesh in meshes(model, cluster.devices) for layout in _mesh_layouts(model, mesh, batch)]
    order = range(len(found))
    if top is not None:
        bounds, start = [], 0
        while start < len(found):  # one mesh at a time: its layouts are consecutive
            end = start + 1
            while end < len(found) and _mesh(found[end]) == _mesh(found[start]):
                end += 1
            bounds += ceilings(model, found[start:end], cluster, batch, **options)
            start = end
        order = sorted(order, key=lambda i: -bounds[i][0])
    weighed: dict[int, Candidate] = {}
    best: list[float] = []  # a heap of the top MFUs found so far, the lowest first
    for i in order:
        if top is not None and len(best) == top:
            if bounds[i][0] < best[0] * (1 - 1e-9):  # rounding aside
                break
            if bounds[i][1] < best[0] * (1 - 1e-9) and only_full_fits(model, found[i], cluster, batch, **options):
                continue
        weighed[i] = verdict = weigh(model, found[i], cluster, batch, **options)
        if verdict.fits and top is not None and unsupported(verdict.layout) is None:  # the kit's ranking's top
            (heapq.heappush if len(best) < top else heapq.heappushpop)(best, verdict.mfu)
    return [weighed[i] for i in sorted(weighed)], len(found) - len(weighed)


def _mesh(layout: Layout) -> tuple[int, ...]:
    return layout.tensor, layout.expert, layout.context, layout.stages, layout.data


def assess(
    model: ModelShape, layout: Layout, cluster: Cluster, batch: int, *, precision: str, optimizer: str,
    efficiency: float, overlap: str | Collection[str], reserve: float, attention: str = "flash", timed: bool = True,
    loss: str = "in_place",
) -> Candidate:  # fmt: skip
    """``layout`` exactly as given: its memory, and its step time and MFU when it fits in the memory kept free
    (``timed=False``: whether it fits alone, no time); ``loss``: the cross-entropy counted (:data:`.memory.LOSSES`)."""
    used = batch // layout.replicas * layout.replicas
    if reason := check(model, layout, used):
        return Candidate(layout, used, Memory(0, 0, 0, 0), rejected=reason)
    memory = _memory(model, layout, used, precision, optimizer, loss)
    budget = (1 - reserve) * cluster.memory_bytes
    if memory.total > budget:
        return Candidate(layout, used, memory, rejected=_too_large(memory, budget))
    if not timed:
        return Candidate(layout, used, memory)
    time = step_time(
        model, layout, cluster, used, precision=precision, efficiency=efficiency, overlap=overlap, attention=attention
    )
    per_device = model.flops_per_token() * used * model.seq / cluster.devices
    return Candidate(
        layout, used, memory, time, flops_utilisation(per_device, time.total, cluster.peak_flops(precision))
    )


@functools.lru_cache(maxsize=65536)  # a weighing asks for a variant's memory, then for it again with its time
def _memory(model: ModelShape, layout: Layout, batch: int, precision: str, optimizer: str, loss: str) -> Memory:
    """:func:`.layout.memory_per_device`, remembered."""
    return memory_per_device(model, layout, batch, precision=precision, optimizer=optimizer, loss=loss)


def _too_large(memory: Memory, budget: float, smallest: str = "") -> str:
    """Why a layout is rejected for its memory; ``smallest``: the variant named, when it is the smallest tried."""
    at = f" even at its smallest ({smallest})" if smallest else ""
    return f"needs {memory.total / 1e9:.1f} GB a device{at}: {(memory.total - budget) / 1e9:.1f} GB over the " \
           f"{budget / 1e9:.1f} GB usable"  # fmt: skip


def weigh(model: ModelShape, layout: Layout, cluster: Cluster, batch: int, **options) -> Candidate:
    """The fastest variant of ``layout`` (recomputation, accumulation) that fits (:func:`assess`), or why none does.

    More accumulation steps and more recomputation only add time, so each recomputation is weighed with the
    fewest steps that fit (:func:`_fewest_that_fit`) and the fastest of these wins (ties to less recomputation);
    once one fits with the fewest steps of all, more recomputation is not weighed. Selective recomputation is
    weighed before none: without recomputation a layer keeps the same arrays and the attention scores too, so it
    needs at least as many steps, and is not weighed where selective never fits. The variant that needs the least
    memory (full recomputation, the most steps) is weighed first: when it does not fit, nothing does, and it says
    by how much it misses. A pipeline's microbatches are weighed from the fewest that fit up, each.
    """
    # accumulation steps: each count that splits a replica's sequences; a pipeline's microbatches, from the layout's
    per_replica = batch // layout.replicas
    if layout.stages == 1:
        counts = divisors(per_replica)
    else:
        counts = tuple(
            m for m in _pipeline_counts(layout.stages, layout.virtual, per_replica) if m >= layout.microbatches
        )

    def trial(microbatches: int, variant: Layout, timed: bool = True) -> Candidate:
        return assess(model, _variant(variant, microbatches, variant.recompute), cluster, batch, **options,
                      timed=timed)  # fmt: skip

    def fewest(recompute: str, least: int = counts[0]) -> Candidate:
        """The fewest steps that fit, found by memory alone, then timed."""
        variant = _variant(layout, layout.microbatches, recompute)
        found = _fewest_that_fit(counts[counts.index(least) :], functools.partial(trial, variant=variant, timed=False))
        return trial(found.layout.microbatches, found.layout) if found.fits else found

    timing = {name: options[name] for name in ("precision", "efficiency", "overlap")}
    timing["attention"] = options.get("attention", "flash")

    def fastest(found: Candidate) -> Candidate:
        """A pipeline's fastest count from the fewest that fits up: its bubble shrinks as its sends grow."""
        if layout.stages == 1 or not found.fits:
            return found
        best, best_s = found.layout, found.time.total  # more microbatches need less memory: each fits
        for m in counts[counts.index(best.microbatches) + 1 :]:
            variant = _variant(found.layout, m, found.layout.recompute)
            if (seconds := step_time(model, variant, cluster, found.batch, **timing).total) < best_s:
                best, best_s = variant, seconds
        return found if best is found.layout else assess(model, best, cluster, batch, **options)

    if not (
        smallest := trial(counts[-1], _variant(layout, layout.microbatches, "full"), timed=False)
    ).fits:  # the least memory
        return rejection(smallest, layout, batch, (1 - options["reserve"]) * cluster.memory_bytes)
    selective = fewest("selective")
    tried = [fewest("none", selective.layout.microbatches), selective] if selective.fits else [selective]
    if not any(v.fits and v.layout.microbatches == counts[0] for v in tried):
        tried.append(fewest("full"))
    return max((fastest(v) for v in tried if v.fits), key=lambda v: v.mfu)  # full recomputation fits, at least


@functools.lru_cache(maxsize=65536)  # a weighing asks for the same variants many times: each is built once
def _variant(layout: Layout, microbatches: int, recompute: str) -> Layout:
    """``layout`` with ``microbatches`` and ``recompute``, built without ``Layout``'s checks (tens of thousands a
    plan): ``layout`` passed them, and the search's counts (divisors, :func:`_pipeline_counts`) and recomputations
    (:data:`.memory.RECOMPUTE`'s names) pass them too."""
    if microbatches == layout.microbatches and recompute == layout.recompute:
        return layout
    variant = object.__new__(Layout)
    variant.__dict__.update(layout.__dict__, microbatches=microbatches, recompute=recompute)
    return variant


def clear_caches() -> None:
    """Forget what earlier plans remembered (the planner's and the cost model's caches): the next plan takes the
    time a plan takes in a fresh process."""
    for cache in (divisors, _pipeline_counts, _memory, _variant, _kernels._passes, _kernels._head, _kernels._optimizer,
                  _layout._layer_bytes, _layout._pending_bytes, _layout.device_state, _steptime.achieved,
                  _steptime._axis_seconds, _links.shifted_round):  # fmt: skip
        cache.cache_clear()


def rejection(smallest: Candidate, layout: Layout, batch: int, budget: float) -> Candidate:
    """``layout`` rejected, by ``smallest``: its variant that needs the least memory, which does not fit either."""
    if not smallest.memory.total:  # it cannot split the batch or the model at all
        return Candidate(layout, batch, Memory(0, 0, 0, 0), rejected=smallest.rejected or "cannot split")
    return replace(smallest, rejected=_too_large(smallest.memory, budget, smallest.layout.name))


def _fewest_that_fit(counts: Sequence[int], verdict: Callable[[int], Candidate]) -> Candidate:
    """The verdict for the fewest of ``counts`` (ascending accumulation steps) that fits; when none does, the
    verdict for the most (the least memory).

    A device's memory falls as the steps rise (its microbatch shrinks; the state stays), so the counts that fit
    are the last ones: the first and the last are tried, then the first that fits is found by halving.
    """
    first = verdict(counts[0])
    if first.fits or len(counts) == 1:
        return first
    last = verdict(counts[-1])
    if not last.fits:
        return last
    low, high, found = 1, len(counts) - 1, last  # counts[low - 1] does not fit; counts[high] does
    while low < high:
        middle = (low + high) // 2
        if (tried := verdict(counts[middle])).fits:
            high, found = middle, tried
        else:
            low = middle + 1
    return found
