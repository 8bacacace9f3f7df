"""A local cluster: N processes on 127.0.0.1, each with M simulated CPU devices (:func:`launch`, :func:`run_local`)."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..signals import SignalHandlers
from .cluster import (
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_INIT_TIMEOUT,
    ENV_LAUNCHER_PID,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_READY_FILE,
    ENV_SHUTDOWN_TIMEOUT,
    ClusterError,
)

_TAIL_LINES = 40
_PLATFORMS = ("cpu", "gpu")
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class LaunchError(RuntimeError):
    """A process of a local cluster failed, never joined, or the run timed out.

    ``processes`` holds what is known of each process (exit code, cause, output tail).
    """

    def __init__(self, message: str, processes: list[ProcessReport]):
        super().__init__(message)
        self.processes = processes


@dataclass
class ProcessReport:
    """How one process of a local run ended."""

    index: int
    returncode: int | None = None
    seconds: float | None = None  # from the start of the run to its exit
    cause: str = ""
    started: bool = False  # reached pk.distributed.initialize()
    joined: bool = False  # came out of it: the cluster formed
    killed_by_launcher: bool = False
    tail: deque = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))

    @property
    def output(self) -> str:
        return "\n".join(self.tail)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def _exception_line(output: str) -> str | None:
    """The ``Kind: message`` line of the last Python traceback in ``output``, if there is one."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    for line in lines[starts[-1] + 1 :]:
        if line.strip() and not line.startswith((" ", "\t")):
            return line.strip()
    return None


def _explain_exit(returncode: int, output: str) -> str:
    """A sentence on why a process ended with ``returncode``, from its code and last output."""
    raised = _exception_line(output)
    if raised is not None:
        return f"raised an exception: {raised}"
    text = output.lower()
    if returncode in (-signal.SIGABRT, 134):
        why = "aborted (SIGABRT): JAX's distributed runtime ends a process this way when it loses a peer"
        if "heartbeat" in text or "unavailable" in text:
            why += " (a peer stopped sending heartbeats: it died or hung)"
        elif "deadline" in text or "barrier" in text or "timed out" in text:
            why += " (a peer never joined within the initialization timeout)"
        return why
    if returncode in (-signal.SIGKILL, 137):
        return "was killed (SIGKILL) from outside: by a user, a test, or the out-of-memory killer"
    if returncode < 0:
        return f"was stopped by {_signal_name(-returncode)}"
    lines = [line for line in output.splitlines() if line.strip()]
    return f"exited with code {returncode}" + (f"; last output: {lines[-1].strip()}" if lines else "")


def _reader(index: int, stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put((index, line.rstrip("\n")))
    stream.close()


def launch(
    command: Sequence[str],
    processes: int = 2,
    devices_per_process: int = 2,
    *,
    timeout: float = 300,
    init_timeout: int = 20,
    heartbeat_timeout: int = 10,
    grace: float = 3.0,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
    stream: bool = True,
    print_fn: Callable[[str], None] = print,
    platform: str = "cpu",
) -> list[ProcessReport]:
    """Run ``command`` as ``processes`` processes of one local JAX cluster and watch them.

    Each process gets ``devices_per_process`` simulated CPU devices (or, with
    ``platform="gpu"``, that many GPUs of its own) and must call
    ``pk.distributed.initialize()`` (which reads the launcher's environment). The
    children never outlive the launcher: docs/multi_host.md says how.

    Args:
      command: the program, for example ``[sys.executable, "train.py", "--steps", "10"]``.
      processes, devices_per_process: the cluster's shape.
      timeout: seconds for the whole run; past it every process is killed.
      init_timeout: seconds each process has to join (the processes themselves give up 5 s later,
        so the launcher can name the one that is missing).
      heartbeat_timeout: seconds after which JAX declares a silent peer dead.
      grace: seconds the others get to exit on their own after one fails, before SIGKILL.
      host: the coordinator's address; loopback unless told otherwise.
      env: extra environment variables for every process.
      stream: print each output line as ``[p<i>] line`` while it runs, from the calling thread (so that it
        lands in the right notebook cell).
      platform: ``"cpu"``: simulated CPU devices, ``JAX_PLATFORMS=cpu`` (the default, also on a
        machine with a GPU, so that the processes do not fight over it); ``"gpu"``: process ``i`` sees
        GPUs ``i*d .. i*d+d-1`` of this machine (``d = devices_per_process``) through
        ``CUDA_VISIBLE_DEVICES``, the usual multi-GPU layout.

    Returns:
      One :class:`ProcessReport` per process, all with exit code 0.

    Raises:
      LaunchError: a process failed or never joined, or the run timed out; the message
        names the process that went first and the likely cause.
    """
    if processes < 1 or devices_per_process < 1:
        raise ClusterError(f"Need at least 1 process and 1 device each, got {processes} x {devices_per_process}.")
    if platform not in _PLATFORMS:
        raise ClusterError(f"launch(platform={platform!r}): choose one of {_PLATFORMS}.")
    workdir = Path(tempfile.mkdtemp(prefix="pk-launch-"))
    address = f"{host}:{free_port(host)}"
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the child sets its own device count
    # Children see the caller's import path, so functions and modules defined beside it import there too.
    base["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, base.get("PYTHONPATH", "")] if p)
    base.update(env or {})
    base.update(
        {
            ENV_COORDINATOR: address,
            ENV_NUM_PROCESSES: str(processes),
            ENV_LAUNCHER_PID: str(os.getpid()),
            ENV_INIT_TIMEOUT: str(init_timeout + 5),
            ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
            ENV_SHUTDOWN_TIMEOUT: str(max(init_timeout, 10)),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if platform == "cpu":
        base.update({"JAX_PLATFORMS": "cpu", ENV_LOCAL_DEVICES: str(devices_per_process)})
    if sys.platform.startswith("linux"):  # so that Linux kills each child when this launcher dies (see _guard.py)
        command = [sys.executable, str(Path(__file__).with_name("_guard.py")), str(os.getpid()), *command]
    reports = [ProcessReport(i) for i in range(processes)]
    lines: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_stopped_by_signals(print_fn))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        stack.callback(lambda: [_kill(proc) for proc in procs])  # on every way out, also KeyboardInterrupt
        for i in range(processes):
            child_env = {**base, ENV_PROCESS_ID: str(i), ENV_READY_FILE: str(workdir / f"ready-{i}")}
            if platform == "gpu":
                child_env["CUDA_VISIBLE_DEVICES"] = _device_range(i, devices_per_process)
            proc = subprocess.Popen(
                list(command),
                env=child_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,  # its own process group: killing it takes its children too
            )
            procs.append(proc)
            readers.append(threading.Thread(target=_reader, args=(i, proc.stdout, lines), daemon=True))
            readers[-1].start()
        _watch(procs, readers, reports, lines, workdir, start, timeout, init_timeout, grace, stream, print_fn)
    return reports


def _device_range(index: int, per_process: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for process ``index``: its own block of ``per_process`` GPUs."""
    return ",".join(str(d) for d in range(index * per_process, (index + 1) * per_process))


def _stopped_by_signals(print_fn: Callable[[str], None]) -> contextlib.AbstractContextManager:
    """Turn SIGTERM and SIGHUP into ``SystemExit`` while the cluster runs, so the children are cleaned up.

    Python's default for these signals ends the process without running ``finally``
    blocks, which would leave the children running. Signal handlers can only be set
    from the main thread; elsewhere the children's own safeguards remain.
    """

    def stop(signum, _frame):
        print_fn(f"parallelkit launch: stopped by {_signal_name(signum)}; ending the cluster's processes.")
        raise SystemExit(128 + signum)

    return SignalHandlers(_STOP_SIGNALS, stop)


def _kill(proc: subprocess.Popen) -> bool:
    """SIGKILL a child's process group if it still runs; True if it had to."""
    if proc.poll() is not None:
        return False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    return True


def _drain(lines: queue.Queue, reports, stream, print_fn) -> None:
    while True:
        try:
            index, line = lines.get_nowait()
        except queue.Empty:
            return
        reports[index].tail.append(line)
        if stream:
            print_fn(f"[p{index}] {line}")


def _watch(procs, readers, reports, lines, workdir, start, timeout, init_timeout, grace, stream, print_fn) -> None:
    problem = None  # the first failure: (report, sentence)
    while True:
        time.sleep(0.05)
        _drain(lines, reports, stream, print_fn)
        now = time.monotonic() - start
        for proc, report in zip(procs, reports, strict=True):
            report.started = report.started or (workdir / f"ready-{report.index}.started").exists()
            report.joined = report.joined or (workdir / f"ready-{report.index}.joined").exists()
            if report.returncode is None and proc.poll() is not None:
                report.returncode, report.seconds = proc.returncode, now
                if proc.returncode != 0 and problem is None:
                    problem = (report, f"process {report.index} failed after {now:.1f} s: it {{cause}}")
        running = [r for r in reports if r.returncode is None]
        if not running:
            break
        if problem is not None and now - problem[0].seconds > grace:
            break
        if problem is None:
            # Those that started joining wait for those that did not: blame the latter.
            late = sorted((r for r in running if not r.joined and now > init_timeout + 2), key=lambda r: r.started)
            if late:
                problem = (
                    late[0],
                    f"process {late[0].index} never joined the cluster within {init_timeout} s: it did not start, "
                    "hung before pk.distributed.initialize(), or never called it",
                )
                break
            if now > timeout:
                problem = (running[0], f"the run exceeded its timeout of {timeout:g} s (a hang or a slow program)")
                break
    for proc, report in zip(procs, reports, strict=True):
        if _kill(proc):
            report.killed_by_launcher = True
            report.returncode, report.seconds = proc.returncode, time.monotonic() - start
            report.cause = "was still running and was stopped by the launcher (SIGKILL)"
    for reader in readers:  # let them pass on the last lines
        reader.join(timeout=1.0)
    _drain(lines, reports, stream, print_fn)
    for report in reports:
        if report.returncode and not report.killed_by_launcher:
            report.cause = _explain_exit(report.returncode, report.output)
    if problem is None:
        return
    first, sentence = problem
    lines_out = [sentence.format(cause=first.cause).rstrip(".") + "."]
    for r in reports:
        if r is not first and r.returncode:
            lines_out.append(f"  process {r.index} {r.cause}.".replace("..", "."))
    shown = [line for line in first.tail if not line.lstrip().startswith("[Gloo]")]  # not gloo's connection chatter
    tail = "\n    ".join(shown[-8:]) or "(no output)"
    lines_out.append(f"  last output of process {first.index}:\n    {tail}")
    raise LaunchError("\n".join(lines_out), reports)


def run_local(
    fn: Callable[..., Any],
    processes: int = 2,
    devices_per_process: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    **launch_options: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` in every process of a local cluster; return each result.

    Every process first joins the cluster (``pk.distributed.initialize()``), so
    ``fn`` can use ``jax.process_index()``, the global devices and
    :class:`parallelkit.MultiWorkerMirrored` directly. ``fn`` travels by
    cloudpickle, so functions defined in a notebook work; its result must pickle.

    Args:
      fn: the program every process runs.
      processes, devices_per_process: the cluster's shape.
      args, kwargs: passed to ``fn``.
      **launch_options: ``timeout``, ``init_timeout``, ``heartbeat_timeout``, ``grace``,
        ``host``, ``env``, ``stream``, ``print_fn``, ``platform`` as for :func:`launch`.

    Returns:
      ``[result of process 0, result of process 1, ...]``.

    Raises:
      LaunchError: a process failed or never joined, or the run timed out.

    Conceptually, this is ``[fn(*args) for process in cluster]``, run in parallel.
    """
    import cloudpickle  # functions defined in a notebook travel by value

    with tempfile.TemporaryDirectory(prefix="pk-run-") as tmp:
        payload = Path(tmp) / "payload.pkl"
        payload.write_bytes(cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
        command = [sys.executable, "-m", "parallelkit.run.distributed._child", str(payload), tmp]
        launch(command, processes, devices_per_process, **launch_options)
        return [pickle.loads((Path(tmp) / f"result-{i}.pkl").read_bytes()) for i in range(processes)]
