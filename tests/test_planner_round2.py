"""The planner, round 2: a search that answers fast for any cluster and batch, and keeps the first choices."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parallelkit.measure.costmodel.links import axis_groups, shifted_round
from parallelkit.planner import MODELS, Cluster, Layout, ModelShape, check, layer_activation_bytes, plan, step_time
from parallelkit.planner.kernels import ACHIEVABLE, matmul_seconds
from parallelkit.planner.layout import activations
from parallelkit.planner.memory import weight_pass_bytes

H100 = Cluster.published("H100 SXM", per_node=8)
SMALL = ModelShape(8, 1024, 16, 4096, 32000, 2048, kv_heads=4, dropout=False, name="small")
MOE = ModelShape(4, 512, 8, 1024, 32000, 1024, experts=8, top_k=2, dropout=False, name="moe")


def every_message(cluster: Cluster, size: int, stride: int, shift: int) -> tuple[bool, int]:
    """:func:`shifted_round`'s answer by sending every message of every group, one by one."""
    inside, leaving, entering = False, {}, {}
    for group in axis_groups(cluster.devices, size, stride):
        for j, source in enumerate(group):
            a, b = cluster.machine(source), cluster.machine(group[(j + shift) % size])
            inside |= a == b
            if a != b:
                leaving[a], entering[b] = leaving.get(a, 0) + 1, entering.get(b, 0) + 1
    return inside, max([*leaving.values(), *entering.values()], default=0)


@pytest.mark.parametrize(("per_node", "nodes"), [(8, 12), (4, 6), (6, 4), (3, 10)])
def test_one_period_of_the_devices_counts_as_all_of_them(per_node, nodes):
    cluster = Cluster.published("H100 SXM", per_node=per_node, nodes=nodes)
    n = cluster.devices
    axes = [
        (size, stride) for size in range(2, n + 1) for stride in range(1, n // size + 1) if n % (size * stride) == 0
    ]
    for size, stride in axes:
        for shift in range(1, size):
            assert shifted_round(cluster, size, stride, shift) == every_message(cluster, size, stride, shift)


@pytest.mark.parametrize(
    ("model", "cluster", "tokens", "overlap"),
    [
        (SMALL, H100, 64 * 2048, "none"),
        (SMALL, Cluster.published("H100 SXM", per_node=8, nodes=2), 32 * 2048, "full"),
        (SMALL, Cluster.published("A100 SXM 80GB", per_node=4, nodes=4), 128 * 2048, "none"),
        (MOE, H100, 64 * 1024, "none"),
        (MODELS["gpt2-xl"], Cluster.published("H100 SXM", per_node=8, nodes=2), 2**20, "none"),
    ],
)
def test_the_pruned_search_ranks_first_what_the_whole_search_does(model, cluster, tokens, overlap):
    whole = plan(model, cluster, global_batch_tokens=tokens, overlap=overlap, exhaustive=True)
    pruned = plan(model, cluster, global_batch_tokens=tokens, overlap=overlap)
    assert whole.unweighed == 0 and pruned.unweighed > 0  # it left some: the comparison says something
    assert pruned.best == whole.best
    assert [c.layout for c in pruned.ranked[:10]] == [c.layout for c in whole.ranked[:10]]
    assert [c.mfu for c in pruned.ranked[:10]] == [c.mfu for c in whole.ranked[:10]]
    assert f"{pruned.unweighed} could not reach the first 10, not weighed" in pruned.table(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tokens", [10**15, 10**15 + 8192 * 7919])  # the second's sequences have a large prime
def test_a_huge_batch_on_a_thousand_devices_answers(tokens):
    cluster = Cluster.published("H100 SXM", per_node=8, nodes=128)
    answer = plan(MODELS["llama3-70b"], cluster, global_batch_tokens=tokens)
    assert answer.batch == round(tokens / 8192) and answer.ranked[0].fits


@pytest.mark.timeout(120)
def test_a_hundred_thousand_devices_answer():
    cluster = Cluster.published("H100 SXM", per_node=8, nodes=12_500)
    answer = plan(MODELS["llama3-70b"], cluster, global_batch_tokens=2**26)
    assert answer.best.devices == 100_000 and answer.unweighed > 0


def test_exhaustive_that_is_not_a_bool_names_the_argument():
    with pytest.raises(ValueError, match=r"plan\(exhaustive='yes'\) is not a bool: give True to weigh every"):
        plan(SMALL, H100, global_batch_tokens=2**16, exhaustive="yes")


# Schedules as the field runs them: interleaved 1F1B, every microbatch count, ZB-H1 at its price.

DEEP = ModelShape(16, 1024, 16, 4096, 32000, 2048, kv_heads=4, dropout=False, name="deep")
INTERLEAVED = Layout(data=2, stages=4, schedule="interleaved", virtual=2, microbatches=8)


def test_an_interleaved_layout_names_its_chunks():
    assert INTERLEAVED.name == "data 2 x stages 4, interleaved v=2 m=8"


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"virtual": 2}, r"Layout\(schedule='1f1b', virtual=2\): virtual chunks a stage are interleaved 1F1B's"),
        ({"schedule": "interleaved"}, r"Layout\(schedule='interleaved', virtual=1\): .* give schedule='interleaved'"),
        ({"virtual": 0}, r"Layout\(virtual=0\): a whole number >= 1"),
    ],
)
def test_virtual_without_interleaving_is_an_error(changes, match):
    with pytest.raises(ValueError, match=match):
        Layout(stages=4, microbatches=8, **changes)


def test_interleaved_needs_equal_chunks_and_whole_rounds_of_microbatches():
    assert "equal chunks" in check(DEEP, Layout(stages=4, schedule="interleaved", virtual=3, microbatches=8), 8)
    assert "a multiple of the 4 stages" in check(
        DEEP, Layout(stages=4, schedule="interleaved", virtual=2, microbatches=6), 6
    )
    assert check(DEEP, Layout(stages=4, schedule="interleaved", virtual=4, microbatches=8), 8) is None


def test_interleaving_divides_the_bubble_by_the_chunks_and_multiplies_the_sends():
    cluster = Cluster.published("H100 SXM", per_node=8)
    plain = step_time(DEEP, replace(INTERLEAVED, schedule="1f1b", virtual=1), cluster, 64)
    woven = step_time(DEEP, INTERLEAVED, cluster, 64)
    assert plain.bubble == pytest.approx(plain.compute * 3 / 8, rel=1e-12)  # (stages - 1) / m
    assert woven.bubble == pytest.approx(woven.compute * 3 / 16, rel=1e-12)  # (stages - 1) / (v m)
    sends = woven.communication["pipeline"] / plain.communication["pipeline"]
    assert sends == pytest.approx((2 * 8 + 3) / (8 + 3), rel=1e-12)  # 2 (v m + s - 1) against 2 (m + s - 1)


def test_interleaving_holds_megatrons_warm_up_on_the_first_stage():
    act = activations(DEEP, INTERLEAVED, 64)
    per_layer = layer_activation_bytes(DEEP, 4)  # 64 sequences over 2 replicas x 8 microbatches
    # Korthikanti et al. (2022): the first stage holds (1 + (p - 1) / (p m)) times 1F1B's p microbatches
    assert act.total == pytest.approx(4 * 4 * (1 + 3 / (4 * 2)) * per_layer, rel=1e-12)
    plain = activations(DEEP, replace(INTERLEAVED, schedule="1f1b", virtual=1), 64)
    assert act.total > plain.total


def test_every_microbatch_count_from_the_stages_up_is_weighed():
    model = ModelShape(12, 512, 8, 2048, 32000, 1024, dropout=False)  # BLOOM's 12 stages, on a small scale
    cluster = Cluster.published("H100 SXM", per_node=12)
    answer = plan(model, cluster, global_batch_tokens=16 * 1024, exhaustive=True)
    pipelines = [c.layout for c in answer.ranked if c.layout.stages == 12]
    assert pipelines and all(layout.microbatches == 16 for layout in pipelines)  # 16 is not 12 x 1, 2, 4 or 8


def test_zb_h1_pays_for_the_weight_passes_it_defers():
    layout = Layout(data=2, stages=4, microbatches=8)
    one_f_one_b = activations(DEEP, layout, 64)
    zb = activations(DEEP, replace(layout, schedule="zb-h1"), 64)
    per_layer = layer_activation_bytes(DEEP, 4)
    deferred = weight_pass_bytes(DEEP, 4)
    assert zb.last_stage and zb.pending == 3  # the last stage defers 3 weight passes, holds 4 microbatches
    assert zb.total == pytest.approx(4 * (4 * per_layer + 3 * deferred), rel=1e-12)
    assert zb.total + zb.logits > one_f_one_b.total + one_f_one_b.logits  # no longer 1F1B's peak for free


# A compute model that is not one number: each matrix product's roofline.


def test_a_large_product_reaches_the_measured_share_and_a_thin_one_waits_for_memory():
    h100 = Cluster.published("H100 SXM", per_node=1)
    moved = 2 * 3 * 8192**2 / (0.9 * 3.35e12)  # its bytes, at calculon's share for 100 MB and more
    big = matmul_seconds(8192, 8192, 8192, h100, "bf16")
    assert big == pytest.approx(2 * 8192**3 / (ACHIEVABLE["H100 SXM"] * h100.bf16_flops) + moved, rel=1e-12)
    assert ACHIEVABLE["H100 SXM"] == pytest.approx(794.5 / 989, rel=1e-12)
    thin = matmul_seconds(8192, 8192, 16, h100, "bf16")  # 2 GFLOP: calculon's 0.6 of the peak, then its bytes
    flops, nbytes = 2 * 8192**2 * 16, 2 * (8192**2 + 2 * 8192 * 16)
    assert thin == pytest.approx(flops / (0.6 * h100.bf16_flops) + nbytes / (0.9 * 3.35e12), rel=1e-12)
    assert nbytes / (0.9 * 3.35e12) > flops / (0.6 * h100.bf16_flops)  # mostly waiting for memory
    flops_only = replace(h100, hbm_bytes_per_s=None)
    assert matmul_seconds(8192, 8192, 16, flops_only, "bf16") < thin


def test_wide_models_run_nearer_the_peak_than_narrow_ones():
    h100 = Cluster.published("H100 SXM", per_node=8)
    narrow = ModelShape(24, 1024, 16, 4096, 32000, 2048, dropout=False)
    wide = ModelShape(24, 8192, 64, 32768, 32000, 2048, dropout=False)
    layout = Layout(data=8)  # 8 sequences a device: the products, not the optimizer's update, take the time
    assert step_time(wide, layout, h100, 64).efficiency > step_time(narrow, layout, h100, 64).efficiency + 0.1
    split = Layout(tensor=8)  # splitting the products over 8 devices makes each thinner
    assert step_time(narrow, split, h100, 64).efficiency < step_time(narrow, layout, h100, 64).efficiency


def test_mfu_above_half_the_peak_is_reachable():
    wide = ModelShape(32, 8192, 64, 28672, 32000, 4096, kv_heads=8, dropout=False, name="wide")
    answer = plan(wide, Cluster.published("H100 SXM", per_node=8, nodes=8), global_batch_tokens=2**22)
    assert answer.ranked[0].mfu > 0.5 and answer.efficiency is None


def test_a_number_for_efficiency_keeps_the_one_number_model():
    h100 = Cluster.published("H100 SXM", per_node=1)
    model = MODELS["llama3-8b"]
    t = step_time(model, Layout(), h100, 1, efficiency=0.5)
    assert t.compute == model.flops_per_token() * 8192 / (0.5 * h100.bf16_flops) and t.efficiency == 0.5


@pytest.mark.parametrize("efficiency", ["high", 0, 1.5, True])
def test_an_efficiency_that_is_not_a_share_names_the_argument(efficiency):
    with pytest.raises(ValueError, match=r"efficiency in \(0, 1\] or None \(each matrix product's roofline\)"):
        plan(SMALL, H100, global_batch_tokens=2**16, efficiency=efficiency)


@pytest.mark.parametrize("bandwidth", [0, -1.0, float("nan"), "3e12"])
def test_a_memory_bandwidth_that_is_not_a_rate_names_the_argument(bandwidth):
    with pytest.raises(ValueError, match=r"Cluster\(hbm_bytes_per_s=.*\) is not a finite number > 0: give each"):
        replace(H100, hbm_bytes_per_s=bandwidth)


def test_explain_counts_interleaved_warm_up_and_deferred_weight_passes():
    answer = plan(DEEP, H100, global_batch_tokens=64 * 2048)
    woven = answer.explain(Layout(data=2, stages=4, schedule="interleaved", virtual=2, microbatches=8))
    assert "4 layers x 5.5 microbatch(es) of 4 sequence(s) in flight" in woven  # 4 (1 + 3 / (4 x 2))
    zb = answer.explain(Layout(data=2, stages=4, schedule="zb-h1", microbatches=8))
    assert "on the last stage: 4 layers x 4 microbatch(es)" in zb
    assert "and 3 deferred weight pass(es) x" in zb and "(ZB-H1: memory.weight_pass_bytes)" in zb
