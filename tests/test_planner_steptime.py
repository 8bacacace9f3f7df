"""The planner's step model, round 2: every operation on its own, overlap per family, ZB-H1 at its real cost."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parallelkit.measure.costmodel import axis_seconds
from parallelkit.planner import MODELS, Cluster, Layout, ModelShape, plan, step_time
from parallelkit.planner.kernels import Passes, layer_passes, matmul_share, optimizer_seconds
from parallelkit.planner.search import only_full_fits, weigh
from parallelkit.planner.steptime import (
    LINK_SHARE,
    achieved,
    bubble_share,
    gradient_seconds,
    hidden_families,
    vocabulary_ends,
)

A100 = "A100 SXM 80GB"
SMALL = ModelShape(8, 1024, 16, 4096, 32000, 2048, kv_heads=4, dropout=False, name="small")


def megatron(heads: int, width: int, layers: int) -> ModelShape:
    """Megatron-LM's GPT of Korthikanti et al.'s Table 3: 4h GELU MLP, biases, learned positions, tied head."""
    return ModelShape(layers, width, heads, 4 * width, 51200, 2048, gated=False, tied=True, bias=True,
                       positions=True)  # fmt: skip


# Korthikanti et al. 2022, Tables 3 and 5: the 175B model on 64 A100s, tensor 8 x stages 8, interleaved v=3, 64
# sequences of one, measured seconds an iteration.
GPT_175B = megatron(96, 12288, 96)
ON_64 = Cluster.published(A100, per_node=8, nodes=8)


@pytest.mark.parametrize(
    ("recompute", "sp", "measured"), [("full", False, 18.13), ("selective", True, 13.75)]
)  # fmt: skip
def test_korthikanti_175b_step_within_a_tenth_of_its_measured_seconds(recompute, sp, measured):
    layout = Layout(tensor=8, stages=8, schedule="interleaved", virtual=3, microbatches=64, recompute=recompute,
                    sequence_parallel=sp)  # fmt: skip
    predicted = step_time(GPT_175B, layout, ON_64, 64, attention="unfused").total
    assert predicted == pytest.approx(measured, rel=0.10)  # the matmul-roofline model said 14.2 s and 9.9 s


def test_an_unfused_attention_pays_for_its_scores_and_selective_recomputation_repeats_only_them():
    cluster = Cluster.published(A100, per_node=8)
    layout = Layout(tensor=8)
    flash = layer_passes(GPT_175B, layout, cluster, 1, "bf16", "flash")
    unfused = layer_passes(GPT_175B, layout, cluster, 1, "bf16", "unfused")
    assert unfused.forward > flash.forward and unfused.weight == flash.weight  # the linear layers are the same
    selective = layer_passes(GPT_175B, replace(layout, recompute="selective"), cluster, 1, "bf16", "unfused")
    full = layer_passes(GPT_175B, replace(layout, recompute="full"), cluster, 1, "bf16", "unfused")
    assert unfused.backward < selective.backward < full.backward
    assert full.backward == pytest.approx(unfused.backward + unfused.forward, rel=1e-12)
    with pytest.raises(ValueError, match=r"attention='fused' is not an attention kernel the planner times: give one"):
        step_time(SMALL, Layout(), Cluster.published("H100 SXM", per_node=1), 1, attention="fused")


def test_a_products_share_of_the_peak_grows_with_its_size_up_to_the_measured_best():
    a100 = Cluster.published(A100, per_node=1)
    shares = [matmul_share(flops, a100) for flops in (1e8, 2e9, 32e9, 1e12)]
    assert shares == [0.1, 0.6, pytest.approx(271.2 / 312), pytest.approx(271.2 / 312)]  # calculon's, capped


def test_wide_models_reach_more_of_the_peak_and_mfu_above_half_remains_reachable():
    layout, h100 = Layout(data=8), Cluster.published("H100 SXM", per_node=8)
    narrow = ModelShape(24, 1024, 16, 4096, 32000, 2048, dropout=False)
    wide = ModelShape(24, 8192, 64, 32768, 32000, 2048, dropout=False)
    assert step_time(wide, layout, h100, 64).efficiency > step_time(narrow, layout, h100, 64).efficiency + 0.1
    assert step_time(wide, layout, h100, 64).efficiency > 0.5


def test_the_optimizer_step_is_megatrons_passes_over_the_state_each_device_holds():
    h100 = Cluster.published("H100 SXM", per_node=8)
    model = MODELS["llama3-8b"]
    # bytes a parameter: gradient to float32 (2 + 4), its norm (4), Adam (16 read, 12 written), the master to the
    # 16-bit parameter (4 + 2), then the gradient zeroed (2); every pass large enough for 0.9 of the bandwidth
    update, zeroing = (2 + 4) + 4 + (16 + 12) + (4 + 2), 2
    whole = optimizer_seconds(model, Layout(data=8), h100, "bf16")
    assert whole == pytest.approx((update + zeroing) * model.params / (0.9 * 3.35e12), rel=1e-12)
    zero1 = (update / 8 + zeroing) * model.params / (0.9 * 3.35e12)  # ZeRO-1 keeps whole gradients to zero
    assert optimizer_seconds(model, Layout(data=8, zero=1), h100, "bf16") == pytest.approx(zero1, rel=1e-12)
    assert optimizer_seconds(model, Layout(data=8, zero=2), h100, "bf16") == pytest.approx(whole / 8, rel=1e-12)


def test_a_datasheets_links_carry_collectives_at_calculons_share():
    cluster = Cluster.published(A100, per_node=8)
    slower = achieved(cluster)
    assert slower.inside.GBps == pytest.approx(cluster.inside.GBps * LINK_SHARE["inside"])
    t = step_time(SMALL, Layout(tensor=8), cluster, 8)
    one = axis_seconds(slower, 8, 1, 8 * 2048 * 1024 * 2, "all-reduce")
    loss = axis_seconds(slower, 8, 1, 8 * 2048 * 4, "all-reduce")  # a float a token
    ends = 2 * one + 3 * loss  # the embedding's output, the output layer's input, the loss's 3 all-reduces
    assert t.communication["tensor"] == pytest.approx(8 * 4 * one + ends, rel=1e-12)  # 8 layers, 2 + 2 all-reduces
    measured = replace(cluster, chip="measured here")  # a cluster of measured links keeps them
    assert achieved(measured) is measured


def test_the_gradients_take_the_link_share_once_as_the_search_weighs_them():
    cluster = Cluster.published(A100, per_node=8)
    layout = Layout(data=8)
    t = step_time(SMALL, layout, cluster, 8)
    # a ring all-reduce of the bf16 gradients: 2 x 7 steps, each an eighth of them over the link at its share
    link = cluster.inside
    once = 2 * 7 * (link.latency_us * 1e-6 + SMALL.params * 2 / 8 / (link.GBps * 1e9 * LINK_SHARE["inside"]))
    assert t.communication["gradients"] == pytest.approx(gradient_seconds(SMALL, layout, cluster, 2), rel=1e-12)
    assert t.communication["gradients"] == pytest.approx(once, rel=1e-9)


def test_sequence_parallelism_gathers_the_inputs_again_in_the_backward_pass():
    cluster = Cluster.published(A100, per_node=8)
    plain = step_time(SMALL, Layout(tensor=8), cluster, 8).communication["tensor"]
    sp = step_time(SMALL, Layout(tensor=8, sequence_parallel=True), cluster, 8).communication["tensor"]
    gather = axis_seconds(achieved(cluster), 8, 1, 8 * 2048 * 1024 * 2, "all-gather")
    assert sp == pytest.approx(plain + 8 * 2 * gather, rel=1e-12)


# Overlap, per family.


def test_overlap_names_what_hides_and_the_old_values_keep_their_meaning():
    assert hidden_families("none") == () and hidden_families("full") == ("gradients",)
    assert hidden_families({"experts", "tensor"}) == ("tensor", "experts")
    for wrong in ("partial", ("tensor", "pipeline"), 3):
        with pytest.raises(ValueError, match=r"is not an overlap the planner times: give one of \('none', 'full'\)"):
            hidden_families(wrong)


def test_async_tensor_parallelism_hides_its_collectives_behind_the_linear_products():
    cluster = Cluster.published("H100 SXM", per_node=8)
    layout = Layout(tensor=8, microbatches=4)
    exposed = step_time(SMALL, layout, cluster, 32)
    hidden = step_time(SMALL, layout, cluster, 32, overlap=("tensor",))
    passes = layer_passes(SMALL, layout, cluster, 8, "bf16")
    tensor = exposed.communication["tensor"]
    assert hidden.exposed["tensor"] == pytest.approx(max(tensor - 8 * 4 * passes.products, 0.0), rel=1e-12)
    assert hidden.hidden["tensor"] == pytest.approx(tensor - hidden.exposed["tensor"], rel=1e-12)
    assert hidden.total == pytest.approx(exposed.total - hidden.hidden["tensor"], rel=1e-12)


def test_zero_3_gathers_hide_behind_the_whole_compute_the_last_layer_exposed():
    cluster = Cluster.published("H100 SXM", per_node=8)
    t = step_time(SMALL, Layout(data=8, zero=3, microbatches=2), cluster, 16, overlap="full")
    grads = t.communication["gradients"]
    assert t.exposed["gradients"] == pytest.approx(max(grads - t.compute, grads / SMALL.layers), rel=1e-12)


def test_explain_shows_each_familys_exposed_and_hidden_seconds():
    answer = plan(SMALL, Cluster.published("H100 SXM", per_node=8), global_batch_tokens=64 * 2048,
                  overlap=("gradients", "tensor"))  # fmt: skip
    text = answer.explain(Layout(data=4, tensor=2))
    assert "tensor: " in text and " exposed, " in text and "hidden behind compute" in text
    with pytest.raises(ValueError, match=r"overlap one of \('none', 'full'\) or a collection of"):
        plan(SMALL, Cluster.published("H100 SXM", per_node=8), global_batch_tokens=2**16, overlap=("bubble",))
    with pytest.raises(ValueError, match=r"plan\(attention='fused'\) is not an attention kernel"):
        plan(SMALL, Cluster.published("H100 SXM", per_node=8), global_batch_tokens=2**16, attention="fused")


# ZB-H1 at its real cost.


def test_zb_h1_idles_for_its_forward_and_backward_less_its_weight_passes():
    layout = Layout(stages=4, microbatches=8, schedule="zb-h1")
    passes = Passes(forward=1.0, backward=1.5, weight=0.5)
    assert bubble_share(layout, passes) == pytest.approx(3 / 8 * (1.0 + 1.5 - 0.5) / 3.0)
    assert bubble_share(layout, Passes(1.0, 1.0, 1.0)) == pytest.approx(bubble_share(layout)) == 0.125


def test_zb_h1_under_full_recomputation_idles_longer_than_a_third_of_1f1b():
    cluster = Cluster.published(A100, per_node=8, nodes=8)
    layout = Layout(tensor=8, stages=8, microbatches=64, schedule="zb-h1", recompute="full")
    zb = step_time(GPT_175B, layout, cluster, 64)
    one_f_one_b = step_time(GPT_175B, replace(layout, schedule="1f1b"), cluster, 64)
    assert zb.bubble / one_f_one_b.bubble > 0.45  # the recomputed forward sits in B: about half, not a third


def test_a_layout_that_fits_only_with_full_recomputation_is_known_before_it_is_weighed():
    options = {"precision": "bf16", "optimizer": "adam", "reserve": 0.1}
    cluster = Cluster.published("H100 SXM", per_node=8, nodes=8)
    fsdp = Layout(data=64, zero=3)  # Llama 3 70B: 17.6 GB of state a GPU, a selective layer of 8k tokens over 1 GB
    assert only_full_fits(MODELS["llama3-70b"], fsdp, cluster, 64, **options)
    timing = {"efficiency": None, "overlap": "none"}
    assert weigh(MODELS["llama3-70b"], fsdp, cluster, 64, **options, **timing).layout.recompute == "full"
    assert not only_full_fits(SMALL, Layout(data=64), cluster, 64, **options)


def test_the_vocabulary_ends_count_the_embedding_only_where_the_output_layer_is():
    def along(axis: str, nbytes: float, collective: str) -> float:  # a collective's seconds: its bytes
        assert (axis, collective) == ("tensor", "all-reduce")
        return nbytes

    # the output layer's input (100) and the loss's three floats a token (3 x 10 tokens x 4 bytes) ...
    assert vocabulary_ends(Layout(stages=2, microbatches=2, tensor=4), 10, 100, along) == 100 + 3 * 40
    # ... and without a pipeline the embedding's output (100) on the same device
    assert vocabulary_ends(Layout(tensor=4), 10, 100, along) == 2 * 100 + 3 * 40
