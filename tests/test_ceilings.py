"""Measured ceilings: quick, positive, with units; a matmul figure a direct timing confirms; a per-machine cache."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallelkit as pk
from parallelkit.measure import ceilings

UNITS = {"matmul_f32": "FLOP/s", "matmul_bf16": "FLOP/s", "memory": "B/s"}
UNITS |= {"allreduce_latency": "s", "allreduce_bandwidth": "B/s"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Ceilings of 2 simulated devices, measured once into a temporary cache."""
    folder = tmp_path_factory.mktemp("cache")
    return ceilings.measure_ceilings(jax.devices()[:2], directory=folder), folder


def test_quick_measurement_is_small_and_gives_positive_figures_with_units(measured):
    found, _ = measured
    # Small by construction (how long it takes is benchmarks/roofline.py's to record, not a test's):
    # a 512 x 512 matmul, 64 MiB of memory, all-reduces of at most 4 MiB a device, 5 calls each.
    assert "512x512 matmul, median of 5" in found.matmul_f32.method
    assert "on 64 MiB float32" in found.memory.method
    assert f"to {4 * 2**20} B per device" in found.allreduce_bandwidth.method
    figures = found.figures()
    assert set(figures) == set(UNITS)
    for name, figure in figures.items():
        assert math.isfinite(figure.value) and figure.value > 0, (name, figure)
        assert figure.unit == UNITS[name] and figure.method
        assert f" {figure.unit}  (" in str(figure)
    assert "psum over 2 devices" in figures["allreduce_bandwidth"].method
    assert found.key.startswith("cpu-cpu-2dev-jax") and found.key.endswith("-quick")


def test_matmul_figure_matches_a_direct_timing():
    # Measured here, right beside the direct timing, so that both see the machine as it is now.
    found = ceilings.measure_ceilings(jax.devices()[:1], cache=False)
    n = 512
    x = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
    dot = jax.jit(jnp.dot)
    dot(x, x).block_until_ready()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        dot(x, x).block_until_ready()
        times.append(time.perf_counter() - start)
    direct = 2 * n**3 / np.median(times)
    assert 0.5 < found.matmul_f32.value / direct < 2, (found.matmul_f32, direct)


def test_second_call_reads_the_cache_refresh_measures_again(measured, monkeypatch):
    found, folder = measured
    path = folder / f"ceilings-{found.key}.json"
    assert path.exists()
    with monkeypatch.context() as patch:  # read, not measured: measuring now would raise
        patch.setattr(ceilings, "matmul_flops", lambda *_, **__: pytest.fail("measured instead of read"))
        assert pk.measure_ceilings(jax.devices()[:2], directory=folder) == found
    before = path.stat().st_mtime_ns
    again = ceilings.measure_ceilings(jax.devices()[:2], directory=folder, refresh=True)
    assert path.stat().st_mtime_ns > before and again.key == found.key


def test_one_device_has_no_allreduce_and_cache_false_writes_nothing(tmp_path):
    found = ceilings.measure_ceilings(jax.devices()[:1], cache=False, directory=tmp_path)
    assert found.allreduce_latency is None and found.allreduce_bandwidth is None
    assert set(found.figures()) == {"matmul_f32", "matmul_bf16", "memory"}
    assert list(tmp_path.iterdir()) == []


def test_cache_folder_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ceilings.CACHE_ENV, str(tmp_path))
    assert ceilings.cache_dir() == tmp_path


def test_alpha_beta_fit_hand_worked():
    # t = 1 s + bytes x 1 ms: sizes 0, 1000 and 3000 bytes take 1, 2 and 4 seconds
    alpha, beta = ceilings.fit_alpha_beta([0, 1000, 3000], [1.0, 2.0, 4.0])
    assert alpha == pytest.approx(1.0) and beta == pytest.approx(1e-3)


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="at least one device"):
        ceilings.measure_ceilings([])
    with pytest.raises(ValueError, match="at least two different sizes"):
        ceilings.fit_alpha_beta([8, 8], [1.0, 1.0])
