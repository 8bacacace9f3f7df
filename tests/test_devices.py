"""simulate_devices and device selection, including the too-late pitfall (in fresh processes)."""

from __future__ import annotations

import os

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
    from parallelkit.core.devices import resolve_devices

    assert resolve_devices() == jax.devices()
    assert resolve_devices(3) == jax.devices()[:3]
    assert resolve_devices(jax.devices()[5:7]) == jax.devices()[5:7]
    with pytest.raises(ValueError, match="at least one"):
        resolve_devices([])
    with pytest.raises(ValueError, match="at least one"):
        resolve_devices(0)
    with pytest.raises(pk.DeviceCountError, match="Asked for 9 devices but JAX has 8"):
        resolve_devices(9)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for 2 devices with a core each")
def test_cores_as_devices_gives_one_core_per_device_and_says_so():
    code = (
        "import parallelkit as pk, jax\n"
        "pk.simulate_devices(2, cores_as_devices=True)\n"
        "s = pk.device_summary()\n"
        "print(s.cores_as_devices, s.simulation)\n"
        "pk.simulate_devices(2, cores_as_devices=True)  # the same again: fine\n"
        "try:\n"
        "    pk.simulate_devices(2)\n"
        "except pk.DeviceCountError as err:\n"
        "    print('late:', err)\n"
    )
    proc = run_python(code)  # the child starts with this session's PJRT_NPROC, which the mode replaces
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True cores as devices: one core each (2 of ")
    assert "late: JAX already started with one core per device" in proc.stdout


def test_shared_cores_is_the_default_and_says_times_show_overhead():
    summary = pk.device_summary()
    assert not summary.cores_as_devices
    assert "times show overhead, not speed-up" in summary.simulation


def test_cores_as_devices_needs_a_core_per_device():
    with pytest.raises(ValueError, match="needs a core per device"):
        pk.simulate_devices(os.cpu_count() * 4, cores_as_devices=True)
