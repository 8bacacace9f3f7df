"""The local launcher and its faults, on real 2-process clusters (127.0.0.1, gloo).

Every test carries a hard timeout, so a hang fails instead of stalling CI. Times
that the launcher promises are asserted: a dead process is reported within a
couple of seconds, a missing one within its init timeout.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import ROOT

import parallelkit as pk
from parallelkit.distributed import LaunchError

pytestmark = pytest.mark.multihost

# One script for every fault: FAULT=<kind>:<process> picks what goes wrong, and where.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import parallelkit as pk

    fault, _, victim = os.environ.get("FAULT", "none:-1").partition(":")
    me = int(os.environ["PK_PROCESS_ID"])
    if fault == "never_join" and me == int(victim):
        time.sleep(600)  # stands in for a process that never starts
    pk.distributed.initialize()

    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("data",))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    x = jax.make_array_from_callback((jax.device_count(),), NamedSharding(mesh, P("data")), lambda i: np.ones(4)[i])
    print(f"process {jax.process_index()} of {jax.process_count()}: psum={float(total(x).addressable_data(0))}",
          "args:", sys.argv[1:], flush=True)
    for step in range(int(os.environ.get("STEPS", "3"))):
        if me == int(victim) and step == 1:
            if fault == "kill":
                os.kill(os.getpid(), 9)
            if fault == "raise":
                raise ValueError("bad batch at step 1")
            if fault == "hang":
                time.sleep(600)
        float(total(x).addressable_data(0))  # a collective every step: a lost peer blocks it
        time.sleep(float(os.environ.get("STEP_SECONDS", "0.05")))
    """
)


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch") / "job.py"
    path.write_text(SCRIPT)
    return path


def run(script, fault="none:-1", **options):
    env = {"FAULT": fault, **options.pop("env", {})}
    options = {"timeout": 60, "init_timeout": 10, "heartbeat_timeout": 5, "stream": False, **options}
    start = time.monotonic()
    try:
        return pk.distributed.launch([sys.executable, str(script)], 2, 2, env=env, **options), None, start
    except LaunchError as err:
        return None, err, start


@pytest.mark.timeout(60)
def test_run_local_returns_each_process_result():
    def where():
        import jax

        return jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count()

    assert pk.distributed.run_local(where, 2, 2, timeout=40, stream=False) == [(0, 2, 2, 4), (1, 2, 2, 4)]


@pytest.mark.timeout(60)
def test_cli_launch_streams_prefixed_output_and_passes_arguments(script):
    result = subprocess.run(
        [sys.executable, "-m", "parallelkit", "launch", "--processes", "2", "--devices-per-process", "2",
         str(script), "--lr", "0.1"],
        capture_output=True, text=True, timeout=50, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    for i in (0, 1):
        assert f"[p{i}] process {i} of 2: psum=4.0 args: ['--lr', '0.1']" in result.stdout


@pytest.mark.timeout(60)
def test_cli_launch_fails_with_a_sentence(script):
    result = subprocess.run(
        [sys.executable, "-m", "parallelkit", "launch", "--heartbeat-timeout", "5", str(script)],
        capture_output=True, text=True, timeout=50, cwd=ROOT, check=False, env={**_env(), "FAULT": "raise:1"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "parallelkit launch: process 1 failed after" in result.stderr
    assert "raised an exception: ValueError: bad batch at step 1" in result.stderr


@pytest.mark.timeout(60)
def test_killed_worker_is_named_at_once_and_the_rest_are_stopped(script):
    _, err, start = run(script, "kill:1", env={"STEPS": "50", "STEP_SECONDS": "0.1"})
    elapsed = time.monotonic() - start
    assert err is not None, "the run should have failed"
    message = str(err)
    assert message.startswith("process 1 failed after"), message
    assert "was killed (SIGKILL) from outside" in message
    dead, survivor = err.processes[1], err.processes[0]
    assert survivor.returncode != 0  # stopped by the launcher, or aborted by JAX, never left running
    # Detected within the poll interval; the survivor gets `grace` (3 s) before SIGKILL.
    assert survivor.seconds - dead.seconds < 3 + 1.5
    assert elapsed < 20


@pytest.mark.timeout(60)
def test_killed_coordinator_aborts_the_others_quickly(script):
    _, err, _ = run(script, "kill:0", env={"STEPS": "50", "STEP_SECONDS": "0.1"}, grace=20)
    assert err is not None and str(err).startswith("process 0 failed after"), err
    coordinator, other = err.processes
    assert not other.killed_by_launcher, "JAX itself should end the others when the coordinator dies"
    assert other.returncode != 0 and other.seconds - coordinator.seconds < 5


@pytest.mark.timeout(90)
def test_survivor_of_a_dead_peer_exits_on_its_own_within_the_heartbeat_bound(script):
    # A long grace lets JAX's own failure detection act, as it would without the launcher.
    _, err, _ = run(script, "kill:1", env={"STEPS": "200", "STEP_SECONDS": "0.1"}, grace=40, heartbeat_timeout=5)
    dead, survivor = err.processes[1], err.processes[0]
    assert not survivor.killed_by_launcher, "the survivor hung instead of exiting"
    assert survivor.returncode != 0
    assert survivor.seconds - dead.seconds < 5 + 10  # heartbeat timeout plus JAX's own slack
    print(f"survivor exited {survivor.seconds - dead.seconds:.1f} s after its peer died: {survivor.cause}")


@pytest.mark.timeout(60)
def test_process_that_never_joins_is_named_within_the_init_timeout(script):
    _, err, start = run(script, "never_join:1", init_timeout=5)
    elapsed = time.monotonic() - start
    assert err is not None
    assert str(err).startswith("process 1 never joined the cluster within 5 s"), err
    assert elapsed < 5 + 5


@pytest.mark.timeout(60)
def test_exception_in_one_process_is_reported_with_its_message(script):
    _, err, _ = run(script, "raise:0")
    assert err is not None
    assert "process 0 failed after" in str(err) and "ValueError: bad batch at step 1" in str(err)


@pytest.mark.timeout(60)
def test_a_hang_ends_at_the_timeout_even_though_jax_catches_sigterm(script):
    _, err, start = run(script, "hang:1", timeout=8)
    elapsed = time.monotonic() - start
    assert err is not None and "exceeded its timeout of 8 s" in str(err), err
    assert all(p.returncode is not None for p in err.processes)
    assert elapsed < 8 + 5


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.timeout(60)
def test_without_a_launcher_a_lonely_process_exits_with_a_sentence_at_its_init_timeout():
    """No launcher watching (as under SLURM): the process that waits for a missing peer says why and exits 1."""
    from parallelkit.distributed.launcher import free_port

    code = (
        "import parallelkit as pk; "
        f"pk.distributed.initialize('127.0.0.1:{free_port()}', 2, 0, local_devices=1, initialization_timeout=4)"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=_env(), check=False
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    assert "the cluster did not form within 4 s" in result.stderr and "not all 2 processes joined" in result.stderr
    assert elapsed < 4 + 8  # before JAX's own abort, which comes about 5 s after its timeout


def _train_with_progress(steps: int):
    import optax

    import parallelkit as pk

    data = pk.data.digits()
    apply, params = pk.models.build("mlp", data.input_shape, data.num_classes)
    result = pk.fit(
        pk.MultiWorkerMirrored(),
        pk.models.classifier_loss(apply),
        params,
        optax.sgd(0.1),
        pk.data.batches(data, 32, steps=steps),
        steps=steps,
        callbacks=[pk.distributed.ReportProgress()],
    )
    return [r.seconds for r in result.history.records], result.history.losses.tolist()


@pytest.mark.timeout(90)
def test_progress_of_a_cluster_process_drives_callbacks_in_the_caller():
    from parallelkit.training import Callback

    class Recorder(Callback):
        def __init__(self):
            self.events = []

        def on_train_begin(self, info):
            self.events.append(("begin", info.devices, info.steps))

        def on_step_end(self, record):
            self.events.append(("step", record.step, record.seconds, record.loss))

        def on_train_end(self, history, interrupted):
            self.events.append(("end", len(history.records), interrupted))

    recorder, printed = Recorder(), []
    forward = pk.distributed.ForwardProgress([recorder], process=1, print_fn=printed.append)
    results = pk.distributed.run_local(_train_with_progress, 2, 2, args=(6,), timeout=60, print_fn=forward)
    seconds, losses = results[1]
    assert recorder.events[0] == ("begin", 4, 6)  # the global devices: 2 processes x 2
    expected = [("step", i, s, loss) for i, (s, loss) in enumerate(zip(seconds, losses, strict=True), start=1)]
    assert recorder.events[1:-1] == expected
    assert recorder.events[-1] == ("end", 6, False)
    assert forward.history.times.median == np.median(seconds[1:])
    assert not any("pk-progress" in line for line in printed)  # progress lines are consumed, not printed
