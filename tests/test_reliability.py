"""Plain, unblocked training loops never deadlock on simulated CPU devices, and end where SingleDevice ends.

XLA's CPU runtime aborts a process whose dispatched multi-device steps outrun the
cores (see parallelkit.core.devices). Two safeguards, each tested on its own:

- ``pk.Step`` keeps at most ``MAX_STEPS_IN_FLIGHT`` steps queued: tested with XLA's
  thread pool left at its default size, so the step's own pacing is all that protects;
- ``pk.simulate_devices`` sizes that pool for the device count: tested with a loop in
  plain JAX that never goes through ``pk.Step``.

Each loop runs in its own process (tests/loop_worker.py) under a hard timeout: a
regression shows as XLA's abort (exit 134), never as a hung suite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import ATOL, ROOT, RTOL

import parallelkit as pk
from parallelkit.core.devices import _cores


def run_loops(case: str, tmp_path, extra_env: dict[str, str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")} | (extra_env or {})
    out = tmp_path / f"{case}.npz"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "loop_worker.py"), case, str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"the {case} loops failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    by_run: dict[str, dict[str, np.ndarray]] = {}
    with np.load(out) as saved:
        for key, leaf in saved.items():
            run, path = key.split("|", 1)
            by_run.setdefault(run, {})[path] = leaf
    return by_run


def assert_all_equal_single(by_run: dict[str, dict[str, np.ndarray]], expected_runs: set[str]) -> None:
    assert set(by_run) == expected_runs
    reference = by_run.pop("single")
    for run, params in by_run.items():
        assert params.keys() == reference.keys(), run
        for path, leaf in params.items():
            np.testing.assert_allclose(leaf, reference[path], rtol=RTOL, atol=ATOL, err_msg=f"{run} {path}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_loop_300_unblocked_steps_on_8_devices_every_strategy(tmp_path):
    # XLA's thread pool left at the core count: only pk.Step's pacing stands between the loop and the abort.
    by_run = run_loops("readme", tmp_path, {"PJRT_NPROC": str(_cores())})
    assert_all_equal_single(by_run, {"single", "jit", "pmap", "central", "ps", "multiworker"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wide_mlp_110_unblocked_steps_on_2_devices(tmp_path):
    by_run = run_loops("wide", tmp_path)
    assert_all_equal_single(by_run, {"single", "jit", "pmap"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hand_written_jax_loop_is_safe_after_simulate_devices(tmp_path):
    by_run = run_loops("hand", tmp_path)
    assert_all_equal_single(by_run, {"single", "hand"})


def test_simulate_devices_sizes_the_cpu_thread_pool_without_lowering_it():
    code = (
        "import os, parallelkit as pk; from parallelkit.core.devices import _cores; pk.simulate_devices({n}); "
        "print(os.environ.get('PJRT_NPROC'), _cores())"
    )
    for n in (1, 8):
        result = subprocess.run(
            [sys.executable, "-c", code.format(n=n)], capture_output=True, text=True, timeout=60, cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC")}, check=True,
        )  # fmt: skip
        pool, cores = result.stdout.split()
        expected = str(2 * n) if 2 * n > int(cores) else "None"
        assert pool == expected, (n, result.stdout)


def test_step_paces_only_simulated_cpu_devices():
    """More than one CPU device: the step keeps a bounded queue; one device (or accelerators): none."""
    assert pk.Mirrored(2).step(lambda p, b: 0.0)._in_flight is not None
    assert pk.SingleDevice().step(lambda p, b: 0.0)._in_flight is None
    assert pk.core.step.MAX_STEPS_IN_FLIGHT < 32  # XLA's own limit per device
