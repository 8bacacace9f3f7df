"""Where this process sits in a cluster: resolving it (:func:`resolve_cluster`), checking it, joining it."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Environment variables the parallelkit launcher sets for each child process.
ENV_COORDINATOR = "PK_COORDINATOR"
ENV_NUM_PROCESSES = "PK_NUM_PROCESSES"
ENV_PROCESS_ID = "PK_PROCESS_ID"
ENV_LOCAL_DEVICES = "PK_LOCAL_DEVICES"
ENV_INIT_TIMEOUT = "PK_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "PK_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "PK_SHUTDOWN_TIMEOUT"
ENV_READY_FILE = "PK_READY_FILE"
ENV_LAUNCHER_PID = "PK_LAUNCHER_PID"  # each child exits when this process is gone

# TF_CONFIG task types that become JAX processes, in process-id order.
_TF_ROLES = ("chief", "worker", "ps")

# Environment variables by which JAX's own cluster detection recognises a cluster.
# Kubernetes sets KUBERNETES_SERVICE_HOST in *every* pod (a JupyterHub notebook too),
# so only a pod of an Indexed Job (what JAX's Kubernetes detection bootstraps from)
# counts, and it needs both variables.
_AUTO_MARKERS = {
    ("SLURM_JOB_ID",): "SLURM",
    ("OMPI_COMM_WORLD_SIZE",): "Open MPI",
    ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"): "Kubernetes",
    ("TPU_WORKER_HOSTNAMES",): "Cloud TPU",
}


class ClusterError(RuntimeError):
    """The cluster description is inconsistent, or this process cannot join it."""


@dataclass(frozen=True)
class ClusterSpec:
    """This process's place in the cluster, and where that was learned.

    ``None`` fields are left to JAX's own detection (``source == "auto"``).
    """

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    source: str  # "explicit", "launcher", "tf_flags", "TF_CONFIG", "auto" or "single"
    role: str | None = None  # the TF task type ("chief", "worker", "ps") when there is one
    task_index: int | None = None
    local_devices: int | None = None  # simulated CPU devices per process
    hosts: tuple[str, ...] = field(default=())  # every task's address, in process-id order

    @property
    def is_single_process(self) -> bool:
        return self.source == "single"

    def describe(self) -> str:
        """One line for the log: what was resolved and from where."""
        if self.is_single_process:
            return "single process (no cluster found: no arguments, launcher, TF flags, TF_CONFIG or scheduler)"
        role = f", {self.role} task {self.task_index}" if self.role else ""
        devices = f", {self.local_devices} local devices" if self.local_devices else ""
        return (
            f"process {self.process_id} of {self.num_processes}{role}, coordinator "
            f"{self.coordinator_address}{devices} (from {self.source})"
        )


def _hosts(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [h.strip() for h in items if h.strip()]


def _check_position(process_id: int, num_processes: int, where: str) -> None:
    if num_processes < 1:
        raise ClusterError(f"A cluster needs at least one process, but {where} gives num_processes={num_processes}.")
    if not 0 <= process_id < num_processes:
        raise ClusterError(
            f"Process id {process_id} is out of range for {num_processes} processes ({where}). "
            f"Give each process a distinct id from 0 to {num_processes - 1}."
        )


def _from_task_lists(
    cluster: Mapping[str, Sequence[str]], role: str, index: int, where: str, source: str, local_devices: int | None
) -> ClusterSpec:
    unknown = sorted(set(cluster) - set(_TF_ROLES))
    if unknown:
        log.warning("Ignoring TF task types %s: only %s become JAX processes.", unknown, _TF_ROLES)
    if role not in _TF_ROLES:
        raise ClusterError(f"job_name/task type {role!r} is not one of {_TF_ROLES}, so it has no JAX process id.")
    tasks = [(r, i, host) for r in _TF_ROLES for i, host in enumerate(_hosts(cluster.get(r)))]
    if not tasks:
        raise ClusterError(f"The cluster from {where} lists no chief, worker or ps hosts.")
    hosts = [host for _, _, host in tasks]
    twice = [host for i, host in enumerate(hosts) if host in hosts[:i]]
    if twice:
        raise ClusterError(
            f"Duplicate host:port {twice[0]!r}: two processes would claim the same place and the cluster "
            "would wait forever for the missing one. Give every process its own host:port."
        )
    count = len(_hosts(cluster.get(role)))
    if not 0 <= index < count:
        raise ClusterError(
            f"Task index {index} is out of range: {where} lists {count} {role} host(s). "
            f"Use a task index from 0 to {max(count - 1, 0)}."
        )
    process_id = next(p for p, (r, i, _) in enumerate(tasks) if (r, i) == (role, index))
    coordinator = hosts[0]
    if ":" not in coordinator:
        raise ClusterError(
            f"The first task's address {coordinator!r} needs a port (host:port) to host the coordinator."
        )
    return ClusterSpec(coordinator, len(tasks), process_id, source, role, index, local_devices, tuple(hosts))


def resolve_cluster(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_devices: int | None = None,
    ps_hosts: str | Sequence[str] | None = None,
    worker_hosts: str | Sequence[str] | None = None,
    job_name: str | None = None,
    task_index: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ClusterSpec:
    """Work out this process's place in the cluster, without touching JAX or the network.

    Args:
      coordinator_address, num_processes, process_id: explicit values, as for
        ``jax.distributed.initialize``. Given all three, they win over everything else.
      local_devices: simulated CPU devices for this process (the launcher sets it).
      ps_hosts, worker_hosts: TensorFlow-style comma-separated ``host:port`` lists.
      job_name, task_index: this process's TF task (``"worker"`` or ``"ps"``) and index.
      env: the environment to read (``os.environ`` by default), for tests.

    Returns:
      A :class:`ClusterSpec`; its ``source`` says where it came from.

    Raises:
      ClusterError: an incomplete or inconsistent description (say what to fix).

    >>> spec = resolve_cluster(worker_hosts="w0:2222,w1:2222", ps_hosts="ps0:2222", job_name="ps", task_index=0, env={})
    >>> spec.process_id, spec.num_processes, spec.coordinator_address
    (2, 3, 'w0:2222')
    """
    env = os.environ if env is None else env
    explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in explicit.values()):
        missing = [name for name, v in explicit.items() if v is None]
        if missing:
            raise ClusterError(
                f"Explicit cluster arguments are incomplete: {', '.join(missing)} missing. Give all three, "
                "or none to let the launcher, TF flags, TF_CONFIG or the scheduler describe the cluster."
            )
        _check_position(process_id, num_processes, "the explicit arguments")
        return ClusterSpec(coordinator_address, num_processes, process_id, "explicit", local_devices=local_devices)

    if ENV_COORDINATOR in env:
        try:
            n, pid = int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID])
        except (KeyError, ValueError) as err:
            raise ClusterError(f"{ENV_COORDINATOR} is set but {err} is missing or not a number.") from err
        _check_position(pid, n, "the launcher environment")
        devices = local_devices or (int(env[ENV_LOCAL_DEVICES]) if env.get(ENV_LOCAL_DEVICES) else None)
        return ClusterSpec(env[ENV_COORDINATOR], n, pid, "launcher", local_devices=devices)

    tf_flags = {"ps_hosts": ps_hosts, "worker_hosts": worker_hosts, "job_name": job_name, "task_index": task_index}
    if any(v not in (None, "", []) for v in tf_flags.values()):
        missing = [k for k in ("worker_hosts", "job_name", "task_index") if tf_flags[k] in (None, "", [])]
        if missing:
            raise ClusterError(
                f"TensorFlow-style cluster flags are incomplete: {', '.join(missing)} missing. "
                "Pass --worker_hosts, --job_name and --task_index (and --ps_hosts if there are parameter servers)."
            )
        cluster = {"worker": _hosts(worker_hosts), "ps": _hosts(ps_hosts)}
        where = "the ps_hosts/worker_hosts flags"
        return _from_task_lists(cluster, job_name, int(task_index), where, "tf_flags", local_devices)

    if env.get("TF_CONFIG"):
        try:
            config = json.loads(env["TF_CONFIG"])
            cluster, task = config["cluster"], config["task"]
            return _from_task_lists(cluster, task["type"], int(task["index"]), "TF_CONFIG", "TF_CONFIG", local_devices)
        except (ValueError, KeyError, TypeError) as err:
            raise ClusterError(
                f"TF_CONFIG is not valid ({type(err).__name__}: {err}). It must be JSON like "
                '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}.'
            ) from err

    detected = [name for names, name in _AUTO_MARKERS.items() if all(var in env for var in names)]
    if detected:
        return ClusterSpec(None, None, None, f"auto ({', '.join(detected)})", local_devices=local_devices)
    return ClusterSpec(None, 1, 0, "single", local_devices=local_devices)


def _split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; IPv6 hosts in brackets (``[::1]:1234``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterError(f"Coordinator address {address!r} needs the form host:port, for example 127.0.0.1:12345.")
    return host.strip("[]"), int(port)


def check_coordinator(spec: ClusterSpec, timeout: float) -> None:
    """Preflight: the coordinator's name resolves, and (for non-coordinators) its port answers in time.

    Without this a typo in the address or a coordinator that never came up shows
    as a silent wait and then an abort; here it is one sentence.

    Raises:
      ClusterError: the name does not resolve, or nothing listens there, within ``timeout`` seconds.
    """
    host, port = _split_address(spec.coordinator_address)
    deadline = time.monotonic() + timeout
    while True:  # a new pod's DNS record (Kubernetes headless service) may appear a little late
        try:
            socket.getaddrinfo(host, port)
            break
        except socket.gaierror as err:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"The coordinator address {spec.coordinator_address!r} ({spec.source}) did not resolve within "
                    f"{timeout:g} s: {err}. Check the host name (and DNS, or the headless service on Kubernetes)."
                ) from err
            time.sleep(min(1.0, max(deadline - time.monotonic(), 0.0)))
    if spec.process_id == 0:  # process 0 starts the coordinator: its port must be free here
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("" if host not in ("127.0.0.1", "::1", "localhost") else host, port))
            except OSError as err:
                raise ClusterError(
                    f"Process 0 cannot start the coordinator on port {port} ({err}). Another program holds it, "
                    "or two processes claim process id 0 (a duplicate id): give each process its own id, "
                    "or choose another port."
                ) from err
        return
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"Process {spec.process_id} could not reach the coordinator at {spec.coordinator_address} "
                    f"within {timeout:g} s ({err}). Check that process 0 is running and that the port is open."
                ) from err
            time.sleep(0.2)
