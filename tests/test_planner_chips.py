"""The published chips the planner knows beyond the H100 and A100, and FP8 as a training precision."""

from __future__ import annotations

import pytest

from parallelkit.measure import hardware
from parallelkit.measure.hardware import PUBLISHED
from parallelkit.planner import MODELS, Cluster, Layout, memory_per_device, plan, step_time
from parallelkit.planner.cluster import PRECISIONS
from parallelkit.planner.kernels import FP8_CAST_BYTES, matmul_seconds
from parallelkit.planner.memory import ELEMENT_BYTES, STATE_BYTES

NEW = ("TPU v6e", "B200")


def test_tpu_v6e_is_its_page_read_per_direction():
    v6e = PUBLISHED["TPU v6e"]
    assert v6e.bf16_flops == 918e12 and v6e.memory_bytes == 32e9 and v6e.hbm_bytes_per_s == 1638e9
    assert v6e.link_bytes_per_s == 800e9 / 2  # ICI printed as 800 GBps bidirectional per chip
    assert v6e.link_axes == 2 and v6e.axis_link_bytes_per_s == 200e9  # a 2D torus, 4 ports
    assert v6e.network_bytes_per_s == 4 * 200e9 / 8 / 8  # 4 x 200 Gb/s NICs per 8-chip host, in bytes
    assert v6e.fp8_flops is None and v6e.fp32_flops is None and v6e.tf32_flops is None  # only bf16 and Int8 printed


def test_b200_is_dense_not_sparse():
    b200 = PUBLISHED["B200"]
    assert b200.bf16_flops == 4500e12 / 2  # printed 4,500 TFLOPS sparse (HGX B200, 1,000 W)
    assert b200.fp8_flops == 9000e12 / 2  # printed 9,000 sparse, not the 9,000 "dense" some pages say
    assert b200.tf32_flops == 2200e12 / 2 and b200.fp32_flops == 75e12  # NVIDIA's HGX page, per GPU
    assert b200.memory_bytes == 1440e9 / 8 and b200.hbm_bytes_per_s == 7.7e12  # 180 GB of the DGX B200's 1,440
    assert b200.link_bytes_per_s == 14.4e12 / 8 / 2  # NVLink 5: 14.4 TB/s for 8 GPUs, both directions
    assert b200.link_axes == 1 and b200.network_bytes_per_s == 400e9 / 8  # one 400 Gb/s adapter a GPU


def test_fp8_peaks_are_dense_and_only_where_printed():
    assert PUBLISHED["H100 SXM"].fp8_flops == 3958e12 / 2  # printed 3,958 TFLOPS "with sparsity"
    assert PUBLISHED["TPU v5p"].fp8_flops == PUBLISHED["TPU v5p"].bf16_flops == 459e12  # printed: FP8 459
    assert PUBLISHED["A100 SXM 80GB"].fp8_flops is None and PUBLISHED["TPU v5e"].fp8_flops is None
    for chip in PUBLISHED.values():  # dense FP8 is twice dense bf16 on every GPU that has it, never four times
        if chip.fp8_flops and chip.tf32_flops:
            assert chip.fp8_flops == pytest.approx(2 * chip.bf16_flops, rel=1e-3)


def test_the_table_has_an_fp8_column_and_every_chip():
    lines = hardware.table().splitlines()
    assert lines[0].split()[1:3] == ["fp8", "TFLOP/s"] and len(lines) == 1 + len(PUBLISHED)
    rows = {chip.name: line for chip, line in zip(PUBLISHED.values(), lines[1:], strict=True)}
    assert rows["Google Cloud TPU v6e"].split()[-7:] == ["-", "918", "-", "-", "1638", "400", "12.5"]
    assert rows["NVIDIA B200 (180 GB)"].split()[-7:] == ["4500", "2250", "1100", "75", "7700", "900", "50"]


@pytest.mark.parametrize("chip", NEW)
def test_the_planner_takes_each_new_chip(chip):
    c = PUBLISHED[chip]
    cluster = Cluster.published(chip, per_node=8, nodes=2)
    assert cluster.devices == 16 and cluster.memory_bytes == c.memory_bytes
    assert (
        cluster.inside.GBps == c.axis_link_bytes_per_s / 1e9 and cluster.network.GBps == 8 * c.network_bytes_per_s / 1e9
    )
    assert cluster.peak_flops("bf16") == c.bf16_flops and cluster.fp8_flops == c.fp8_flops
    answer = plan(MODELS["llama3-8b"], cluster, global_batch_tokens=2**20)
    assert answer.ranked and answer.ranked[0].memory.total <= 0.9 * c.memory_bytes


def test_fp8_plans_a_shorter_step_than_bf16_on_an_h100():
    model, cluster, batch = MODELS["llama3-70b"], Cluster.published("H100 SXM", per_node=8, nodes=4), 2**21
    bf16, fp8 = (plan(model, cluster, global_batch_tokens=batch, precision=p) for p in ("bf16", "fp8"))
    assert bf16.ranked and fp8.ranked
    assert fp8.ranked[0].time.total < bf16.ranked[0].time.total
    layout = Layout(data=4, tensor=8, zero=1, sequence_parallel=True, recompute="selective")
    one, eight = (step_time(model, layout, cluster, 64, precision=p) for p in ("bf16", "fp8"))
    assert 1 < one.compute / eight.compute < 2  # FP8 doubles the peak of the linear layers only, and costs casts
    assert eight.communication == one.communication  # FP8's collectives carry bf16, as bf16's do


def test_fp8_keeps_bf16_state_and_activations():
    assert STATE_BYTES["fp8", "adam"] == STATE_BYTES["bf16", "adam"] == (2, 2, 12)
    assert ELEMENT_BYTES["fp8"] == ELEMENT_BYTES["bf16"]
    layout, model = Layout(data=8, zero=1), MODELS["llama3-8b"]
    assert memory_per_device(model, layout, 8, precision="fp8") == memory_per_device(model, layout, 8)


def test_an_fp8_product_pays_its_peak_its_bytes_and_its_casts():
    h100 = Cluster.published("H100 SXM", per_node=1)
    m = k = n = 8192
    share = 794.5 / 989  # the achievable share of the peak, taken for FP8 as for bf16
    flops = 2 * m * k * n / (share * 1979e12)
    bandwidth = 0.9 * 3.35e12  # calculon's share of the memory's bandwidth for 100 MB and more
    cast = FP8_CAST_BYTES * (m * k + k * n) / bandwidth  # delayed scaling: read 2 bytes, write 1
    moved = ((m * k + k * n) + 2 * m * n) / bandwidth  # 1-byte inputs, a bf16 output
    assert matmul_seconds(m, k, n, h100, "fp8") == pytest.approx(cast + flops + moved, rel=1e-12)
    thin = matmul_seconds(m, k, 16, h100, "fp8")  # 2 GFLOP at calculon's 0.6, its casts and bytes
    inputs = m * k + k * 16
    read = (inputs + 2 * m * 16) / (0.75 * 3.35e12)  # 67 MB: calculon's share from 10 MB up
    assert thin == pytest.approx(3 * inputs / bandwidth + 2 * m * k * 16 / (0.6 * 1979e12) + read, rel=1e-12)


@pytest.mark.parametrize("chip", ["A100 SXM 80GB", "TPU v5e", "TPU v6e"])
def test_fp8_on_a_chip_without_it_is_refused_by_name(chip):
    cluster = Cluster.published(chip, per_node=8)
    with pytest.raises(ValueError, match=f"precision='fp8' on 8 {chip}: this chip has no FP8 peak"):
        plan(MODELS["gpt2-xl"], cluster, global_batch_tokens=2**19, precision="fp8")
    with pytest.raises(ValueError, match="no FP8 peak"):
        step_time(MODELS["gpt2-xl"], Layout(data=8), cluster, 8, precision="fp8")


def test_precisions_are_one_list():
    assert PRECISIONS == ("bf16", "fp32", "fp8")
    assert {p for p, _ in STATE_BYTES} == set(PRECISIONS) == set(ELEMENT_BYTES)
    h100 = Cluster.published("H100 SXM", per_node=1)
    with pytest.raises(ValueError, match=r"precision='int8': one of \('bf16', 'fp32', 'fp8'\)"):
        h100.peak_flops("int8")
    with pytest.raises(ValueError, match=r"precision='int8': one of"):  # not a KeyError from a table
        step_time(MODELS["gpt2-xl"], Layout(), h100, 1, precision="int8")
    with pytest.raises(ValueError, match=r"Cluster\(fp8_flops=0\)"):
        Cluster(1, 1, Cluster.published("H100 SXM", per_node=1).inside, None, 1.0, 1.0, 1.0, fp8_flops=0)
