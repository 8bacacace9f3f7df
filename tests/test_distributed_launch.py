"""The local launcher and its faults, on real 2-process clusters (127.0.0.1, gloo).

Every test carries a hard timeout, so a hang fails instead of stalling CI. What the
launcher promises is asserted by who ended each process and by what it reported;
times only as wide bounds that a loaded 2-core machine cannot break.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import ROOT

import parallelkit as pk
from parallelkit.run.distributed import LaunchError

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
    # Detected within the poll interval; the survivor gets `grace` (3 s) before SIGKILL, not a heartbeat timeout.
    assert survivor.seconds - dead.seconds < 3 + 20
    assert elapsed < 50


@pytest.mark.timeout(60)
def test_killed_coordinator_aborts_the_others_quickly(script):
    _, err, _ = run(script, "kill:0", env={"STEPS": "50", "STEP_SECONDS": "0.1"}, grace=20)
    assert err is not None and str(err).startswith("process 0 failed after"), err
    coordinator, other = err.processes
    assert not other.killed_by_launcher, "JAX itself should end the others when the coordinator dies"
    assert other.returncode != 0  # and within the 20 s grace, or the launcher would have killed it


@pytest.mark.timeout(90)
def test_survivor_of_a_dead_peer_exits_on_its_own_within_the_heartbeat_bound(script):
    # A long grace lets JAX's own failure detection act, as it would without the launcher.
    _, err, _ = run(script, "kill:1", env={"STEPS": "200", "STEP_SECONDS": "0.1"}, grace=40, heartbeat_timeout=5)
    dead, survivor = err.processes[1], err.processes[0]
    assert not survivor.killed_by_launcher, "the survivor hung instead of exiting"
    assert survivor.returncode != 0  # on its own, within the 40 s grace: JAX's heartbeat (5 s) detected the loss
    print(f"survivor exited {survivor.seconds - dead.seconds:.1f} s after its peer died: {survivor.cause}")


@pytest.mark.timeout(60)
def test_process_that_never_joins_is_named_within_the_init_timeout(script):
    _, err, start = run(script, "never_join:1", init_timeout=5)
    elapsed = time.monotonic() - start
    assert err is not None
    assert str(err).startswith("process 1 never joined the cluster within 5 s"), err
    assert elapsed < 5 + 30  # named by the launcher, long before JAX's own 300 s


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
    assert elapsed < 8 + 30


def _env():
    import os

    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.timeout(60)
def test_without_a_launcher_a_lonely_process_exits_with_a_sentence_at_its_init_timeout():
    """No launcher watching (as under SLURM): the process that waits for a missing peer says why and exits 1."""
    from parallelkit.run.distributed.launcher import free_port

    code = (
        "import parallelkit as pk; "
        f"pk.distributed.initialize('127.0.0.1:{free_port()}', 2, 0, local_devices=1, initialization_timeout=4)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=_env(), check=False
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "the cluster did not form within 4 s" in result.stderr and "not all 2 processes joined" in result.stderr
    assert result.returncode == 1  # parallelkit's exit with a sentence, not JAX's own abort (134) after it


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
    from parallelkit.run.training import Callback

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


# ---- The launcher never leaves its processes behind -------------------------------------------

SLEEPER = textwrap.dedent(
    """
    import os, sys, time
    import parallelkit as pk

    pk.distributed.initialize()
    print("pid", os.getpid(), flush=True)
    time.sleep(600)
    """
)

RUN_LOCAL_CALLER = textwrap.dedent(
    """
    import os, sys, time
    import parallelkit as pk

    def sleeper():
        print("pid", os.getpid(), flush=True)
        time.sleep(600)

    pk.distributed.run_local(sleeper, 2, 1, timeout=300)
    """
)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_and_collect_pids(command: list[str], count: int) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    for line in proc.stdout:
        if " pid " in f" {line}":
            pids.append(int(line.split("pid")[-1]))
            if len(pids) == count:
                return proc, pids
    raise AssertionError(f"the cluster never started (exit {proc.wait()})")


def _assert_gone_within(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes {survivors} outlived their launcher"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to tell whether a process lives")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_stopping_the_launcher_stops_its_processes(tmp_path, sig):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    command = [sys.executable, "-m", "parallelkit", "launch", "--processes", "2", "--devices-per-process", "1"]
    launcher, pids = _start_and_collect_pids([*command, str(script)], 2)
    launcher.send_signal(sig)
    launcher.wait(timeout=30)
    launcher.stdout.close()
    assert all(pid != launcher.pid for pid in pids)
    _assert_gone_within(pids, 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to tell whether a process lives")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["interrupted", "caller killed"])
def test_an_interrupted_or_killed_run_local_leaves_no_process(tmp_path, sig):
    """SIGINT is a notebook's interrupt (KeyboardInterrupt in run_local); SIGKILL is a kernel restart."""
    script = tmp_path / "caller.py"
    script.write_text(RUN_LOCAL_CALLER)
    caller, pids = _start_and_collect_pids([sys.executable, str(script)], 2)
    caller.send_signal(sig)
    caller.wait(timeout=30)
    caller.stdout.close()
    _assert_gone_within(pids, 10)


@pytest.mark.timeout(60)
def test_simulated_clusters_run_on_the_cpu_and_gpu_mode_gives_each_process_its_own_devices():
    def platform():
        import os

        import jax

        return os.environ.get("JAX_PLATFORMS"), jax.devices()[0].platform, os.environ.get("CUDA_VISIBLE_DEVICES")

    assert pk.distributed.run_local(platform, 2, 1, timeout=40, stream=False) == [("cpu", "cpu", None)] * 2
    from parallelkit.run.distributed.launcher import _device_range

    assert [_device_range(i, 2) for i in range(3)] == ["0,1", "2,3", "4,5"]
    with pytest.raises(pk.distributed.ClusterError, match="choose one of"):
        pk.distributed.launch(["true"], 2, 1, platform="tpu")
