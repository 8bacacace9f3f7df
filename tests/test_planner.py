"""The planner: step times by hand, the ranking, its errors, and every layout it can run built and trained one step."""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest
from flax import nnx
from helpers import tree_allclose

import parallelkit as pk
from parallelkit.measure.costmodel import Cluster as Links
from parallelkit.measure.costmodel import Link, axis_groups, axis_seconds, ring_rounds
from parallelkit.planner import MODELS, Cluster, Layout, ModelShape, check, plan, step_time, unsupported
from parallelkit.planner.search import layouts

FAST, SLOW = Link("fast", 100, 2, "by hand"), Link("slow", 10, 20, "by hand")


def _cluster(machines: int = 1, per: int = 8, **kw) -> Cluster:
    figures = {"bf16_flops": 1e15, "fp32_flops": 5e14, "memory_bytes": 80e9} | kw
    return Cluster(machines, per, FAST, SLOW if machines > 1 else None, **figures, chip="test")


@pytest.mark.parametrize(
    ("machines", "per", "size", "stride"), [(1, 8, 8, 1), (2, 4, 4, 2), (2, 4, 2, 4), (4, 2, 4, 2)]
)
def test_an_axis_collective_is_its_rings_rounds_timed_one_by_one(machines, per, size, stride):
    cluster = Links(machines, per, FAST, SLOW)
    rings = axis_groups(machines * per, size, stride)
    by_rounds = sum(cluster.round_seconds(r) for r in ring_rounds(rings, 3e6))
    assert axis_seconds(cluster, size, stride, 3e6, "all-reduce") == pytest.approx(by_rounds, rel=1e-12)


def test_tensor_parallel_all_reduces_by_hand():
    model = ModelShape(layers=4, d_model=1024, heads=8, ffn=4096, vocab=1000, seq=512)
    layout, batch = Layout(data=2, tensor=4), 8
    t = step_time(model, layout, _cluster(), batch)
    activation = (batch // 2) * 512 * 1024 * 2  # a replica's 4 sequences, bf16
    one = 2 * 3 * (2e-6 + activation / 4 / 100e9)  # a ring over 4 neighbours: 6 rounds of a quarter
    loss = 2 * 3 * (2e-6 + (batch // 2) * 512 * 4 / 4 / 100e9)  # a float a token: the loss's 3 all-reduces
    ends = 2 * one + 3 * loss  # the embedding's output and the output layer's input, no pipeline: same device
    assert t.communication["tensor"] == pytest.approx(4 * 4 * one + ends)  # 4 layers x (2 forward + 2 backward)


def test_the_bubble_and_what_binds():
    model = ModelShape(layers=8, d_model=4096, heads=32, ffn=16384, vocab=100, seq=2048)
    t = step_time(model, Layout(stages=8, microbatches=8), _cluster(), 64)
    assert t.bubble == pytest.approx(t.compute * 7 / 8) and t.binding == "compute"
    slow = step_time(model, Layout(stages=8, microbatches=1), _cluster(), 64)
    assert slow.binding == "bubble"


def test_zero_3_gathers_each_microbatch_and_full_overlap_hides_the_gradients():
    model = MODELS["gpt2-xl"]
    cluster = _cluster()  # no memory bandwidth: at half the peak (the one-number model) compute outlasts the gradients
    zero1 = step_time(model, Layout(data=8, zero=1, microbatches=4), cluster, 32, efficiency=0.5)
    zero3 = step_time(model, Layout(data=8, zero=3, microbatches=4), cluster, 32, efficiency=0.5)
    ring = 2 * 7 * (2e-6 + model.params * 2 / 8 / 100e9)  # one all-reduce of the bf16 gradients
    # ZeRO-1 keeps whole gradients: an all-reduce, then the all-gather of the updated shards (half a ring)
    assert zero1.communication["gradients"] == pytest.approx(1.5 * ring)
    assert zero3.communication["gradients"] == pytest.approx(3 * 4 * ring / 2)  # 3 gathers of half a ring each
    hidden = step_time(model, Layout(data=8, zero=1, microbatches=4), cluster, 32, overlap="full", efficiency=0.5)
    # the collectives hide behind the last microbatch's backward and weight passes (2/3 of its quarter of the
    # compute, the one-number model's even passes), the last layer's share always exposed
    exposed = max(1.5 * ring - hidden.compute * 2 / 3 / 4, 1.5 * ring / model.layers)
    assert hidden.exposed_gradients == pytest.approx(exposed) and hidden.total < zero1.total


def test_a_tensor_group_across_machines_is_slower_than_inside_one():
    model = MODELS["llama3-8b"]
    inside = step_time(model, Layout(data=2, tensor=8), _cluster(2, 8), 4).communication["tensor"]
    across = step_time(model, Layout(data=8, tensor=2), _cluster(2, 8), 16).communication["tensor"]
    spread = step_time(model, Layout(data=1, tensor=16), _cluster(2, 8), 4).communication["tensor"]
    assert inside < spread and across < spread


def test_a_plan_ranks_by_mfu_within_memory_and_says_why():
    p = plan(MODELS["llama3-8b"], Cluster.published("H100 SXM", per_node=8), global_batch_tokens=1_048_576)
    mfus = [c.mfu for c in p.ranked]
    assert mfus == sorted(mfus, reverse=True) and p.best == p.ranked[0].layout
    budget = 0.9 * 80e9
    assert all(c.memory.total <= budget for c in p.ranked) and p.rejected
    assert all(c.memory.total > budget or "does not" in c.rejected for c in p.rejected)
    for c in p.ranked[:20]:
        expected = MODELS["llama3-8b"].flops_per_token() * c.batch * 8192 / (c.time.total * 8 * 989.5e12)
        assert c.mfu == pytest.approx(expected)
    assert p.best.name in p.table(3) and "(3 layouts" not in p.table(3)  # the footer counts all, not the rows shown
    assert "rank 1 of" in p.explain(p.best) and "activations" in p.explain(p.best)
    closest = p.rejected[0].layout  # asked for without the recomputation and accumulation the planner tried
    plain = dataclasses.replace(
        closest, recompute="none", microbatches=1 if closest.stages == 1 else closest.microbatches
    )
    assert "rejected: needs" in p.explain(plain)


def test_every_kind_of_axis_is_weighed():
    moe = ModelShape(layers=8, d_model=512, heads=8, ffn=1024, vocab=1000, seq=1024, experts=8, top_k=2)
    seen = list(layouts(moe, 8, 64))
    for axis in ("data", "tensor", "context", "stages", "expert"):
        assert any(getattr(layout, axis) == 8 for layout in seen), axis
    assert {layout.zero for layout in seen} == {0, 1, 2, 3}
    assert {layout.context_method for layout in seen if layout.context > 1} == {"allgather", "ring", "ulysses"}
    assert {layout.schedule for layout in seen if layout.stages > 1} == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert any(layout.sequence_parallel for layout in seen)


def test_a_model_that_fits_nowhere_says_by_how_much_and_what_would_fit():
    with pytest.raises(ValueError, match=r"fits no layout of 8 H100 SXM.*GB over the 72.0 GB usable.*devices of the "
                                         r"same kind would hold it"):  # fmt: skip
        plan(
            ModelShape(80, 16384, 128, 53248, 128256, 8192, kv_heads=8),
            Cluster.published("H100 SXM", 8),
            global_batch_tokens=8192 * 8,
        )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"global_batch_tokens": 1.5e6}, r"global_batch_tokens=1500000.0\): the tokens a step, a whole number"),
        ({"global_batch_tokens": 0}, r"global_batch_tokens=0\)"),
        ({"reserve": 1.2}, r"reserve=1.2\): the share of memory kept back"),
        ({"efficiency": 1.5}, r"efficiency in \(0, 1\]"),
        ({"overlap": "partial"}, r"overlap one of \('none', 'full'\)"),
        ({"precision": "bf8"}, r"precision and optimizer one of"),
    ],
)
def test_a_plan_with_a_bad_option_names_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        plan(MODELS["gpt2-xl"], Cluster.published("H100 SXM", per_node=8), **({"global_batch_tokens": 2**20} | options))


def test_published_and_measured_clusters():
    two = Cluster.published("A100 SXM 80GB", per_node=8, nodes=2)
    assert (two.devices, two.inside.GBps, two.network.GBps, two.peak_flops("bf16")) == (16, 300.0, 200.0, 312e12)
    here = Cluster.measured(jax.devices())
    assert here.devices == 8 and here.inside.GBps > 0 and here.peak_flops("fp32") > 0
    with pytest.raises(ValueError, match="choose one of"):
        Cluster.published("H200")


def test_the_kits_gpt_shape_counts_its_parameters():
    gpt = pk.models.GPT(256, max_length=16, dim=16, heads=4, depth=2, mlp_dim=32, rngs=nnx.Rngs(0))
    _, params = pk.models.functional(gpt)
    assert ModelShape.from_gpt(gpt).params == sum(leaf.size for leaf in jax.tree.leaves(params))


# --- every layout the kit can run, built and trained one step ---------------------------------------------------

LENGTH, BATCH = 16, 16
SMALL = {"max_length": LENGTH, "dim": 16, "heads": 4, "depth": 2, "mlp_dim": 32}


def _kinds(layout: Layout) -> list[tuple]:
    """What a layout exercises: with a pipeline, its schedule and whether its stages split over more than data;
    without, which axes split with which ZeRO stage and accumulation, its context method, sequence parallelism."""
    if layout.stages > 1:
        return [("pipeline", layout.schedule, layout.devices > layout.stages * layout.data or layout.zero > 0)]
    axes = tuple(getattr(layout, axis) > 1 for axis in ("data", "tensor", "context", "expert"))
    method = layout.context_method if layout.context > 1 else None
    return [(*axes, layout.zero, layout.accumulate > 1), ("method", method), ("sp", layout.sequence_parallel)]


def _runnable() -> list[Layout]:
    """Layouts of 8 devices the planner ranks and the kit can run, one for each new kind (:func:`_kinds`)."""
    shape = ModelShape.from_gpt(pk.models.GPT(256, **SMALL, rngs=nnx.Rngs(0)))
    found, seen = [], set()
    for layout in layouts(shape, 8, BATCH):
        for accumulate in (1, 2) if layout.stages == 1 else (layout.microbatches,):
            variant = dataclasses.replace(layout, microbatches=accumulate)
            kinds = _kinds(variant)
            if not seen.issuperset(kinds) and unsupported(variant) is None and check(shape, variant, BATCH) is None:
                found.append(variant)
                seen.update(kinds)
    return found


@pytest.fixture(scope="module")
def corpus():
    return pk.data.text(length=LENGTH, max_bytes=20_000)


@pytest.mark.slow
def test_a_layout_of_every_kind_the_kit_can_run_builds_and_trains_one_step_as_one_device(corpus):
    """One SGD step of a runnable layout of 8 devices of every kind, from one start, equals SingleDevice's (float32
    tolerance). Every product of the axes composes now (hundreds of layouts of 8 devices); one of each kind keeps
    the test's time bounded, and tests/test_parallel.py proves the products themselves."""
    gpt = pk.models.GPT(256, **SMALL, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(gpt)
    layers, layer_params = pk.models.as_layers(gpt)
    batch = next(pk.data.batches(corpus, BATCH, steps=1))
    optimizer = optax.sgd(0.1)
    single = pk.SingleDevice()
    reference, _ = single.step(pk.models.lm_loss(apply))(single.init(params, optimizer), batch)
    runnable = _runnable()
    kinds = {(lay.stages > 1, lay.context > 1, lay.tensor > 1, lay.zero, lay.accumulate > 1) for lay in runnable}
    assert len(runnable) >= 25 and len(kinds) >= 10
    for layout in runnable:
        strategy = layout.strategy(layers=layers)
        if layout.stages > 1:
            state = strategy.init(layer_params, optimizer)
            state, _ = strategy.step(pk.models.cross_entropy)(state, batch)
            got = strategy.unreplicate(state.params)
            want = pk.models.as_layers(_with(gpt, single.unreplicate(reference.params))).params
        else:
            state = strategy.init(params, optimizer)
            state, _ = strategy.step(pk.models.lm_loss(apply), accumulate=layout.accumulate)(state, batch)
            got, want = strategy.unreplicate(state.params), single.unreplicate(reference.params)
        tree_allclose(got, want, err_msg=layout.name)


def _with(gpt: pk.models.GPT, params: dict) -> pk.models.GPT:
    """``gpt`` with ``params`` (a functional tree) put into it."""
    graphdef, _ = nnx.split(gpt)
    return nnx.merge(graphdef, nnx.State(params))


def test_layouts_the_kit_cannot_run_say_why():
    assert unsupported(Layout(context=2, tensor=2, data=2)) is None  # composed: pk.Parallel
    assert unsupported(Layout(data=2, tensor=4, zero=2)) is None
    assert unsupported(Layout(data=8, recompute="full")) is None  # pk.Parallel(recompute="full")
    assert unsupported(Layout(stages=2, tensor=2, data=2)) is None  # each stage a Parallel over its devices
    assert "not a list of layers" in unsupported(Layout(stages=2, expert=2, data=2))
    assert unsupported(Layout(expert=2, data=2, microbatches=2)) is None  # accumulation beside an expert axis
    with pytest.raises(ValueError, match="pass layers="):
        Layout(data=4, stages=2, microbatches=2).strategy()
    with pytest.raises(ValueError, match="needs 16 devices; JAX has 8"):
        Layout(data=16).strategy()


def test_a_batch_that_does_not_split_is_rounded_down_to_the_replicas():
    p = plan(MODELS["gpt2-xl"], Cluster.published("H100 SXM", per_node=3), global_batch_tokens=8 * 1024)
    data3 = p.find(Layout(data=3))
    assert p.batch == 8 and data3.batch == 6 and data3.fits


def test_explain_weighs_a_layout_the_plan_did_not_choose():
    p = plan(MODELS["llama3-8b"], Cluster.published("H100 SXM", per_node=8), global_batch_tokens=1_048_576)
    said = p.explain(Layout(data=2, tensor=4, sequence_parallel=True, zero=1, microbatches=64, recompute="full"))
    assert "would rank" in said and "for the layer being rebuilt" in said
    with pytest.raises(ValueError, match="uses 16 devices; this plan is for 8"):
        p.explain(Layout(data=16))


def test_the_plan_ranks_only_what_the_kit_builds_and_the_rest_apart():
    """Every layout plan() ranks for the kit's GPT on 1 to 16 devices is one the kit builds; a MoE model's pipelines,
    which the kit cannot build, fit but are ranked apart (plan.unbuilt), each with the reason, never first."""
    for devices in (1, 2, 4, 8, 16):
        shape = ModelShape.from_gpt(pk.models.GPT(256, **SMALL, rngs=nnx.Rngs(0)))
        cluster = Cluster.published("H100 SXM", per_node=devices)
        answer = plan(shape, cluster, global_batch_tokens=BATCH * LENGTH, precision="fp32", exhaustive=True)
        assert all(unsupported(c.layout) is None for c in answer.ranked)
        assert not answer.unbuilt
    moe = dataclasses.replace(MODELS["llama3-8b"], experts=8, top_k=2, name="MoE")
    answer = plan(moe, Cluster.published("H100 SXM", per_node=8, nodes=8), global_batch_tokens=4 * 2**20)
    assert answer.unbuilt and all(c.layout.stages > 1 and c.layout.expert > 1 for c in answer.unbuilt)
    assert all(unsupported(c.layout) is None for c in answer.ranked)
    assert "the kit cannot build" in answer.table() and "not a list of layers" in answer.table()
