"""Cluster resolution and preflight checks: pure Python, no cluster is started here.

The pytest process never calls ``jax.distributed``; what needs a started JAX runs in a subprocess.
"""

from __future__ import annotations

import json
import logging
import socket

import pytest
from helpers import run_python

from parallelkit.run.distributed import ClusterError, resolve_cluster
from parallelkit.run.distributed import runtime as pk_runtime
from parallelkit.run.distributed.cluster import ClusterSpec, check_coordinator
from parallelkit.run.distributed.launcher import free_port

PS3 = "ps0:2222,ps1:2222,ps2:2222"
WORKERS3 = "w0:2222,w1:2222,w2:2222"


def tf(job, index, workers=WORKERS3, ps=PS3):
    return resolve_cluster(worker_hosts=workers, ps_hosts=ps, job_name=job, task_index=index, env={})


def test_explicit_arguments_win_over_everything():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})}
    spec = resolve_cluster("head-node:1234", 4, 3, worker_hosts="x:1", job_name="worker", task_index=0, env=env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == (
        "head-node:1234",
        4,
        3,
        "explicit",
    )


@pytest.mark.parametrize(
    "args, match",
    [
        (("h:1", 2, None), "process_id missing"),
        (("h:1", 2, 2), "out of range for 2 processes"),
        (("h:1", 2, -1), "out of range"),
        (("h:1", 0, 0), "at least one process"),
    ],
)
def test_explicit_arguments_are_checked(args, match):
    with pytest.raises(ClusterError, match=match):
        resolve_cluster(*args, env={})


def test_three_ps_and_three_workers_map_to_six_distinct_processes():
    specs = {(job, i): tf(job, i) for job in ("worker", "ps") for i in range(3)}
    # Workers first (worker 0 is the chief and hosts the coordinator), then the parameter servers.
    assert {key: s.process_id for key, s in specs.items()} == {
        ("worker", 0): 0, ("worker", 1): 1, ("worker", 2): 2, ("ps", 0): 3, ("ps", 1): 4, ("ps", 2): 5,
    }  # fmt: skip
    for (job, i), spec in specs.items():
        assert spec.num_processes == 6 and spec.coordinator_address == "w0:2222"
        assert (spec.role, spec.task_index, spec.source) == (job, i, "tf_flags")
        assert spec.hosts == ("w0:2222", "w1:2222", "w2:2222", "ps0:2222", "ps1:2222", "ps2:2222")


@pytest.mark.parametrize(
    "workers, ps, job, index, expected",
    [
        ("solo:2222", None, "worker", 0, (0, 1)),  # one worker, no ps
        (["a:1", "b:1"], [], "worker", 1, (1, 2)),  # lists work as well as comma strings
        ("a:1,b:1", "p:1", "ps", 0, (2, 3)),  # 2 workers + 1 ps
        ("a:1", "p:1,q:1", "ps", 1, (2, 3)),  # more ps than workers
    ],
)
def test_tf_flag_shapes(workers, ps, job, index, expected):
    spec = tf(job, index, workers, ps)
    assert (spec.process_id, spec.num_processes) == expected
    assert spec.coordinator_address == (workers if isinstance(workers, str) else ",".join(workers)).split(",")[0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"worker_hosts": "a:1,b:1", "job_name": "worker", "task_index": 2}, "Task index 2 is out of range"),
        ({"worker_hosts": "a:1,a:1", "job_name": "worker", "task_index": 0}, "Duplicate host:port 'a:1'"),
        ({"worker_hosts": "a:1", "ps_hosts": "a:1", "job_name": "ps", "task_index": 0}, "Duplicate"),
        ({"worker_hosts": "a:1", "job_name": "evaluator", "task_index": 0}, "not one of"),
        ({"worker_hosts": "a:1", "task_index": 0}, "job_name missing"),
        ({"ps_hosts": "p:1"}, "worker_hosts, job_name, task_index missing"),
        ({"worker_hosts": "a", "job_name": "worker", "task_index": 0}, "needs a port"),
    ],
)
def test_tf_flags_errors(kwargs, match):
    with pytest.raises(ClusterError, match=match):
        resolve_cluster(env={}, **kwargs)


def test_tf_config_with_chief_workers_and_ps():
    cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222", "p1:2222", "p2:2222"]}
    ids = []
    for role, count in (("chief", 1), ("worker", 2), ("ps", 3)):
        for i in range(count):
            env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": i}})}
            spec = resolve_cluster(env=env)
            assert spec.source == "TF_CONFIG" and spec.num_processes == 6 and spec.coordinator_address == "c:2222"
            ids.append(spec.process_id)
    assert ids == list(range(6))  # chief, workers, then ps


def test_tf_flags_win_over_tf_config():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})}
    assert resolve_cluster(worker_hosts="x:1", job_name="worker", task_index=0, env=env).source == "tf_flags"
    assert resolve_cluster(env=env).process_id == 1


@pytest.mark.parametrize("config", ["{not json", json.dumps({"cluster": {"worker": ["a:1"]}}), json.dumps([1])])
def test_malformed_tf_config(config):
    with pytest.raises(ClusterError, match="TF_CONFIG is not valid"):
        resolve_cluster(env={"TF_CONFIG": config})


def test_launcher_environment_comes_after_explicit_arguments():
    env = {"PK_COORDINATOR": "127.0.0.1:5000", "PK_NUM_PROCESSES": "3", "PK_PROCESS_ID": "2", "PK_LOCAL_DEVICES": "2"}
    spec = resolve_cluster(env=env)
    assert (spec.source, spec.process_id, spec.num_processes, spec.local_devices) == ("launcher", 2, 3, 2)
    assert resolve_cluster("h:1", 1, 0, env=env).source == "explicit"
    with pytest.raises(ClusterError, match="out of range"):
        resolve_cluster(env={**env, "PK_PROCESS_ID": "3"})


@pytest.mark.parametrize(
    "env, source",
    [
        ({"SLURM_JOB_ID": "17"}, "auto (SLURM)"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1"}, "auto (Kubernetes)"),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "auto (Open MPI)"),
        ({}, "single"),
    ],
)
def test_scheduler_detection_is_left_to_jax(env, source):
    spec = resolve_cluster(env=env)
    assert spec.source == source
    assert spec.coordinator_address is None


def test_any_pod_is_not_a_cluster():
    """Every Kubernetes pod has KUBERNETES_SERVICE_HOST (a JupyterHub notebook too): alone it means one process."""
    spec = resolve_cluster(env={"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    assert spec.source == "single" and spec.is_single_process


def test_initialize_logs_what_it_resolved_and_from_where(monkeypatch, caplog):
    for var in ("TF_CONFIG", "PK_COORDINATOR", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(pk_runtime, "_joined", None)
    with caplog.at_level(logging.INFO, logger="parallelkit.run.distributed"):
        spec = pk_runtime.initialize()  # single process: jax.distributed is not called
    assert spec.is_single_process
    assert "parallelkit cluster: single process" in caplog.text
    with caplog.at_level(logging.INFO, logger="parallelkit.run.distributed"):
        described = tf("ps", 2).describe()
    assert described == "process 5 of 6, ps task 2, coordinator w0:2222 (from tf_flags)"


@pytest.mark.timeout(30)  # a bound that cannot flake: the check gives up after its 1 s
def test_unresolvable_coordinator_is_an_error():
    spec = ClusterSpec("no-such-host.invalid:1234", 2, 1, "explicit")
    with pytest.raises(ClusterError, match="did not resolve within 1 s"):
        check_coordinator(spec, timeout=1)  # retried until the timeout: DNS records can appear late


@pytest.mark.timeout(30)
def test_unreachable_coordinator_fails_within_the_timeout():
    spec = ClusterSpec(f"127.0.0.1:{free_port()}", 2, 1, "explicit")  # nobody listens there
    with pytest.raises(ClusterError, match="could not reach the coordinator .* within 1 s"):
        check_coordinator(spec, timeout=1)


def test_second_process_zero_is_reported_as_a_duplicate_id():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = ClusterSpec(f"127.0.0.1:{taken.getsockname()[1]}", 2, 0, "explicit")
        with pytest.raises(ClusterError, match="duplicate id"):
            check_coordinator(spec, timeout=1)


@pytest.mark.timeout(60)
def test_joining_after_jax_started_is_an_error():
    code = """
import jax
jax.devices()  # JAX starts here
try:
    pk.distributed.initialize("127.0.0.1:1", 2, 1, local_devices=2)
except pk.distributed.ClusterError as err:
    print("cluster:", err)
try:
    pk.distributed.initialize(local_devices=4)  # single process, but the device count is already fixed
except pk.DeviceCountError as err:
    print("devices:", err)
"""
    env_free = "import os\nfor v in ('TF_CONFIG', 'PK_COORDINATOR', 'SLURM_JOB_ID'): os.environ.pop(v, None)\n"
    result = run_python("import parallelkit as pk\n" + env_free + code, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "cluster: JAX has already started" in result.stdout
    assert "devices: JAX already started with 1 CPU device(s)" in result.stdout
