"""The planner's inputs: each bad one is an error naming the argument, the value and the fix; any batch answers."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import parallelkit as pk
from parallelkit.planner import MODELS, Cluster, Layout, ModelShape, plan, state_bytes
from parallelkit.planner.search import RESERVE, assess, divisors, layouts, weigh

SHAPE = {"layers": 2, "d_model": 64, "heads": 4, "ffn": 256, "vocab": 100, "seq": 16}
H100 = Cluster.published("H100 SXM", per_node=8)
OPTIONS = {"precision": "bf16", "optimizer": "adam", "efficiency": 0.5, "overlap": "none", "reserve": RESERVE}


@pytest.fixture(scope="module")
def gpt2_plan():
    return plan(MODELS["gpt2-xl"], H100, global_batch_tokens=2**20)


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ({"kv_heads": -2}, r"ModelShape\(kv_heads=-2\) is not a number of heads: give a whole number >= 1"),
        ({"kv_heads": 2.0}, r"ModelShape\(kv_heads=2.0\) is not a number of heads"),
        ({"kv_heads": 0}, r"ModelShape\(kv_heads=0\) is not a number of heads"),  # was a ZeroDivisionError
        ({"experts": 2.5}, r"ModelShape\(experts=2.5\) is not a number of experts: .* or 0 for a dense model"),
        ({"experts": True}, r"ModelShape\(experts=True\) is not a number of experts"),
        ({"experts": -4}, r"ModelShape\(experts=-4\) is not a number of experts"),  # blamed top_k
        ({"experts": 4, "top_k": 1.5}, r"ModelShape\(top_k=1.5\) is not a number of experts"),
        ({"experts": 4, "top_k": 5}, r"ModelShape\(top_k=5\) routes each token to more experts than the 4"),
        ({"gated": "no"}, r"ModelShape\(gated='no'\) is not a bool: give True or False"),
        ({"dropout": 1}, r"ModelShape\(dropout=1\) is not a bool"),
    ],
)
def test_a_bad_shape_names_the_argument_and_the_fix(shape, match):
    with pytest.raises(ValueError, match=match):
        ModelShape(**SHAPE | shape)


def test_top_k_on_a_dense_model_warns_that_it_is_unused():
    with pytest.warns(UserWarning, match=r"ModelShape\(top_k=2\) with experts=0: .* top_k is unused"):
        dense = ModelShape(**SHAPE, top_k=2)
    assert dense.active_params == dense.params  # counted as dense, as the warning says


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Cluster.published("H100 SXM", nodes=True), r"Cluster.published\(nodes=True\) is not a count"),
        (lambda: Cluster.published("H100 SXM", per_node=0), r"Cluster.published\(per_node=0\) is not a count"),
        (lambda: Cluster.published("H100 SXM", per_node=8.0), r"Cluster.published\(per_node=8.0\)"),
        (lambda: dataclasses.replace(H100, machines=True), r"Cluster\(machines=True\) is not a count"),
        (lambda: dataclasses.replace(H100, memory_bytes="80e9"), r"Cluster\(memory_bytes='80e9'\) is not a finite"),
        (lambda: dataclasses.replace(H100, bf16_flops=float("inf")), r"Cluster\(bf16_flops=inf\) is not a finite"),
    ],
)
def test_a_bad_cluster_names_the_argument_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_numpy_integers_count_machines_and_devices():
    two = Cluster.published("H100 SXM", per_node=np.int64(8), nodes=np.int32(2))
    assert two == Cluster.published("H100 SXM", per_node=8, nodes=2)
    assert type(two.machines) is int and type(two.devices_per_machine) is int
    direct = dataclasses.replace(two, machines=np.int64(4))
    assert direct.devices == 32 and type(direct.machines) is int


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Layout(data=2, zero=True), r"Layout\(zero=True\) is not a ZeRO stage: give 0 \(none\), 1"),
        (lambda: Layout(data=2, zero=1.0), r"Layout\(zero=1.0\) is not a ZeRO stage"),
        (lambda: Layout(data=2, zero=4), r"Layout\(zero=4\) is not a ZeRO stage"),
        (lambda: Layout(tensor=2, sequence_parallel="yes"), r"Layout\(sequence_parallel='yes'\) is not a bool"),
        (lambda: Layout(schedule="zb"), r"Layout\(schedule='zb'\): one of"),
        (lambda: Layout(recompute="some"), r"Layout\(recompute='some'\): one of"),
        (lambda: state_bytes(1e9, data=2, zero=True), r"zero=True must be 0, 1, 2 or 3"),
        (lambda: state_bytes(1e9, data=2.5, zero=1), r"data=2.5 a whole number >= 1"),
    ],
)
def test_a_bad_layout_names_the_argument_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_assess_refuses_a_layout_for_another_device_count(gpt2_plan):
    with pytest.raises(ValueError, match=r"data 4 uses 4 devices; this plan is for 8\. Give a layout whose axes"):
        gpt2_plan.assess(Layout(data=4))  # it answered with a memory rejection, as if 4 devices existed
    assert gpt2_plan.assess(gpt2_plan.best).fits


@pytest.mark.parametrize("method", ["find", "assess", "explain"])
def test_a_plan_refuses_what_is_not_a_layout(gpt2_plan, method):
    with pytest.raises(TypeError, match=r"layout='data 8' is not a Layout: .* such as Layout\(data=2, tensor=4\)"):
        getattr(gpt2_plan, method)("data 8")


def test_plan_looks_a_published_model_up_by_name(gpt2_plan):
    by_name = plan("gpt2-xl", H100, global_batch_tokens=2**20)
    assert by_name.model is MODELS["gpt2-xl"] and by_name.ranked == gpt2_plan.ranked


@pytest.mark.parametrize(
    ("model", "cluster", "error", "match"),
    [
        ("gpt-5", H100, ValueError, r"plan\('gpt-5'\): no published model has that name\. Choose one of \["),
        (None, H100, TypeError, r"plan\(model=None\) is not a ModelShape: give pk.planner.ModelShape"),
        (MODELS["gpt2-xl"], "H100 SXM", TypeError, r"plan\(cluster='H100 SXM'\) is not a planner Cluster"),
    ],
)
def test_plan_refuses_a_model_or_cluster_it_cannot_read(model, cluster, error, match):
    with pytest.raises(error, match=match):
        plan(model, cluster, global_batch_tokens=2**20)


def test_a_strategy_refuses_devices_that_are_not_the_layouts():
    with pytest.raises(ValueError, match=r"data 4 runs on 4 devices, but devices holds 8\. Pass exactly 4"):
        Layout(data=4).strategy(devices=jax.devices())  # it built a Mirrored over all 8
    for devices in (jax.devices()[:4], 4):  # as many devices as the layout's axes multiply to, or that count
        assert list(Layout(data=4).strategy(devices=devices).mesh.devices.flat) == jax.devices()[:4]


@pytest.mark.timeout(60)
def test_a_huge_batch_answers():
    answer = plan(MODELS["gpt2-xl"], H100, global_batch_tokens=10**15)  # scanned 1..n for every layout: a hang
    assert answer.batch == 10**15 // 1024 and answer.ranked and answer.best.accumulate > 1


def test_divisors_are_every_divisor_in_order():
    for n in [*range(1, 200), 2**20, 2**5 * 3**4 * 7 * 101]:
        assert list(divisors(n)) == [d for d in range(1, n + 1) if n % d == 0], n
    assert len(divisors(10**15)) == 16 * 16  # 2^15 x 5^15
    assert divisors(10**12 + 39) == (1, 10**12 + 39)  # a prime: trial division up to its square root


def _by_trying_everything(model: ModelShape, layout: Layout, batch: int) -> pk.planner.Candidate:
    """Every recomputation with every accumulation count (a pipeline's microbatch counts from the layout's up): the
    fastest variant that fits (ties to less recomputation, then fewer steps), else the one that needs the least
    memory."""
    per_replica = batch // layout.replicas
    counts = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
    if layout.stages > 1:
        counts = [m for m in counts if m >= layout.microbatches and (layout.virtual == 1 or m % layout.stages == 0)]
    tried = [
        assess(model, dataclasses.replace(layout, recompute=r, microbatches=m), H100, batch, **OPTIONS)
        for r in ("none", "selective", "full")
        for m in counts
    ]
    if fitting := [c for c in tried if c.fits]:
        return max(fitting, key=lambda c: c.mfu)
    return min([c for c in tried if c.memory.total] or tried, key=lambda c: c.memory.total)


@pytest.mark.parametrize("name", ["gpt2-xl", "llama3-8b"])
def test_the_search_picks_what_trying_every_variant_picks(name):
    model, batch = MODELS[name], 720  # 30 accumulation counts for one replica: the bisection has work
    for layout in layouts(model, 8, batch):
        want, got = _by_trying_everything(model, layout, batch), weigh(model, layout, H100, batch, **OPTIONS)
        assert want == got if want.fits else (got.layout, got.memory, got.fits) == (want.layout, want.memory, False)


def test_the_kits_gpt_with_a_numpy_dropout_rate_reads_as_a_shape():
    gpt = pk.models.GPT(
        256, max_length=16, dim=16, heads=4, depth=2, mlp_dim=32, dropout=np.float32(0.1), rngs=nnx.Rngs(0)
    )
    assert ModelShape.from_gpt(gpt).dropout is True  # a NumPy bool is not a flag ModelShape takes


def test_the_cost_models_cluster_takes_numpy_counts_and_refuses_bools():
    from parallelkit.measure.costmodel import PRESETS
    from parallelkit.measure.costmodel import Cluster as LinkCluster

    cluster = LinkCluster(np.int64(2), np.int32(4), PRESETS["nvlink4"], PRESETS["25gbe"])
    assert (cluster.machines, cluster.devices_per_machine) == (2, 4)
    assert type(cluster.machines) is int
    with pytest.raises(ValueError, match="machines=True"):
        LinkCluster(True, 4, PRESETS["nvlink4"])
