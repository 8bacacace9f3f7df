"""The bytes one pipeline step moves between the host and the stages' devices, measured beside their formulas."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...core.contract import tree_bytes
from ...core.reports import D2D, H2D, Flow, StepTraffic
from ...core.types import SEQ, Batch
from ...measure.inspect import Collective
from ...measure.traffic import bus_bytes
from .stages import HeadLoss
from .step import PipelineStep

if TYPE_CHECKING:
    from ...core.state import TrainState
    from .strategy import Pipeline


def pipeline_traffic(pipe: Pipeline, loss_fn: HeadLoss, state: TrainState, batch: Batch) -> StepTraffic:
    """:meth:`Pipeline.traffic <parallelkit.strategies.pipeline.Pipeline.traffic>`: one step's passes run, and the
    arrays handed to each stage's devices measured beside the formulas that method states."""
    step, params = PipelineStep(pipe, loss_fn), pipe.stage_params(state.params)
    microbatches = pipe.place_batch(batch)
    moved: Counter[tuple[str, int]] = Counter()
    for what, stage, _, nbytes in step.passes(params, microbatches)[2].moved:
        moved[what, stage] += nbytes
    m, d, last = pipe.microbatches, pipe.num_replicas, pipe.model_stages - 1
    outputs = step.output_shapes(params, microbatches[0])
    metric_bytes = tree_bytes(outputs[last])
    total = tree_bytes(batch)
    c = pipe.stage_meshes[0].shape.get(SEQ, 1)  # a stage's context axis splits the batch's tokens too
    ends = [(0, "batch, to stage 0")] + ([(last, f"batch, to stage {last} (labels)")] if last else [])
    share, formula = total / (d * c), "B/d" if c == 1 else "B/(d x c)"
    flows = [Flow(H2D, what, moved["batch", s], share, formula, "placed microbatches") for s, what in ends]
    for s in range(last):
        boundary = tree_bytes(outputs[s]) / d
        for what, to, arrow in (("activations", s + 1, f"{s} -> {s + 1}"), ("gradients", s, f"{s + 1} -> {s}")):
            flows.append(Flow(D2D, f"{what}, stage {arrow}", moved[what, to], m * boundary, f"m x A_{s}/d",
                              "arrays handed over"))  # fmt: skip
    found = step.stage_collectives(state, microbatches[0]) if d > 1 or pipe.stage_strategies else []
    flows += _collective_flows(found, m, metric_bytes, state, pipe)
    every_call = [c for _, kind, c in found for _ in range(_calls(kind, m))]
    return StepTraffic(repr(pipe), pipe.pattern, d, tree_bytes(state.params), metric_bytes, tuple(flows),
                       bus_bytes=bus_bytes(every_call))  # fmt: skip


def _calls(program: str, m: int) -> int:
    """How often a step calls a stage's program: the gradients' reduce once, every other once per microbatch."""
    return 1 if program == "reduce" else m


def _collective_flows(
    found: Sequence[tuple[int, str, Collective]], m: int, metric_bytes: int, state: TrainState, pipe: Pipeline
) -> list[Flow]:
    """The stages' collectives as flows, each counted as often as its program runs a step (:func:`_calls`):
    each stage's one gradient all-reduce, the last stage's metrics', and any other. Where the stages are
    SPMD over more than data (``stage_axes``), each program's collectives as they are, without a formula: XLA
    places their activations' and gradients' collectives inside each microbatch's passes."""
    stage_params, last = pipe.stage_params(state.params), pipe.model_stages - 1
    totals: dict[tuple[int, str, str], int] = {}
    for s, kind, c in found:
        totals[s, kind, c.op] = totals.get((s, kind, c.op), 0) + _calls(kind, m) * c.bytes
    if pipe.stage_strategies:
        return [Flow(D2D, f"stage {s} {kind} ({op})", measured, None, "-", f"compiled HLO, x {_calls(kind, m)} calls")
                for (s, kind, op), measured in totals.items()]  # fmt: skip
    flows = []
    for s in range(pipe.model_stages if found else 0):
        measured = totals.pop((s, "reduce", "all-reduce"), 0)
        flows.append(Flow(D2D, f"gradients of stage {s} (all-reduce)", measured, tree_bytes(stage_params[s]),
                          f"P_{s}", "compiled HLO, once a step"))  # fmt: skip
    if found:
        measured = totals.pop((last, "forward", "all-reduce"), 0)
        flows.append(Flow(D2D, f"loss and metrics, stage {last} (all-reduce)", measured, m * metric_bytes, "m x M",
                          "compiled HLO, x m calls"))  # fmt: skip
    for (s, kind, op), measured in totals.items():
        flows.append(Flow(D2D, f"other collectives, stage {s} {kind} ({op})", measured, 0, "0", "compiled HLO"))
    return flows
