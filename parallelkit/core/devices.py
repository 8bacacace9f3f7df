"""Devices: simulating several on one CPU (:func:`simulate_devices`), summarising them (:func:`device_summary`), and
choosing a set (:func:`resolve_devices`, :func:`first_devices`)."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import jax
import numpy as np

_FORCE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_POOL_SIZE_VAR = "PJRT_NPROC"  # threads of XLA's CPU client pool; the core count by default
# libtpu (the TPU compiler of pk.aot, the parallelkit[tpu] extra) starts with JAX's backends and looks for a TPU
# VM's description; on a machine without TPU chips it prints INVALID_ARGUMENT errors. The first two say: no pod,
# this host. It also takes a lock (/tmp/libtpu_lockfile) that keeps a second process from starting it, which only
# guards chips; without chips the third lets a notebook's kernel and its tests, or two notebooks, compile at once.
NO_TPU_VM = {
    "TPU_ACCELERATOR_TYPE": "v5litepod-8",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


class DeviceCountError(RuntimeError):
    """JAX runs with a different number of devices than was asked for."""


class DeviceSubsetWarning(UserWarning):
    """A strategy that was not told which devices to use leaves some idle, or puts two of its parts on one.

    Strategies whose other arguments fix how many devices they need (``TensorParallel(model=k)``,
    ``Hybrid(d, k)``, ``Pipeline(..., stages, data=d)``) take the first ones and warn when
    that leaves devices out; ``ParameterServer(num_shards=k)`` warns when its shards outnumber
    its workers' devices and two shards share one. Passing ``devices=`` says the choice is
    meant and silences it; ``warnings.simplefilter("ignore", pk.DeviceSubsetWarning)``
    silences it everywhere. ``SingleDevice`` and a count given as ``devices=n`` are choices
    too and never warn.
    """


def backends_started() -> bool:
    """Whether JAX has started its backends in this process (after which the device count is fixed).

    JAX has no public function that asks without starting them, so this asks the public
    config: once the backends run, ``jax.config.update("jax_num_cpu_devices", n)``
    refuses any ``n`` other than the current one with a RuntimeError. Before, the probe
    sets another value and puts the current one back, which changes nothing.
    """
    current = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", current + 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False


_COUNT_ACCELERATORS = "import jax; print(0 if jax.default_backend() == 'cpu' else jax.device_count())"


def accelerator_count() -> int:
    """How many accelerators (GPUs, TPUs) JAX would run on here, asked without starting JAX in this process.

    0 where JAX can only run on the CPU: ``jax_platforms`` names the CPU alone, or no
    accelerator plugin is installed (no ``jax_plugins`` module or entry point, such as
    CUDA's or ROCm's, and no ``libtpu`` on a machine with TPU chips). Otherwise a short Python subprocess starts JAX
    and counts, without reserving the accelerators' memory; this process stays free to
    choose its devices. Once JAX has started here, the count of the devices it started on.
    """
    if backends_started():
        return 0 if jax.default_backend() == "cpu" else jax.device_count()
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if platforms.strip() == "cpu" or not _accelerator_plugins():
        return 0
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    probe = subprocess.run(
        [sys.executable, "-c", _COUNT_ACCELERATORS], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    if probe.returncode != 0 or not probe.stdout.strip().isdigit():
        warnings.warn(
            f"Counting the accelerators failed (a JAX subprocess exited with {probe.returncode}: "
            f"{probe.stderr.strip()[-300:]!r}), so this counts none. Check that JAX starts here with "
            "python -c 'import jax; print(jax.devices())'.",
            stacklevel=2,
        )
        return 0
    return int(probe.stdout)


def _accelerator_plugins() -> bool:
    """Whether a JAX accelerator plugin is installed, found where JAX looks when it starts.

    libtpu counts only on a machine with TPU chips: elsewhere it is the TPU compiler of
    :mod:`parallelkit.measure.aot`, which runs no step.
    """
    if entry_points(group="jax_plugins"):
        return True
    if importlib.util.find_spec("libtpu") is not None and _tpu_chips() > 0:
        return True
    namespace = importlib.util.find_spec("jax_plugins")  # plugins installed as modules of this namespace
    return namespace is not None and any(pkgutil.iter_modules(namespace.submodule_search_locations or []))


def simulate_devices(n: int, *, cores_as_devices: bool = False, force_cpu: bool = False) -> list[jax.Device]:
    """Split the host CPU into ``n`` XLA devices; call it before any JAX work.

    By default the devices share every core: XLA's CPU thread pool serves them all,
    so one device alone already uses every core, and ``n`` devices show the cost of
    coordinating them, never a speed-up. With ``cores_as_devices=True`` the pool
    gets exactly ``n`` threads (``PJRT_NPROC=n``), so the process computes with ``n``
    cores at most: ``n`` devices busy at once get one core's worth of threads each.
    Two yardsticks then answer two questions. Against one device on one core (a fresh
    process with ``simulate_devices(1, cores_as_devices=True)``), ``n`` devices show how
    throughput grows with the cores they are given. Against one device on the same
    ``n`` cores (the first device of this process, which XLA's ``n`` threads serve
    alone), they show whether splitting the batch over devices beats letting XLA split
    each matrix product over the threads; on a CPU it may not (``python -m parallelkit
    bench --cores-as-devices`` reports both; docs/honest_numbers.md quotes what it measured). It
    needs ``n`` no larger than the cores this process may use. The smaller pool leaves
    the protection against the CPU deadlock described above to ``pk.Step``'s bound on
    steps in flight: a hand-written loop should block on its results every few steps.

    On a machine with accelerators the CPU count is set but the accelerators stay
    JAX's default devices, so the call changes nothing there: the returned list
    is then the accelerators. ``force_cpu=True`` starts JAX on the CPU alone
    (``jax_platforms="cpu"``), so that a machine with one GPU (a hosted notebook)
    still shows ``n`` devices. It also puts the count into ``XLA_FLAGS`` so that
    subprocesses started from here see the same devices. Where libtpu is installed on a
    machine without TPU chips, it tells libtpu so first (:func:`quiet_libtpu`).

    Args:
      n: number of CPU devices, at least 1.
      cores_as_devices: give the process one core's worth of threads per device.
      force_cpu: use the simulated CPU devices even where there are accelerators.

    Returns:
      ``jax.devices()``: ``n`` CPU devices, or the accelerators where there are some.

    Raises:
      DeviceCountError: JAX already started with another number of CPU devices (or
        the other threading, or on accelerators where ``force_cpu`` asks for the CPU).
        Restart the Python process (kernel) and call this first.
      ValueError: ``cores_as_devices`` with more devices than cores.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_devices(n) needs a whole number n >= 1, got {n!r}.")
    if cores_as_devices and n > _cores():
        raise ValueError(
            f"simulate_devices({n}, cores_as_devices=True) needs a core per device, and this process may use "
            f"{_cores()}: ask for at most {_cores()} devices, or leave cores_as_devices off."
        )
    if backends_started():
        if force_cpu and jax.default_backend() != "cpu":
            raise DeviceCountError(
                f"JAX already started on {jax.default_backend()}, so simulate_devices({n}, force_cpu=True) comes "
                "too late. Restart the kernel (or process) and call it first."
            )
        if cores_as_devices != device_summary().cores_as_devices:
            raise DeviceCountError(
                f"JAX already started {'without' if cores_as_devices else 'with'} one core per device, so "
                f"simulate_devices({n}, cores_as_devices={cores_as_devices}) comes too late. Restart the kernel "
                "(or process) and call it first."
            )
        have = len(jax.devices("cpu"))
        if have != n:
            raise DeviceCountError(
                f"JAX already started with {have} CPU device(s), so simulate_devices({n}) "
                "comes too late: the count is fixed at the first JAX operation. "
                f"Restart the kernel (or process) and call pk.simulate_devices({n}) first, "
                "before anything else touches JAX."
            )
        return jax.devices()
    if cores_as_devices:
        os.environ[_POOL_SIZE_VAR] = str(n)  # read when the backend starts, just below
    configure_cpu_devices(n)
    if force_cpu:
        jax.config.update("jax_platforms", "cpu")
    with quiet_libtpu():
        devices = jax.devices()
    if devices[0].platform == "cpu" and len(devices) != n:
        raise DeviceCountError(f"Asked for {n} simulated CPU devices but JAX made {len(devices)}.")
    return devices


@contextlib.contextmanager
def quiet_libtpu() -> Iterator[None]:
    """For the block, where libtpu is installed on a machine with no TPU chip: :data:`NO_TPU_VM`'s variables.

    libtpu reads them when it starts (with JAX's backends, or at the first TPU topology
    :mod:`parallelkit.measure.aot` asks for); they keep it from printing errors about the TPU
    VM it cannot find, and from refusing to start beside another process that started it. The
    variables it set are removed after the block: left in the environment, they would tell JAX's
    and the kit's cluster detection that this host is a Cloud TPU worker, in this process and in
    every process it starts. A machine with TPU chips, or without libtpu, is left as it is.
    """
    if importlib.util.find_spec("libtpu") is None or _tpu_chips() > 0:
        yield
        return
    added = {key: value for key, value in NO_TPU_VM.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _tpu_chips() -> int:
    """The TPU chips attached to this machine through PCI, found as JAX finds them when it starts.

    JAX's own count lives in a private module (``hardware_utils``), so this repeats its scan: PCI
    devices of Google's vendor id whose device id is a TPU's (v3 to TPU7x). A Google VM's
    network card shares the vendor id, not a device id.
    """
    chips = 0
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            chips += (Path(vendor).parent / "device").read_text().strip() in _TPU_PCI_DEVICES
        except OSError:  # a device that went away, or a file this user may not read
            continue
    return chips


_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = ("0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076")  # v3 .. TPU7x


def configure_cpu_devices(n: int) -> None:
    """Before JAX starts: ``n`` CPU devices, and a CPU thread pool large enough for them.

    Sets the device count for this process (``jax_num_cpu_devices``) and for its
    subprocesses (``XLA_FLAGS``), and raises ``PJRT_NPROC`` to ``2 n`` where the core
    count is smaller (never lowers it, and keeps a value the user set). docs/training.md
    ("A plain loop is safe") says why a loop on simulated devices needs the threads.
    """
    flags = re.sub(rf"{_FORCE_COUNT_FLAG}=\S*", "", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FORCE_COUNT_FLAG}={n}".strip()
    if 2 * n > _cores() and _POOL_SIZE_VAR not in os.environ:
        os.environ[_POOL_SIZE_VAR] = str(2 * n)
    jax.config.update("jax_num_cpu_devices", n)


def _cores() -> int:
    """The cores this process may run on (XLA's default pool size)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_devices(devices: int | Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices a strategy runs on: all of them, the first ``n``, or a given list.

    Raises:
      DeviceCountError: more devices asked for than JAX has.
      ValueError: an empty list, a count below 1, or a device listed twice.
      TypeError: a list holding something other than devices.
    """
    available = jax.devices()
    if devices is None:
        return list(available)
    if isinstance(devices, int | np.integer) and not isinstance(devices, bool):
        devices = int(devices)
        if devices < 1:
            raise ValueError(f"A strategy needs at least one device, got devices={devices}.")
        if devices > len(available):
            raise DeviceCountError(
                f"Asked for {devices} devices but JAX has {len(available)} "
                f"({available[0].platform}). On a CPU, call pk.simulate_devices({devices}) "
                "in a fresh kernel before using JAX, or ask for fewer devices."
            )
        return list(available[:devices])
    chosen = list(devices)
    if not chosen:
        raise ValueError("A strategy needs at least one device, got an empty list.")
    if not all(isinstance(d, jax.Device) for d in chosen):
        wrong = next(d for d in chosen if not isinstance(d, jax.Device))
        raise TypeError(
            f"devices holds {wrong!r}, which is not a JAX device: pass devices such as jax.devices()[:2], "
            "or a count such as 2."
        )
    if len(set(chosen)) < len(chosen):
        twice = sorted({d.id for d in chosen if chosen.count(d) > 1})
        raise ValueError(
            f"devices lists device {', '.join(map(str, twice))} more than once; each device can hold one part of "
            "the work. Pass distinct devices, such as jax.devices()[:2]."
        )
    return chosen


def first_devices(
    group: int, replicas: int, spell: Callable[[int], str], sizes: str, who: str | None = None
) -> list[jax.Device]:
    """The first ``group x replicas`` devices, for a strategy whose arguments fix their count; warns if some stay idle.

    Args:
      group: devices to a replica (``model`` for ``Hybrid(data, model)``).
      replicas: how many replicas (``data``).
      spell: the strategy as its user writes it for a number of replicas (``lambda d: f"Hybrid(data={d}, model=2)"``);
        the warning offers ``spell(n // group)`` to use all ``n`` devices where they divide into such groups.
      sizes: otherwise it offers these sizes, whose product must be ``n`` (``"data x model"``).
      who: the strategy, for the warning; ``spell(replicas)`` by default.

    Raises:
      DeviceCountError: more devices than JAX has.

    Warns:
      DeviceSubsetWarning: fewer than all of JAX's devices, naming the idle ones.

    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     chosen = first_devices(1, 4, lambda d: f"Hybrid(data={d}, model=1)", "data x model")
    >>> str(caught[0].message).split("or use every device ")[1]
    '(Hybrid(data=8, model=1)).'
    """
    count = group * replicas
    chosen = resolve_devices(count)
    idle = jax.devices()[count:]
    if idle:
        total = len(jax.devices())
        instead = spell(total // group) if total % group == 0 else f"{sizes} = {total}"
        warnings.warn(
            f"{who or spell(replicas)} runs on {count} of the {total} devices, so {_device_list(idle)} stay idle. "
            f"Pass devices=jax.devices()[:{count}] to say that this is meant (and silence this warning), "
            f"or use every device ({instead}).",
            DeviceSubsetWarning,
            stacklevel=3,  # the strategy's constructor called this; point at its caller
        )
    return chosen


def warn_if_shared(parts: int, devices: Sequence[jax.Device], who: str, what: str) -> None:
    """Warn when ``parts`` placed in turn on ``devices`` (part ``j`` on device ``j % n``) put two on one device.

    Warns:
      DeviceSubsetWarning: naming the devices that hold more than one part.
    """
    n = len(devices)
    if parts <= n:
        return
    shared = devices[: min(parts - n, n)]
    held = ", ".join(map(str, range(0, parts, n)))
    warnings.warn(
        f"{who} places {parts} {what} on {n} devices in turn, so {what} share {_device_list(shared)} "
        f"(device {shared[0].id} holds {what} {held}). Pass devices= to say that this is meant "
        f"(and silence this warning), or use at most {n} {what}.",
        DeviceSubsetWarning,
        stacklevel=3,
    )


def _device_list(devices: Sequence[jax.Device], most: int = 8) -> str:
    """Devices by platform and id, for a message: ``'cpu devices 6, 7'`` (the first ``most``, then a count).

    >>> _device_list(jax.devices()[:1])
    'cpu device 0'
    """
    ids = ", ".join(str(d.id) for d in devices[:most])
    more = f" and {len(devices) - most} more" if len(devices) > most else ""
    return f"{devices[0].platform} device{'s' if len(devices) > 1 else ''} {ids}{more}"


@dataclass(frozen=True)
class DeviceSummary:
    """What JAX runs on, for printing at the top of a notebook."""

    platform: str
    device_count: int
    local_device_count: int
    process_index: int
    process_count: int
    device_kinds: tuple[str, ...]
    simulated: bool
    cores: int = 1  # the cores this process may use
    cores_as_devices: bool = False  # simulated devices with one core's worth of threads each

    def __str__(self) -> str:
        kind = "simulated CPU devices" if self.simulated else f"{self.platform} devices"
        return (
            f"{self.device_count} {kind} ({', '.join(sorted(set(self.device_kinds)))}); "
            f"process {self.process_index} of {self.process_count}, "
            f"{self.local_device_count} local" + (f"; {self.simulation}" if self.simulated else "")
        )

    @property
    def simulation(self) -> str:
        """How the simulated devices use the cores, and what their times can show."""
        if self.cores_as_devices:
            return (
                f"cores as devices: one core each ({self.local_device_count} of {self.cores} cores); "
                "a speed-up needs one device on the same cores as its yardstick"
            )
        return f"sharing {self.cores} core(s): times show overhead, not speed-up"


def device_summary() -> DeviceSummary:
    """Platform, device counts and process position of this JAX program.

    >>> summary = device_summary()
    >>> summary.device_count >= 1
    True
    """
    devices = jax.devices()
    platform = devices[0].platform
    return DeviceSummary(
        platform=platform,
        device_count=len(devices),
        local_device_count=jax.local_device_count(),
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        device_kinds=tuple(d.device_kind for d in devices),
        simulated=platform == "cpu" and len(devices) > 1,
        cores=_cores(),
        cores_as_devices=platform == "cpu" and os.environ.get(_POOL_SIZE_VAR) == str(jax.local_device_count()),
    )
