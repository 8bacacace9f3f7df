"""torchtitan's op-level recomputation in the planner: what a layer keeps, what it runs again, and that the kit
does not build it."""

from __future__ import annotations

import dataclasses

import pytest

from parallelkit.planner import MODELS, Cluster, Layout, ModelShape, layer_activation_bytes, plan, step_time
from parallelkit.planner.layout import memory_per_device
from parallelkit.planner.memory import Product, block_products, op_level_kept, op_level_recomputed

LLAMA = MODELS["llama3-8b"]


def test_a_layer_keeps_its_input_the_attention_output_and_every_second_product_by_hand():
    h, kv, f, s = 4096, 1024, 14336, 8192  # Llama 3 8B: q, k, v, o, gate, up, down; q, v, gate, down kept
    assert layer_activation_bytes(LLAMA, 1, recompute="op") == 2 * s * (h + h + (h + kv + f + h))
    # tensor 4 with sequence parallelism: the input split over it; the column products' outputs and the attention's
    # split by their heads or features; the down projection's output a whole partial sum on each device
    split = layer_activation_bytes(LLAMA, 1, tensor=4, sequence_parallel=True, recompute="op")
    assert split == 2 * s * (h / 4 + h / 4 + (h + kv + f) / 4 + h)


def test_it_keeps_less_than_korthikantis_selective_and_more_than_full():
    kept = {r: layer_activation_bytes(LLAMA, 1, recompute=r) for r in ("full", "op", "selective")}
    assert kept["full"] < kept["op"] < kept["selective"]


def test_it_runs_the_products_it_did_not_keep_again():
    h100 = Cluster.published("H100 SXM", per_node=8)
    batch, peak = 16, 0.5 * h100.bf16_flops  # with one share of the peak for every FLOP the count is exact
    h, kv, f = 4096, 1024, 14336
    again = LLAMA.layers * 2 * h * (kv + h + f)  # k, the output projection and up: a token's FLOPs, forward once
    tokens = batch * LLAMA.seq / 8
    for recompute, extra in (("none", 0.0), ("op", again)):
        t = step_time(LLAMA, Layout(data=8, zero=3, recompute=recompute), h100, batch, efficiency=0.5)
        assert t.compute == pytest.approx((LLAMA.flops_per_token() + extra) * tokens / peak, rel=1e-12)
    timed = {r: step_time(LLAMA, Layout(data=8, zero=3, recompute=r), h100, batch).compute for r in ("none", "op")}
    assert timed["op"] > timed["none"]  # each operation's own time: the products again, and the norms


def test_torchtitans_llama3_8b_layout_fits_its_gpus_under_its_own_policy():
    gpus = dataclasses.replace(Cluster.published("H100 SXM", per_node=8), memory_bytes=96e9)  # its 96 GB H100s
    answer = plan(LLAMA, gpus, global_batch_tokens=16 * LLAMA.seq)
    ran = Layout(data=8, zero=3, recompute="op")  # torchtitan's Table 1: FSDP, local batch 2, op-level
    assert answer.assess(ran).fits
    assert not answer.assess(dataclasses.replace(ran, recompute="selective")).fits  # Korthikanti's count: no
    assert memory_per_device(LLAMA, ran, 16).total < 0.9 * 96e9
    assert "torchtitan's op-level policy" in answer.explain(ran)


def test_the_kit_does_not_build_it_and_the_search_does_not_rank_it():
    with pytest.raises(ValueError, match="'op'.*choose 'selective' or 'full'"):
        Layout(data=8, recompute="op").strategy()
    small = ModelShape(4, 256, 4, 1024, 1000, 256)
    answer = plan(small, Cluster.published("H100 SXM", per_node=8), global_batch_tokens=64 * 256, exhaustive=True)
    assert all(c.layout.recompute != "op" for c in (*answer.ranked, *answer.unbuilt))
    with pytest.raises(ValueError, match="recompute='remat'"):
        Layout(recompute="remat")


def test_the_pages_korthikanti_count_for_a_llama_block_is_the_planners():
    h, kv, f, s = 4096, 1024, 14336, 8192
    assert layer_activation_bytes(LLAMA, 1, recompute="selective") == 2 * s * (6 * h + 2 * kv + 4 * f)


def test_kept_and_recomputed_split_the_blocks_products_and_an_moe_runs_its_mlp_per_expert():
    products = block_products(LLAMA)
    kept, again = op_level_kept(LLAMA), op_level_recomputed(LLAMA)
    assert not set(kept) & set(again) and sorted((*kept, *again), key=products.index) == list(products)
    assert Product("down", 14336, 4096, column=False, mlp=True) in kept  # a row-parallel MLP product, kept
    moe = ModelShape(2, 64, 4, 256, 100, 16, experts=8, top_k=2)
    assert [p.copies(moe) for p in block_products(moe)] == [1, 1, 1, 1, 2, 2, 2]  # q k v o; gate up down per expert
    assert {p.copies(LLAMA) for p in products} == {1}
