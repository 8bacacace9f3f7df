"""pk.Parallel: data, ZeRO, tensor, context and expert axes composed in one step, each product equal to one device.

The kit's GPT, dense and MoE (8 experts routed in 8 groups, so that an expert axis over all 8 devices routes the same
groups as one device), Adam, float32: every product of two and of three model axes on 8 simulated devices gives
SingleDevice's parameters (rtol 1e-5, atol 1e-6) after two steps, and each axis leaves its collective in the
compiled step.
"""

from __future__ import annotations

import jax
import optax
import pytest
from flax import nnx
from helpers import tree_allclose

import parallelkit as pk
from parallelkit.measure.inspect import collectives

LENGTH = 16
# Adam with eps = 1e-3, as in test_gpt: a tiny eps turns summation-order noise in a near-zero gradient into a
# full-size update, so equal training would not mean equal parameters.
ADAM = optax.adam(1e-3, eps=1e-3)

# Products of two and of three model axes on 8 devices (with data where the axes leave room for it).
DENSE = [
    dict(data=2, tensor=2, context=2),
    dict(data=2, tensor=2, context=2, sequence_parallel=True, context_method="allgather"),
    dict(data=2, zero=3, tensor=2, context=2, context_method="ulysses"),
    dict(data=2, zero=1, tensor=2, sequence_parallel=True, context=2, context_method="ring_zigzag"),
    dict(data=4, zero=2, tensor=2),
]
MOE = [
    dict(data=2, tensor=2, expert=2),
    dict(data=2, context=2, expert=2),
    dict(tensor=2, context=2, expert=2),
    dict(data=2, zero=3, context=2, expert=2),
    dict(data=2, zero=1, tensor=2, sequence_parallel=True, expert=2),
]


def _gpt(experts: int) -> pk.models.GPT:
    config = dict(max_length=LENGTH, dim=32, heads=4, depth=2, mlp_dim=64)
    if experts:
        config |= dict(experts=experts, groups=8, capacity_factor=1.0)
    return pk.models.GPT(256, **config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    corpus = pk.data.text(length=LENGTH, max_bytes=20_000)
    return list(pk.data.batches(corpus, 8, steps=2))


def _train(strategy, experts: int, batches: list[dict]):
    apply, params = pk.models.functional(_gpt(experts))
    loss_fn = pk.models.lm_loss(apply)
    state, step = strategy.init(params, ADAM), strategy.step(loss_fn)
    for batch in batches:
        state, _ = step(state, batch)
    return strategy.unreplicate(state.params), (step, state, batches[0])


@pytest.fixture(scope="module")
def single(batches) -> dict[int, object]:
    """SingleDevice's parameters after the same two steps, dense (0 experts) and MoE (8)."""
    return {experts: _train(pk.SingleDevice(), experts, batches)[0] for experts in (0, 8)}


def _marks(layout: dict, step, state, batch) -> None:
    """Each axis of ``layout`` leaves its collective in the compiled step."""
    found = {c.op for c in collectives(step, state, batch)}
    if layout.get("expert", 1) > 1 or layout.get("context_method") == "ulysses":
        assert "all-to-all" in found, found
    if layout.get("context", 1) > 1 and layout.get("context_method", "ring").startswith("ring"):
        assert "collective-permute" in found, found
    if layout.get("zero", 0) >= 1:
        assert "all-gather" in found, found
    assert "all-reduce" in found or "reduce-scatter" in found, found  # the gradients meet


# Each product without recomputation in every run; with selective and full recomputation in the slow runs.
RECOMPUTATIONS = ["none", *(pytest.param(name, marks=pytest.mark.slow) for name in ("selective", "full"))]


def _name(layout: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in layout.items())


@pytest.mark.parametrize("recompute", RECOMPUTATIONS)
@pytest.mark.parametrize("layout", DENSE, ids=_name)
def test_dense_products_equal_one_device(layout, recompute, batches, single):
    params, compiled = _train(pk.Parallel(**layout, recompute=recompute), 0, batches)
    tree_allclose(params, single[0])
    _marks(layout, *compiled)


@pytest.mark.parametrize("recompute", RECOMPUTATIONS)
@pytest.mark.parametrize("layout", MOE, ids=_name)
def test_moe_products_equal_one_device(layout, recompute, batches, single):
    params, compiled = _train(pk.Parallel(**layout, recompute=recompute), 8, batches)
    tree_allclose(params, single[8])
    _marks(layout, *compiled)


def test_recomputation_is_the_steps_own():
    """The step traces inside its recomputation: the lowered program holds the barriers jax.checkpoint leaves,
    and none without it."""
    apply, params = pk.models.functional(_gpt(0))
    batch = next(pk.data.batches(pk.data.text(length=LENGTH, max_bytes=20_000), 8, steps=1))
    texts = {}
    for recompute in ("none", "full"):
        strategy = pk.Parallel(data=2, tensor=2, context=2, recompute=recompute)
        step = strategy.step(pk.models.lm_loss(apply))
        texts[recompute] = step.lower(strategy.init(params, ADAM), batch).as_text()
    assert "optimization_barrier" not in texts["none"] and "optimization_barrier" in texts["full"]


def test_each_parameter_is_split_over_the_axes_its_logical_names_and_zero_give():
    apply, params = pk.models.functional(_gpt(8))
    strategy = pk.Parallel(data=2, zero=3, tensor=2, expert=2)
    specs = strategy.partition_specs(params)
    block = specs["blocks"][0]
    # heads over tensor, then ZeRO over data and expert on the largest free dimension
    assert block["query"]["kernel"] == jax.sharding.PartitionSpec(("data", "expert"), "model")
    # the experts over expert, their hidden units over tensor, ZeRO over data alone (expert splits them already)
    assert block["moe"]["w_in"] == jax.sharding.PartitionSpec("expert", "data", "model")
    assert strategy.num_replicas == 4  # the batch over data x expert


def test_one_axis_presets_are_its_spellings():
    """The presets build the same mesh and rules as Parallel with one axis, and are Parallel."""
    for preset, composed in (
        (pk.Hybrid(2, 4), pk.Parallel(data=2, tensor=4)),
        (pk.ContextParallel(4, "ulysses", 2), pk.Parallel(data=2, context=4, context_method="ulysses")),
        (pk.ExpertParallel(4, 2), pk.Parallel(data=2, expert=4)),
        (pk.FullySharded(2), pk.Parallel(data=8, zero=2)),
    ):
        assert isinstance(preset, pk.Parallel)
        assert dict(preset.mesh.shape) == dict(composed.mesh.shape)
        assert preset.axis_rules == composed.axis_rules


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(tensor=0), r"tensor=0\): an axis size must be a whole number"),
        (dict(zero=4), r"zero=4\): ZeRO stages are 0"),
        (dict(sequence_parallel=True), r"sequence_parallel=True, tensor=1\): sequence parallelism splits"),
        (dict(context=2, context_method="rings"), r"rings"),
        (dict(data=3, tensor=2), r"needs 6 devices, but 8 were given"),
        (dict(recompute="some"), r"some"),
    ],
)
def test_bad_axes_get_a_clear_error(kwargs, match):
    with pytest.raises((ValueError, pk.core.devices.DeviceCountError), match=match):
        pk.Parallel(**kwargs)


@pytest.mark.parametrize(
    ("stage_axes", "match"),
    [(dict(tensors=2), r"'tensors' is not one of them"), (dict(data=2), r"'data' is Pipeline's own data=")],
)
def test_a_stage_axis_the_stage_does_not_take_gets_a_clear_error(stage_axes, match):
    layers, _ = pk.models.as_layers(_gpt(0))
    with pytest.raises(ValueError, match=match):
        pk.Pipeline(layers, 2, 4, stage_axes=stage_axes)


def test_repr_names_the_axes_it_splits():
    assert repr(pk.Parallel(data=2, zero=3, tensor=2, context=2)) == (
        "Parallel(data=2, zero=3, tensor=2, context=2, context_method='ring')"
    )
    assert repr(pk.Parallel()) == "Parallel(data=8)"


# -- a pipeline whose stages are themselves SPMD --------------------------------------------------------------------

PIPELINES = [
    dict(schedule="1f1b", data=2, stage_axes=dict(tensor=2)),
    dict(schedule="zb-h1", data=2, stage_axes=dict(context=2, context_method="allgather")),
    dict(schedule="interleaved", virtual=2, data=2, stage_axes=dict(zero=3, tensor=2, sequence_parallel=True)),
    dict(schedule="gpipe", stage_axes=dict(tensor=2, context=2, context_method="ulysses")),
]


@pytest.mark.slow
@pytest.mark.parametrize("options", PIPELINES, ids=lambda o: f"{o['schedule']}-{sorted(o['stage_axes'])}")
def test_pipelines_of_spmd_stages_equal_one_device(options, batches):
    """Two stages, each tensor-, context- or ZeRO-split over its own devices, under every schedule."""
    gpt = _gpt(0)
    layers, params = pk.models.as_layers(gpt)
    single = pk.SingleDevice()
    state, step = single.init(params, ADAM), single.step(pk.pipeline.sequential_loss(layers, pk.models.cross_entropy))
    for batch in batches:
        state, _ = step(state, batch)
    pipeline = pk.Pipeline(layers, 2, 4, **options)
    assert pipeline.num_replicas == options.get("data", 1)
    placed, run = pipeline.init(params, ADAM), pipeline.step(pk.models.cross_entropy)
    for batch in batches:
        placed, _ = run(placed, batch)
    tree_allclose(pipeline.unreplicate(placed.params), single.unreplicate(state.params))
    query = placed.params[1]["query"]["kernel"]  # the first block's query kernel: split as its stage says
    run = next(k for k, layers in enumerate(pipeline.stage_layers) if 1 in layers)
    assert query.sharding.device_set == set(pipeline.stage_devices(run))
    if options["stage_axes"].get("tensor", 1) > 1:
        assert "model" in query.sharding.spec


@pytest.mark.slow
def test_four_axes_on_sixteen_devices_equal_one_device():
    """data 2 x tensor 2 x context 2 x stages 2: a pipeline of two stages, each a Parallel of 8 devices."""
    from helpers import run_python

    code = """
import jax, optax, numpy as np
from flax import nnx
gpt = pk.models.GPT(256, max_length=16, dim=32, heads=4, depth=2, mlp_dim=64, rngs=nnx.Rngs(0))
layers, params = pk.models.as_layers(gpt)
batches = list(pk.data.batches(pk.data.text(length=16, max_bytes=20_000), 8, steps=2))
adam = optax.adam(1e-3, eps=1e-3)
single = pk.SingleDevice()
state, step = single.init(params, adam), single.step(pk.pipeline.sequential_loss(layers, pk.models.cross_entropy))
layout = pk.planner.Layout(data=2, tensor=2, context=2, stages=2, microbatches=2, schedule="1f1b")
pipeline = layout.strategy(layers=layers)
placed, run = pipeline.init(params, adam), pipeline.step(pk.models.cross_entropy)
for batch in batches:
    state, _ = step(state, batch)
    placed, _ = run(placed, batch)
jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
             pipeline.unreplicate(placed.params), single.unreplicate(state.params))
print("equal", pipeline, len(pipeline.devices))
"""
    result = run_python(code, devices=16, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "equal Pipeline(stages=2, microbatches=2, schedule='1f1b', data=2, stage_axes=" in result.stdout
    assert result.stdout.strip().endswith(" 16")
