"""simulate_devices and device selection, including the too-late pitfall (in fresh processes)."""

from __future__ import annotations

import jax
import pytest
from helpers import run_python

import parallelkit as pk


def test_session_has_the_simulated_devices():
    summary = pk.device_summary()
    assert summary.device_count == len(jax.devices()) == 8
    assert summary.platform == "cpu" and summary.simulated
    assert (summary.process_index, summary.process_count) == (0, 1)
    assert str(summary).startswith("8 simulated CPU devices")


def test_calling_again_with_the_same_count_is_harmless():
    assert len(pk.simulate_devices(8)) == 8


def test_too_late_raises_and_says_what_to_do():
    proc = run_python(
        "import jax.numpy as jnp\n"
        "jnp.ones(3).block_until_ready()  # JAX has started, with 1 CPU device\n"
        "import parallelkit as pk\n"
        "try:\n"
        "    pk.simulate_devices(4)\n"
        "except pk.DeviceCountError as e:\n"
        "    print('ERROR:', e)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "ERROR: JAX already started with 1 CPU device(s), so simulate_devices(4) comes too late" in proc.stdout
    assert "Restart the kernel" in proc.stdout


def test_fresh_process_gets_exactly_the_count_and_passes_it_on():
    proc = run_python(
        "import os, jax; print(len(jax.devices()), os.environ['XLA_FLAGS'])",
        devices=3,
    )
    assert proc.returncode == 0, proc.stderr
    count, flags = proc.stdout.split(maxsplit=1)
    assert count == "3" and "--xla_force_host_platform_device_count=3" in flags


@pytest.mark.parametrize("bad", [0, -2, 2.5, "8"])
def test_bad_counts(bad):
    with pytest.raises(ValueError, match="whole number"):
        pk.simulate_devices(bad)


def test_resolve_devices():
    from parallelkit.devices import resolve_devices

    assert resolve_devices() == jax.devices()
    assert resolve_devices(3) == jax.devices()[:3]
    assert resolve_devices(jax.devices()[5:7]) == jax.devices()[5:7]
    with pytest.raises(ValueError, match="at least one"):
        resolve_devices([])
    with pytest.raises(ValueError, match="at least one"):
        resolve_devices(0)
    with pytest.raises(pk.DeviceCountError, match="Asked for 9 devices but JAX has 8"):
        resolve_devices(9)
