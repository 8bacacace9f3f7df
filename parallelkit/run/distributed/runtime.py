"""Joining the cluster: preflight checks, then ``jax.distributed.initialize``."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from .cluster import (
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_LAUNCHER_PID,
    ENV_READY_FILE,
    ENV_SHUTDOWN_TIMEOUT,
    ClusterError,
    ClusterSpec,
    check_coordinator,
    resolve_cluster,
)

log = logging.getLogger(__name__)

# JAX's defaults are 300 s (init), 100 s (heartbeat), 300 s (shutdown): a lost peer
# then looks like a hang for minutes. Ours are shorter; the launcher's shorter still.
_DEFAULT_INIT_TIMEOUT = 60
_DEFAULT_HEARTBEAT_TIMEOUT = 30
_DEFAULT_SHUTDOWN_TIMEOUT = 60

_joined: ClusterSpec | None = None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_devices: int | None = None,
    ps_hosts: str | Sequence[str] | None = None,
    worker_hosts: str | Sequence[str] | None = None,
    job_name: str | None = None,
    task_index: int | None = None,
    initialization_timeout: int | None = None,
    heartbeat_timeout: int | None = None,
    shutdown_timeout: int | None = None,
) -> ClusterSpec:
    """Join the cluster this process belongs to; call it once, before any JAX work.

    Resolves the cluster (see :func:`resolve_cluster` for the order of sources) and
    logs what it found and where; joins it (preflight checks, then
    ``jax.distributed.initialize``); and guards it: an uncaught exception then ends the
    process at once instead of leaving its peers waiting for it. With no cluster found
    it joins nothing and the program runs as one process (with ``local_devices`` CPU
    devices if asked). Calling it again with the same cluster is a no-op.

    Conceptually, this is::

        jax.distributed.initialize(coordinator_address, num_processes, process_id)

    with the arguments found for you and the classic hangs turned into errors.

    Args:
      coordinator_address, num_processes, process_id: explicit cluster, as for JAX.
      local_devices: on CPU, simulate this many devices in this process.
      ps_hosts, worker_hosts, job_name, task_index: TensorFlow-style cluster flags.
      initialization_timeout: seconds to wait for every process to join (default 60,
        or the launcher's ``PK_INIT_TIMEOUT``).
      heartbeat_timeout: seconds without a heartbeat before a peer counts as dead (default 30).
      shutdown_timeout: seconds to wait for the others at exit (default 60).

    Returns:
      The :class:`ClusterSpec` joined.

    Raises:
      ClusterError: inconsistent description, JAX already started, coordinator
        unresolvable or unreachable within ``initialization_timeout``, id out of range.
      DeviceCountError: ``local_devices`` asked for after JAX started with another count.
    """
    global _joined
    spec = resolve_cluster(
        coordinator_address,
        num_processes,
        process_id,
        local_devices=local_devices,
        ps_hosts=ps_hosts,
        worker_hosts=worker_hosts,
        job_name=job_name,
        task_index=task_index,
    )
    log.info("parallelkit cluster: %s", spec.describe())
    _exit_with_launcher()
    if _joined is not None:
        return _same_cluster(spec, _joined)
    if spec.is_single_process:  # nothing to join; on CPU, perhaps devices to simulate
        _simulate_alone(spec)
        _joined = spec
    else:
        _join(spec, initialization_timeout, heartbeat_timeout, shutdown_timeout)
        _joined = spec
        _check_joined(spec)
        _exit_at_once_on_uncaught_exceptions()
    _mark("joined")
    return spec


def _env_int(name: str, default: int) -> int:
    return int(os.environ[name]) if os.environ.get(name) else default


def _same_cluster(spec: ClusterSpec, joined: ClusterSpec) -> ClusterSpec:
    """The cluster this process already joined, when ``spec`` is that cluster; a clear error otherwise."""
    if spec != joined:
        raise ClusterError(
            f"This process already joined a cluster ({joined.describe()}); it cannot join another "
            f"({spec.describe()}). Restart the process to change clusters."
        )
    return joined


def _simulate_alone(spec: ClusterSpec) -> None:
    """One process: simulate ``spec.local_devices`` CPU devices if asked (a DeviceCountError when too late)."""
    from ...core.devices import simulate_devices

    if spec.local_devices:
        simulate_devices(spec.local_devices)


def _join(
    spec: ClusterSpec, initialization_timeout: int | None, heartbeat_timeout: int | None, shutdown_timeout: int | None
) -> None:
    """``jax.distributed.initialize`` for ``spec``, guarded: refused once JAX has started, the coordinator checked
    first, and a process whose cluster does not form within the timeout ended with a message saying why."""
    from ...core.devices import backends_started, configure_cpu_devices

    init_timeout = initialization_timeout or _env_int(ENV_INIT_TIMEOUT, _DEFAULT_INIT_TIMEOUT)
    heartbeat = heartbeat_timeout or _env_int(ENV_HEARTBEAT_TIMEOUT, _DEFAULT_HEARTBEAT_TIMEOUT)
    shutdown = shutdown_timeout or _env_int(ENV_SHUTDOWN_TIMEOUT, _DEFAULT_SHUTDOWN_TIMEOUT)
    if backends_started():
        raise ClusterError(
            "JAX has already started (something ran a computation or listed devices), so this process can no "
            "longer join a cluster. Call pk.distributed.initialize() first thing in the program, before any JAX work."
        )
    _mark("started")
    if spec.coordinator_address is not None:
        check_coordinator(spec, timeout=init_timeout)

    import jax

    if spec.local_devices:
        # simulate_devices would list the devices, which starts JAX too early for
        # jax.distributed: set the count now, check it once the cluster is up.
        configure_cpu_devices(spec.local_devices)
    # CPU devices of different processes talk through gloo (it only affects the CPU backend).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX aborts (SIGABRT, a C++ log) a few seconds after its own timeout; say why first, and exit cleanly.
    watchdog = threading.Timer(init_timeout, _cluster_did_not_form, args=(spec, init_timeout))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            initialization_timeout=init_timeout,
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=shutdown,
        )
    finally:
        watchdog.cancel()


def _check_joined(spec: ClusterSpec) -> None:
    """Once the cluster is up: the CPU device count set before JAX started checked, and the cluster logged."""
    import jax

    from ...core.devices import DeviceCountError

    got = jax.local_device_count()
    if spec.local_devices and jax.local_devices()[0].platform == "cpu" and got != spec.local_devices:
        raise DeviceCountError(f"Asked for {spec.local_devices} CPU devices per process, got {got}.")
    log.info(
        "parallelkit cluster joined: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def _exit_with_launcher(poll_seconds: float = 0.5) -> None:
    """Under the parallelkit launcher, end this process as soon as the launcher is gone.

    The last of the safeguards docs/multi_host.md lists for the launcher, for SIGKILL of the launcher
    on other systems and a process started by a child: it ends this process when the launcher's
    pid no longer exists (seen from any descendant) or when this process's parent changes (a dead
    parent hands its children to another, at once, even while the dead launcher awaits its reaper).
    """
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if not launcher or any(t.name == "pk-launcher-watch" for t in threading.enumerate()):
        return

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            try:
                os.kill(int(launcher), 0)  # signal 0: only asks whether the launcher exists
            except ProcessLookupError:
                break
            except PermissionError:  # it exists, under another user
                pass
            time.sleep(poll_seconds)
        print("parallelkit: the launcher is gone; ending this cluster process.", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="pk-launcher-watch", daemon=True).start()


def _cluster_did_not_form(spec: ClusterSpec, seconds: float) -> None:
    print(
        f"parallelkit: the cluster did not form within {seconds:g} s: this is {spec.describe()}, and not all "
        f"{spec.num_processes} processes joined. One never started, crashed before pk.distributed.initialize(), "
        "or was given another coordinator address or process count. Exiting.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _mark(stage: str) -> None:
    """Tell a watching launcher how far this process got ("started" joining, "joined"), so it names the laggard."""
    prefix = os.environ.get(ENV_READY_FILE)
    if prefix:
        Path(f"{prefix}.{stage}").touch()


def _exit_at_once_on_uncaught_exceptions() -> None:
    """An uncaught exception ends this cluster process at once, with exit code 1.

    Otherwise Python's exit would run JAX's shutdown barrier, which waits for peers
    that are themselves blocked in a collective with this process: every process
    hangs until a timeout and then aborts, and the exception looks like a crash.
    Exiting at once turns it into a dead peer, which JAX and the launcher detect
    quickly. The traceback is printed first, as usual.
    """
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = hook
