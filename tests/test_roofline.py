"""Roofline arithmetic on numbers worked out by hand, and the published figures table."""

from __future__ import annotations

import math

import pytest

from parallelkit.measure import ceilings, hardware, roofline

PEAK, BANDWIDTH = 100e12, 2e12  # a made-up device: 100 TFLOP/s, 2 TB/s, ridge at 50 FLOPs/byte


def test_ridge_and_a_point_on_each_side():
    assert roofline.ridge(PEAK, BANDWIDTH) == 50.0
    # 10 FLOPs/byte: memory-bound, the slope allows 10 x 2 TB/s = 20 TFLOP/s
    assert roofline.attainable(10.0, PEAK, BANDWIDTH) == 20e12
    assert roofline.regime(10.0, PEAK, BANDWIDTH) == "memory-bound"
    # 200 FLOPs/byte: compute-bound, capped at the 100 TFLOP/s roof (the slope would allow 400)
    assert roofline.attainable(200.0, PEAK, BANDWIDTH) == 100e12
    assert roofline.regime(200.0, PEAK, BANDWIDTH) == "compute-bound"
    # exactly on the ridge both limits meet
    assert roofline.attainable(50.0, PEAK, BANDWIDTH) == 100e12
    assert roofline.regime(50.0, PEAK, BANDWIDTH) == "compute-bound"


def test_intensity_of_a_square_matmul():
    # n = 1024 float32: 2 n^3 = 2,147,483,648 FLOPs on 3 n^2 x 4 = 12,582,912 bytes
    assert roofline.intensity(2_147_483_648, 12_582_912) == pytest.approx(170.6667, rel=1e-6)


def test_achieved_and_mfu():
    # 3 TFLOPs in 50 ms: 60 TFLOP/s, 60% of a 100 TFLOP/s peak
    assert roofline.achieved_flops(3e12, 0.05) == pytest.approx(60e12)
    assert roofline.flops_utilisation(3e12, 0.05, PEAK) == pytest.approx(0.6)
    assert roofline.mfu(3e12, 0.05, PEAK) == pytest.approx(0.6)
    # PaLM's MFU counts 6N: 1,000 parameters and 64 tokens are 384,000 model FLOPs; in 4 ns of a 200 TFLOP/s
    # peak, 96 TFLOP/s, 48% of it
    assert roofline.mfu(384_000, 4e-9, 200e12) == pytest.approx(0.48)


def test_place_a_measured_step():
    # 1 GFLOP on 100 MB in 1 ms: intensity 10, 1 TFLOP/s achieved of the 20 the roof allows
    point = roofline.place(1e9, 1e8, 1e-3, PEAK, BANDWIDTH)
    assert point == roofline.RooflinePoint(intensity=10.0, achieved=1e12, bound=20e12, regime="memory-bound")
    assert point.fraction_of_bound == pytest.approx(0.05)


def test_data_parallel_min_batch_hand_worked():
    # bfloat16 gradients, all-reduce hidden behind the backward pass: B > C / W
    assert roofline.data_parallel_min_batch(1e12, 1e9) == pytest.approx(1000.0)
    # float32 gradients (4 bytes) hidden behind the whole step (6 FLOPs): B > (8 / 6) C / W
    assert roofline.data_parallel_min_batch(1e12, 1e9, bytes_per_value=4, flops_per_param_token=6) == pytest.approx(
        1333.3333
    )
    # H100s across nodes: 989.5 TFLOP/s over 50 GB/s each way is 19,790 tokens per GPU
    h100 = hardware.PUBLISHED["H100 SXM"]
    assert roofline.data_parallel_min_batch(h100.bf16_flops, h100.network_bytes_per_s) == pytest.approx(19790.0)
    # TPU v5p, one torus axis of three: 459 TFLOP/s over 600 / 3 = 200 GB/s each way is 2,295 tokens
    v5p = hardware.PUBLISHED["TPU v5p"]
    assert roofline.data_parallel_min_batch(v5p.bf16_flops, v5p.axis_link_bytes_per_s) == pytest.approx(2295.0)


def test_threshold_from_a_fitted_allreduce_by_hand():
    # psum times exactly t = 20 us + bytes / (2 GB/s), fitted as measure_ceilings fits them
    sizes = [4 * 2**k for k in range(10, 21, 2)]
    alpha, beta = ceilings.fit_alpha_beta(sizes, [20e-6 + n / 2e9 for n in sizes])
    assert (alpha, 1 / beta) == (pytest.approx(20e-6, rel=1e-6), pytest.approx(2e9, rel=1e-6))
    peak, params = 1e11, 1e6  # 100 GFLOP/s; a million float32 gradient values
    # by hand: the backward pass, 4 P B FLOPs, takes 4 P B / C seconds; the all-reduce of the 4 P bytes
    # alpha + beta 4 P seconds by the fit; they are equal at B = (alpha + 4 beta P) C / (4 P):
    # (20e-6 + 2e-3) x 1e11 / 4e6 = 50.5
    by_hand = (alpha + beta * 4 * params) * peak / (4 * params)
    assert by_hand == pytest.approx(50.5, rel=1e-6)
    got = roofline.data_parallel_min_batch_from_allreduce(
        peak, 1 / beta, latency=alpha, parameters=params, bytes_per_value=4
    )
    assert got == pytest.approx(by_hand, rel=1e-12)
    # without the latency, the large-model limit: C beta x 4 / 4 = 50 (P cancels)
    assert roofline.data_parallel_min_batch_from_allreduce(peak, 1 / beta, bytes_per_value=4) == pytest.approx(50.0)
    # a link's bandwidth each way is about twice the algorithm bandwidth of a ring over it: the two functions
    # agree at W_link = 2 W_algorithm; given the fitted bandwidth, the link formula would double the threshold
    assert roofline.data_parallel_min_batch(peak, 2 / beta, bytes_per_value=4) == pytest.approx(50.0)
    assert roofline.data_parallel_min_batch(peak, 1 / beta, bytes_per_value=4) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="needs parameters=P"):
        roofline.data_parallel_min_batch_from_allreduce(peak, 1 / beta, latency=alpha)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: roofline.intensity(1.0, 0.0), "bytes_moved=0.0"),
        (lambda: roofline.mfu(1.0, 0.0, PEAK), "step_seconds=0.0"),
        (lambda: roofline.ridge(PEAK, -1.0), "bandwidth=-1.0"),
        (lambda: roofline.data_parallel_min_batch(PEAK, math.nan), "link_bytes_per_s_each_way=nan"),
        (lambda: roofline.data_parallel_min_batch_from_allreduce(PEAK, 0.0), "allreduce_bandwidth=0.0"),
        (lambda: roofline.data_parallel_min_batch_from_allreduce(PEAK, 1.0, latency=1.0, parameters=0), "parameters=0"),
    ],
)
def test_bad_numbers_are_named(call, name):
    with pytest.raises(ValueError, match=f"{name}: the roofline needs a positive"):
        call()


def test_published_table_is_dense_per_direction_and_sourced():
    h100 = hardware.PUBLISHED["H100 SXM"]
    assert h100.bf16_flops == 1979e12 / 2  # NVIDIA prints 1,979 TFLOPS "with sparsity"
    assert h100.link_bytes_per_s == 900e9 / 2  # NVLink 4 printed as 900 GB/s, both directions
    assert h100.tf32_flops == 989e12 / 2  # TF32 printed as 989 TFLOPS "with sparsity"
    assert hardware.PUBLISHED["A100 SXM 80GB"].tf32_flops == 312e12 / 2  # printed 156 dense, 312 with sparsity
    assert h100.bf16_flops / h100.tf32_flops == pytest.approx(2.0, rel=1e-3)  # JAX's float32 default there: TF32
    assert hardware.PUBLISHED["TPU v5e"].axis_link_bytes_per_s == 400e9 / 2 / 2  # 400 GB/s both ways, 2 axes
    assert roofline.ridge(h100.bf16_flops, h100.hbm_bytes_per_s) == pytest.approx(295.37, rel=1e-4)
    for chip in hardware.PUBLISHED.values():
        assert chip.sources and all(url.startswith("https://") for url in chip.sources)
        numbers = [chip.bf16_flops, chip.hbm_bytes_per_s, chip.link_bytes_per_s, chip.network_bytes_per_s]
        assert all(x > 0 for x in numbers)
        assert chip.network_bytes_per_s < chip.link_bytes_per_s < chip.hbm_bytes_per_s
    lines = hardware.table().splitlines()
    assert len(lines) == 1 + len(hardware.PUBLISHED)
    assert "989.5" in lines[1] and lines[1].split()[-6:] == ["989.5", "494.5", "67", "3350", "450", "50"]
    assert lines[3].split()[-6:] == ["197", "-", "-", "819", "200", "3.125"]
