"""The H800, the H100 NVL and the MI300X as the planner sees them: their datasheets read per direction and dense,
a plan on each, and what their links change."""

from __future__ import annotations

import pytest

from parallelkit.measure.hardware import PUBLISHED
from parallelkit.planner import MODELS, Cluster, Layout, memory_per_device, plan, step_time
from parallelkit.planner.search import RESERVE

ROUND2 = {"H800 SXM": 8, "H100 NVL": 2, "MI300X": 8}  # each chip, and the most devices its links join


def test_the_h800_is_an_h100_with_less_than_half_its_nvlink():
    h800, h100 = PUBLISHED["H800 SXM"], PUBLISHED["H100 SXM"]
    for peak in ("bf16_flops", "tf32_flops", "fp8_flops", "hbm_bytes_per_s", "memory_bytes"):
        assert getattr(h800, peak) == getattr(h100, peak)
    assert h800.link_bytes_per_s == 400e9 / 2 and h100.link_bytes_per_s == 900e9 / 2  # printed both directions
    assert h800.network_bytes_per_s == 400e9 / 8  # one 400 Gb/s InfiniBand adapter a GPU


def test_the_h100_nvl_is_its_column_of_the_h100_page_read_dense():
    nvl = PUBLISHED["H100 NVL"]
    assert nvl.bf16_flops == 1671e12 / 2 and nvl.fp8_flops == 3341e12 / 2 and nvl.tf32_flops == 835e12 / 2
    assert nvl.memory_bytes == 94e9 and nvl.hbm_bytes_per_s == 3.9e12 and nvl.fp32_flops == 60e12
    assert nvl.link_bytes_per_s == 600e9 / 2 and nvl.link_domain == 2  # a bridge of two cards


def test_the_mi300x_is_its_datasheet_read_per_direction():
    mi = PUBLISHED["MI300X"]
    assert mi.bf16_flops == 1307.4e12 and mi.fp8_flops == 2614.9e12 and mi.tf32_flops == 653.7e12  # printed dense
    assert mi.memory_bytes == 192e9 and mi.hbm_bytes_per_s == 5.3e12 and mi.fp32_flops == 163.4e12
    assert mi.link_bytes_per_s == 7 * 128e9 / 2  # 7 Infinity Fabric links of 128 GB/s, both directions
    assert mi.link_domain == 8


def test_every_chip_cites_an_address_for_its_figures():
    for name in ROUND2:
        assert PUBLISHED[name].sources and all(s.startswith("https://") for s in PUBLISHED[name].sources)


@pytest.mark.parametrize("chip", ROUND2)
def test_the_planner_plans_on_each(chip):
    c = PUBLISHED[chip]
    per_node = ROUND2[chip]
    cluster = Cluster.published(chip, per_node=per_node, nodes=16 // per_node)
    assert cluster.devices == 16 and cluster.memory_bytes == c.memory_bytes
    assert cluster.peak_flops("bf16") == c.bf16_flops and cluster.peak_flops("fp8") == c.fp8_flops
    answer = plan(MODELS["llama3-8b"], cluster, global_batch_tokens=2**20)
    assert answer.ranked and answer.ranked[0].memory.total <= 0.9 * c.memory_bytes
    assert answer.ranked[0].layout.tensor <= per_node  # no tensor group across the slower network


def test_the_h800s_nvlink_makes_tensor_parallel_traffic_slower_than_the_h100s():
    model, layout = MODELS["llama3-70b"], Layout(data=2, tensor=8, zero=1, sequence_parallel=True)
    h100, h800 = (step_time(model, layout, Cluster.published(c, per_node=8, nodes=2), 16) for c in
                  ("H100 SXM", "H800 SXM"))  # fmt: skip
    assert h800.compute == h100.compute  # the same chip's compute
    ratio = h800.communication["tensor"] / h100.communication["tensor"]
    assert 2.0 < ratio <= 900 / 400  # bandwidth-bound collectives at 4/9 the bandwidth, the latency alike
    assert h800.total > h100.total


def test_the_mi300x_holds_a_layout_that_an_h100_cannot():
    model, layout = MODELS["llama3-70b"], Layout(data=8, zero=3, recompute="full", microbatches=8)
    needs = memory_per_device(model, layout, 64).total  # 70B's sharded state and one sequence's activations
    assert (1 - RESERVE) * PUBLISHED["H100 SXM"].memory_bytes < needs < (1 - RESERVE) * PUBLISHED["MI300X"].memory_bytes
    answer = plan(model, Cluster.published("MI300X", per_node=8), global_batch_tokens=64 * 8192)
    assert answer.assess(layout).fits


def test_an_h100_nvl_machine_larger_than_its_bridge_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Cluster.published\('H100 NVL', per_node=8\): its NVLink bridge joins at "
                                         r"most 2 devices\. Give per_node <= 2"):  # fmt: skip
        Cluster.published("H100 NVL", per_node=8)
    assert Cluster.published("H100 NVL", per_node=2, nodes=4).devices == 8
