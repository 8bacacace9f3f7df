"""The planner's answer: every layout for a model, a cluster and a batch, ranked, each with why.

>>> from parallelkit.planner import MODELS, Cluster
>>> answer = plan(MODELS["llama3-8b"], Cluster.published("H100 SXM", per_node=8), global_batch_tokens=1_048_576)
>>> answer.best.name, answer.batch  # 128 sequences of 8192 tokens
('data 4 x context 2, ZeRO-1, allgather, accumulate 32, remat selective', 128)
>>> print(answer.table(1))  # doctest: +NORMALIZE_WHITESPACE
  #  layout                                                                 GB/dev   step s    MFU  binds
  1  data 4 x context 2, ZeRO-1, allgather, accumulate 32, remat selective    69.9   12.911  62.7%  compute
(436 layouts fit, 4 do not: plan.rejected; 237 could not reach the first 10, not weighed)

By default no communication hides (``overlap="none"``): ZeRO-3's gathers would cost 2.3 s a step in the
open, and a context axis keeps the activations within memory instead. Hiding the gradients' collectives
behind compute, as FSDP does, the first choice is torchtitan's published layout for this model and cluster
(FSDP over the 8, selective recomputation), accumulating microbatches up to this batch:

>>> plan(MODELS["llama3-8b"], Cluster.published("H100 SXM", per_node=8), global_batch_tokens=1_048_576,
...      overlap="full").best.name
'data 8, ZeRO-3, accumulate 16, remat selective'
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from fractions import Fraction

from ..core.types import is_count, is_number
from .build import unsupported
from .cluster import Cluster
from .layout import Layout, activations
from .memory import ELEMENT_BYTES, LOSSES, OP_LEVEL, STATE_BYTES, bytes_a_logit
from .model import MODELS, ModelShape
from .search import RESERVE, TOP, Candidate, assess, layouts, search, simpler_first, weigh
from .steptime import ATTENTION, HIDEABLE, OVERLAP, hidden_families


@dataclass(frozen=True)
class Plan:
    """Every layout weighed for one model, cluster and batch: ``ranked`` (fastest first), ``rejected`` (they do not
    fit), and ``unbuilt``: layouts that fit but the kit cannot build (:func:`.build.unsupported` says why), ranked
    apart, fastest first, never among ``ranked``."""

    model: ModelShape
    cluster: Cluster
    batch: int  # sequences asked for
    precision: str
    optimizer: str
    efficiency: float | None
    overlap: str | tuple[str, ...]
    reserve: float
    ranked: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]
    unweighed: int = 0  # layouts left unweighed: none could reach the first TOP (search.search)
    unbuilt: tuple[Candidate, ...] = ()
    attention: str = "flash"  # the attention kernel timed (steptime.ATTENTION)
    loss: str = "in_place"  # the cross-entropy counted (memory.LOSSES)

    @property
    def best(self) -> Layout:
        """The layout the kit can build with the highest predicted MFU.

        Raises:
          ValueError: every layout that fits is one the kit cannot build (``unbuilt``), naming the fastest and why.
        """
        if not self.ranked:
            first = self.unbuilt[0].layout
            raise ValueError(f"No layout the kit can build fits; the fastest that fits is {first.name}, which the kit "
                             f"cannot build: {unsupported(first)} (plan.unbuilt ranks them).")  # fmt: skip
        return self.ranked[0].layout

    def find(self, layout: Layout) -> Candidate:
        """``layout``'s verdict: the plan's own when it weighed it (a layout given without its recomputation or
        accumulation matches the variant the plan chose), else :meth:`assess`'s of the layout as given.

        Raises:
          TypeError: something other than a :class:`Layout`.
          ValueError: a layout for another number of devices than the cluster's.
        """
        self._check(layout)
        for candidate in (*self.ranked, *self.unbuilt, *self.rejected):
            if candidate.layout == layout or _base(candidate.layout) == _base(layout) and layout.recompute == "none":
                return candidate
        return self.assess(layout)

    def assess(self, layout: Layout) -> Candidate:
        """``layout`` exactly as given (its recomputation and microbatches too), weighed as this plan weighs.

        Raises:
          TypeError: something other than a :class:`Layout`.
          ValueError: a layout for another number of devices than the cluster's.
        """
        self._check(layout)
        options = {
            name: getattr(self, name)
            for name in ("precision", "optimizer", "efficiency", "overlap", "reserve", "attention", "loss")
        }
        return assess(self.model, layout, self.cluster, self.batch, **options)

    def _check(self, layout: object) -> None:
        """Raise unless ``layout`` is a :class:`Layout` of this plan's devices."""
        if not isinstance(layout, Layout):
            raise TypeError(f"layout={layout!r} is not a Layout: the plan weighs layouts such as "
                            "Layout(data=2, tensor=4) (plan.ranked[0].layout is the best; plan.table() shows their "
                            "names).")  # fmt: skip
        if layout.devices != self.cluster.devices:
            raise ValueError(f"{layout.name} uses {layout.devices} devices; this plan is for {self.cluster.devices}. "
                             f"Give a layout whose axes multiply to {self.cluster.devices}.")  # fmt: skip

    def table(self, rows: int = 10) -> str:
        """The ``rows`` best layouts as text: memory per device, step time, MFU and what binds each."""
        shown = self.ranked[:rows]
        width = max([len("layout"), *(len(c.layout.name) for c in shown)])
        lines = [f"{'#':>3}  {'layout':<{width}} {'GB/dev':>7} {'step s':>8} {'MFU':>6}  binds"]
        for rank, c in enumerate(shown, 1):
            lines.append(f"{rank:>3}  {c.layout.name:<{width}} {c.memory.total / 1e9:>7.1f} {c.time.total:>8.3f} "
                         f"{c.mfu:>6.1%}  {c.time.binding}")  # fmt: skip
        left = f"; {self.unweighed} could not reach the first {TOP}, not weighed" if self.unweighed else ""
        lines.append(f"({len(self.ranked)} layouts fit, {len(self.rejected)} do not: plan.rejected{left})")
        if self.unbuilt:
            first, why = self.unbuilt[0], unsupported(self.unbuilt[0].layout)
            lines.append(f"({len(self.unbuilt)} more fit that the kit cannot build, ranked apart in plan.unbuilt; "
                         f"the fastest, {first.layout.name} at {first.mfu:.1%} MFU: {why})")  # fmt: skip
        return "\n".join(lines)

    def explain(self, layout: Layout) -> str:
        """Why ``layout`` ranks where it does (its memory and time, part by part), or why it was rejected.

        Raises:
          TypeError, ValueError: as :meth:`find`.
        """
        c = self.find(layout)
        m, gb = c.memory, 1e9
        name = self.model.name or "the model"
        lines = [f"{c.layout.name} on {self.cluster.name}, {c.batch} sequences of {self.model.seq} a step:"]
        if not c.fits:
            return "\n".join([*lines, f"  rejected: {c.rejected}."])
        rank = 1 + sum(other.mfu > c.mfu for other in self.ranked)  # ties share the better rank
        where = f"rank {rank} of {len(self.ranked)}" if c in self.ranked else f"would rank {rank} of {len(self.ranked)}"
        lines.append(f"  {where}: MFU {c.mfu:.1%}, {c.time.total:.3f} s a step, bound by {c.time.binding}")
        split = c.layout.tensor * c.layout.stages
        whose = "torchtitan's op-level policy" if c.layout.recompute == OP_LEVEL else "Korthikanti et al.'s accounting"
        act = activations(self.model, c.layout, c.batch, precision=self.precision, loss=self.loss)
        stage = "the last stage" if act.last_stage and c.layout.stages > 1 else "the first stage"
        shared = c.layout.expert * c.layout.context * c.layout.data
        per_logit = bytes_a_logit(self.loss, tensor=c.layout.tensor, element_bytes=ELEMENT_BYTES[self.precision])
        per_logit = per_logit if m.logits else 0  # a first pipeline stage runs no loss
        lines += [
            f"  memory {m.total / gb:.1f} GB of {self.cluster.memory_bytes / gb:.0f} GB ({self.reserve:.0%} kept "
            "back):",
            f"    parameters {m.params / gb:.2f} GB, gradients {m.grads / gb:.2f} GB, optimizer "
            f"{m.optimizer / gb:.2f} GB: {name}'s {self.model.params / 1e9:.2f} B parameters over tensor x stages "
            f"= {split}" + (f", then ZeRO-{c.layout.zero} over {shared}" if c.layout.zero else ""),
            f"    activations {m.activations / gb:.2f} GB"
            + (f" on {stage}" if c.layout.stages > 1 else "")
            + f": {act.layers} layers x {act.in_flight:g} microbatch(es) of {act.micro} sequence(s) in flight x "
            f"{act.per_layer / gb:.3f} GB a layer ({whose}, recompute {c.layout.recompute}: "
            "memory.layer_activation_bytes)"
            + (f", and {act.pending} deferred weight pass(es) x {act.per_pending / gb:.3f} GB a layer (ZB-H1: "
               "memory.weight_pass_bytes)" if act.pending else "")
            + (f" + {act.rebuilt / gb:.3f} GB for the layer being rebuilt" if act.rebuilt else ""),
            f"    loss {m.logits / gb:.2f} GB: {per_logit} bytes a logit ({self.loss} cross-entropy at its peak: "
            f"memory.loss_bytes) x {act.micro} x {self.model.seq // c.layout.context} tokens x "
            f"{self.model.vocab} vocabulary / tensor {c.layout.tensor}",
            *([f"    gathered {m.gathered / gb:.2f} GB: ZeRO-3's parameters at the peak, the ends and one layer "
               "(memory.gathered_bytes)"] if m.gathered else []),
            f"  time: compute {c.time.compute:.3f} s at {c.time.efficiency:.0%} of the peak"
            + (" (each operation's own time)" if self.efficiency is None else "")
            + ", "
            f"bubble {c.time.bubble:.3f} s",
        ]  # fmt: skip
        for family, seconds in c.time.communication.items():
            hidden = c.time.hidden[family]
            behind = f", {hidden:.3f} s of it hidden behind compute" if hidden else ""
            lines.append(f"    {family}: {seconds:.3f} s, {c.time.exposed[family]:.3f} s exposed{behind}")
        if rank > 1:
            first = self.ranked[0]
            faster = c.time.total / first.time.total * first.batch / c.batch
            lines.append(f"  the best, {first.layout.name}, is {faster:.2f} times as fast per token")
        return "\n".join(lines)


def _base(layout: Layout) -> Layout:
    return replace(layout, recompute="none", microbatches=1 if layout.stages == 1 else layout.microbatches)


def plan(
    model: ModelShape | str,
    cluster: Cluster,
    *,
    global_batch_tokens: int,
    precision: str = "bf16",
    optimizer: str = "adam",
    efficiency: float | None = None,
    overlap: str | Collection[str] = "none",
    reserve: float = RESERVE,
    exhaustive: bool = False,
    attention: str = "flash",
    loss: str = "in_place",
) -> Plan:
    """Rank every layout of ``cluster``'s devices that trains ``model`` on ``global_batch_tokens`` tokens a step.

    ``model``: a :class:`ModelShape`, or the name of a published one (a key of :data:`.model.MODELS`).
    The batch is ``global_batch_tokens / model.seq`` sequences (rounded); a layout whose replicas
    do not split it evenly takes the largest batch below it that they do (MFU compares them
    fairly). ``efficiency``: None for each operation's own time (:func:`.kernels.layer_passes`),
    or the share every FLOP reaches; ``overlap``: which communication hides behind compute,
    ``"none"``, ``"full"`` (the gradients) or a collection of :data:`.steptime.HIDEABLE` families
    (:func:`.steptime.exposed_seconds` says behind what); ``attention``: ``"flash"`` or
    ``"unfused"`` (:func:`.steptime.step_time`); ``reserve``:
    the share of each device's memory kept back (:mod:`.search`); ``loss``: the framework's cross-entropy,
    Megatron-LM's ``"in_place"`` or PyTorch's ``"eager"`` (:func:`.memory.loss_bytes`).
    The first :data:`.search.TOP` (10) of the ranking are exact; a layout that could not reach them
    is not weighed (:func:`.search.search`; ``Plan.unweighed`` counts them) unless ``exhaustive``.

    Raises:
      TypeError: a ``model`` or ``cluster`` of another type.
      ValueError: a model name :data:`.model.MODELS` lacks, an option out of range, or no layout fits (the
        message says by how much, and what would make one fit).
    """
    model = _model(model)
    if not isinstance(cluster, Cluster):
        raise TypeError(f"plan(cluster={cluster!r}) is not a planner Cluster: give one such as "
                        "pk.planner.Cluster.published('H100 SXM', per_node=8), or Cluster.measured().")  # fmt: skip
    if not is_count(global_batch_tokens):
        raise ValueError(f"plan(global_batch_tokens={global_batch_tokens!r}): the tokens a step, a whole number >= 1, "
                         f"for example {64 * model.seq} (64 sequences of {model.seq}).")  # fmt: skip
    if not 0 <= reserve < 1:
        raise ValueError(f"plan(reserve={reserve!r}): the share of memory kept back, from 0 up to (not) 1, e.g. 0.1.")
    if not _overlap_ok(overlap) or not _is_share(efficiency) or (precision, optimizer) not in STATE_BYTES:
        raise ValueError(f"plan(precision={precision!r}, optimizer={optimizer!r}, efficiency={efficiency!r}, "
                         f"overlap={overlap!r}): precision and optimizer one of {list(STATE_BYTES)}, efficiency in "
                         f"(0, 1] or None (each matrix product's roofline), overlap one of {OVERLAP} or a collection "
                         f"of {HIDEABLE}.")  # fmt: skip
    if attention not in ATTENTION:
        raise ValueError(f"plan(attention={attention!r}) is not an attention kernel the planner times: give one of "
                         f"{ATTENTION}.")  # fmt: skip
    if loss not in LOSSES:
        raise ValueError(f"plan(loss={loss!r}) is not a cross-entropy the planner counts: give one of {LOSSES} "
                         "(Megatron-LM's in place, or PyTorch's op by op, as torchtitan runs it).")  # fmt: skip
    batch = max(1, round(Fraction(int(global_batch_tokens), model.seq)))  # exact: a float loses huge counts
    options = {"precision": precision, "optimizer": optimizer, "efficiency": efficiency, "overlap": overlap,
               "reserve": reserve, "attention": attention, "loss": loss}  # fmt: skip
    if not isinstance(exhaustive, bool):
        raise ValueError(f"plan(exhaustive={exhaustive!r}) is not a bool: give True to weigh every layout, or False "
                         f"(the default) to leave those that could not reach the first {TOP}.")  # fmt: skip
    verdicts, unweighed = search(model, cluster, batch, top=None if exhaustive else TOP, **options)
    fitting = sorted((c for c in verdicts if c.fits), key=lambda c: (-c.mfu, *simpler_first(c.layout, c.memory.total)))
    rejected = tuple(sorted((c for c in verdicts if not c.fits), key=lambda c: c.memory.total or float("inf")))
    if not fitting:
        raise ValueError(_nothing_fits(model, cluster, batch, rejected, **options))
    built = [unsupported(c.layout) is None for c in fitting]
    ranked = tuple(c for c, ok in zip(fitting, built, strict=True) if ok)
    unbuilt = tuple(c for c, ok in zip(fitting, built, strict=True) if not ok)
    return Plan(model, cluster, batch, precision, optimizer, efficiency, overlap, reserve, ranked, rejected, unweighed,
                unbuilt, attention, loss)  # fmt: skip


def _overlap_ok(overlap: object) -> bool:
    """Whether ``overlap`` is one :func:`.steptime.hidden_families` takes."""
    try:
        hidden_families(overlap)
    except ValueError:
        return False
    return True


def _is_share(efficiency: object) -> bool:
    """Whether ``efficiency`` is None (the roofline's) or a share of the peak in (0, 1]."""
    return efficiency is None or (is_number(efficiency) and 0 < efficiency <= 1)


def _model(model: object) -> ModelShape:
    """``model``, or the published shape it names (:data:`.model.MODELS`)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"plan({model!r}): no published model has that name. Choose one of {sorted(MODELS)}, "
                             "or describe it: pk.planner.ModelShape(layers=..., d_model=..., ...).")  # fmt: skip
        return MODELS[model]
    raise TypeError(f"plan(model={model!r}) is not a ModelShape: give pk.planner.ModelShape(...), "
                    f"ModelShape.from_gpt(gpt), or a published model's name, one of {sorted(MODELS)}.")  # fmt: skip


def _nothing_fits(model: ModelShape, cluster: Cluster, batch: int, rejected, **options) -> str:
    """What a user can change when no layout fits: by how much the closest misses, and what would fit."""
    said = f"{model.name or 'The model'} fits no layout of {cluster.name} with {batch} sequences a step"
    if not rejected:
        return (
            f"{said}: no split of {cluster.devices} devices divides the model and the batch. Try another device count."
        )
    closest = rejected[0]
    network = cluster.network or cluster.inside  # whether a layout fits is memory alone: any link will do here
    bigger = [replace(cluster, machines=cluster.machines * k, network=network) for k in (2, 4, 8, 16, 32, 64)]
    more = next((c.devices for c in bigger if _fits_on(model, c, batch, **options)), None)
    hint = f"{more} devices of the same kind would hold it" if more else "it needs over 64 times the devices"
    usable = (1 - options["reserve"]) * cluster.memory_bytes
    state = closest.memory.state
    if state > usable:
        why = f"its state alone, {state / 1e9:.1f} GB, is over it: only more devices (or less optimizer state) help"
    else:
        why = f"its state is {state / 1e9:.1f} GB, the rest activations and the loss: shorter sequences would help too"
    tried = "recomputation and accumulation down to one sequence a replica were already tried"
    return f"{said}. The closest {closest.rejected}; {why}. {hint}; {tried}."


def _fits_on(model: ModelShape, cluster: Cluster, batch: int, **options) -> bool:
    return any(weigh(model, each, cluster, batch, **options).fits for each in layouts(model, cluster.devices, batch))
