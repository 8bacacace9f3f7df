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


# --- too few accelerators: the lessons fall back to simulated CPU devices (the count faked) ---------------------


def _setup_with(monkeypatch, accelerators: int, **kwargs) -> dict:
    """Run pk.lesson.setup(8) as if the machine had ``accelerators``; return how it called simulate_devices."""
    from parallelkit.course import lesson

    called = {}

    def simulate(n, *, force_cpu):
        called.update(n=n, force_cpu=force_cpu)
        return pk.simulate_devices(n, force_cpu=force_cpu)  # this session's 8 CPU devices

    monkeypatch.setattr(lesson, "accelerator_count", lambda: accelerators)
    monkeypatch.setattr(lesson, "simulate_devices", simulate)
    lesson.setup(8, **kwargs)
    return called


@pytest.mark.parametrize("accelerators, needs", [(1, 2), (2, 4), (3, 4)])
def test_fewer_accelerators_than_the_lesson_needs_fall_back_to_the_cpu_with_one_line(
    monkeypatch, capsys, accelerators, needs
):
    assert _setup_with(monkeypatch, accelerators, needs=needs) == {"n": 8, "force_cpu": True}
    first, *rest = capsys.readouterr().out.splitlines()
    assert first == pk.lesson.fallback_line(accelerators, 8, needs)
    assert f"runs on 8 simulated CPU devices; on a machine with {needs} or more accelerators it uses them" in first
    assert rest[0].startswith("8 simulated CPU devices")  # then the device summary, as on any machine


@pytest.mark.parametrize("accelerators", [0, 2, 8])
def test_no_accelerators_or_enough_of_them_print_no_fallback(monkeypatch, capsys, accelerators):
    assert _setup_with(monkeypatch, accelerators)["force_cpu"] is (accelerators == 0)
    assert "accelerator" not in capsys.readouterr().out


def test_force_cpu_does_not_count_the_accelerators(monkeypatch, capsys):
    from parallelkit.course import lesson

    monkeypatch.setattr(lesson, "accelerator_count", lambda: pytest.fail("counted the accelerators"))
    assert len(lesson.setup(8, force_cpu=True)) == 8
    assert "accelerator" not in capsys.readouterr().out


def test_one_accelerator_falls_back_in_a_fresh_process():
    """The whole path before JAX starts: the count faked to one GPU, the lesson gets simulated CPU devices."""
    proc = run_python(
        "import jax\n"
        "from parallelkit.course import lesson\n"
        "lesson.accelerator_count = lambda: 1\n"
        "devices = lesson.setup(4)\n"
        "print(len(devices), devices[0].platform, jax.config.jax_platforms)\n"
    )
    assert proc.returncode == 0, proc.stderr
    line, summary, counted = proc.stdout.splitlines()
    assert line == pk.lesson.fallback_line(1, 4, 2) and summary.startswith("4 simulated CPU devices")
    assert counted == "4 cpu cpu"


def test_counting_accelerators_leaves_jax_unstarted():
    """Without a plugin the answer is 0 at once; with one (faked here) a subprocess counts, not this process."""
    proc = run_python(
        "from parallelkit.core import devices\n"
        "print(devices.accelerator_count(), devices.backends_started())\n"
        "devices._accelerator_plugins = lambda: True\n"
        "print(devices.accelerator_count(), devices.backends_started())\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["0 False", "0 False"]  # this machine has no accelerator either way


def test_after_jax_started_the_count_is_what_it_started_on():
    assert pk.core.devices.accelerator_count() == 0  # this session runs on simulated CPU devices
