"""examples/trainer.py runs as a real 2-process cluster: through the launcher, and from TF-era flags on 127.0.0.1.

Each process prints a ``RESULT {json}`` line; process 0 saves its final parameters,
which must equal the SingleDevice reference trained in this process on the same
data (float32 tolerance: rtol 1e-5, atol 1e-6). Every test has a hard timeout, and
every process it starts is SIGKILLed if it outlives its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys

import numpy as np
import optax
import pytest
from helpers import ATOL, ROOT, RTOL

import parallelkit as pk
from parallelkit.run.distributed.launcher import free_port

pytestmark = pytest.mark.multihost

TRAINER = str(ROOT / "examples" / "trainer.py")
STEPS, BATCH, LR = 6, 32, 1e-2
COMMON = ["--batch_size", str(BATCH), "--learning_rate", str(LR)]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process sets its own device count


def results(output: str) -> list[dict]:
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT {" in line]
    return sorted(found, key=lambda r: r["process"])


def single_device_params(steps: int = STEPS) -> dict[str, np.ndarray]:
    """The reference: the trainer's model and data, trained on one device here."""
    dataset = pk.data.digits()
    apply, params = pk.models.build("mlp", dataset.input_shape, dataset.num_classes, seed=0)
    run = pk.fit(
        pk.SingleDevice(), pk.models.classifier_loss(apply), params, optax.adam(LR),
        pk.data.batches(dataset, BATCH, steps=steps, seed=0),
    )  # fmt: skip
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(run.params)[0]}


def assert_equals_reference(npz, steps: int = STEPS) -> None:
    saved = dict(np.load(npz))
    reference = single_device_params(steps)
    assert saved.keys() == reference.keys()
    for key in reference:
        np.testing.assert_allclose(saved[key], reference[key], rtol=RTOL, atol=ATOL, err_msg=key)


@pytest.mark.timeout(150)
def test_trainer_through_the_launcher_with_checkpoints_and_resume(tmp_path):
    def launch(steps, *extra):
        return subprocess.run(
            [sys.executable, "-m", "parallelkit", "launch", "--processes", "2", "--devices-per-process", "2",
             "--timeout", "100", TRAINER, *COMMON, "--steps", str(steps), "--checkpoint_dir", str(tmp_path / "ckpt"),
             "--checkpoint_every", "2", *extra],
            capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env(), check=False,
        )  # fmt: skip

    first = launch(4, "--output", str(tmp_path / "four.npz"))
    assert first.returncode == 0, first.stderr + first.stdout
    found = results(first.stdout)
    assert [r["process"] for r in found] == [0, 1]
    for r in found:
        assert (r["processes"], r["devices"], r["source"], r["steps_run"]) == (2, 4, "launcher", 4)
        assert r["strategy"] == "MultiWorkerMirrored(devices=4, processes=2)"
    assert found[0]["param_sum"] == found[1]["param_sum"]  # one replicated state
    assert "[p1] process 1: 2 local of 4 global devices" in first.stdout
    assert_equals_reference(tmp_path / "four.npz", steps=4)
    assert pk.checkpoint.Checkpoints(tmp_path / "ckpt").steps() == [2, 4]

    # Run it again, asking for STEPS in all: both processes continue from step 4.
    second = launch(STEPS, "--resume", "--output", str(tmp_path / "resumed.npz"))
    assert second.returncode == 0, second.stderr + second.stdout
    assert [(r["resumed_from"], r["steps_run"]) for r in results(second.stdout)] == [(4, STEPS - 4)] * 2
    assert_equals_reference(tmp_path / "resumed.npz")


def run_tf_cluster(tasks: list[tuple[str, int]], flags: list[str], logs, timeout: float = 90) -> list[tuple[int, str]]:
    """Start one trainer per (job_name, task_index), as one would on each host; SIGKILL any left at the end."""
    procs, outputs = [], [logs / f"{job}-{index}.log" for job, index in tasks]
    try:
        for (job, index), out in zip(tasks, outputs, strict=True):
            with open(out, "w") as sink:  # the child keeps its own copy of the file
                procs.append(
                    subprocess.Popen(
                        [sys.executable, TRAINER, *flags, "--job_name", job, "--task_index", str(index)],
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                        env=_env(),
                        start_new_session=True,
                    )  # fmt: skip
                )
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [(code, out.read_text()) for code, out in zip(codes, outputs, strict=True)]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "strategy, hosts, tasks, roles",
    [
        ("multiworker", {"worker_hosts": 2}, [("worker", 0), ("worker", 1)], ["worker", "worker"]),
        ("ps", {"worker_hosts": 1, "ps_hosts": 1}, [("worker", 0), ("ps", 0)], ["worker", "ps"]),
    ],
    ids=["multiworker-2-workers", "ps-1-worker-1-ps"],
)
def test_trainer_from_tf_flags_on_loopback(strategy, hosts, tasks, roles, tmp_path):
    ports = iter([free_port(), free_port()])
    flags = [f"--{name}=" + ",".join(f"127.0.0.1:{next(ports)}" for _ in range(n)) for name, n in hosts.items()]
    flags += ["--devices_per_process", "2", "--init_timeout", "30", "--strategy", strategy, "--steps", str(STEPS)]
    flags += [*COMMON, "--output", str(tmp_path / "params.npz")]
    ran = run_tf_cluster(tasks, flags, tmp_path)
    for code, output in ran:
        assert code == 0, output
    found = results("\n".join(output for _, output in ran))
    assert [(r["process"], r["role"], r["source"], r["processes"]) for r in found] == [
        (i, role, "tf_flags", 2) for i, role in enumerate(roles)
    ]
    assert found[0]["param_sum"] == found[1]["param_sum"]
    assert_equals_reference(tmp_path / "params.npz")


def _recipe_arguments(text: str, substitutions: dict[str, str]) -> list[str]:
    """The trainer's arguments as a deploy recipe writes them (line continuations joined)."""
    command = text.replace("\\\n", " ").rsplit("examples/trainer.py", 1)[1]  # the command, after any comment
    command = command.split("\n          #")[0] if "\n          #" in command else command.split("\n\n")[0]
    for name, value in substitutions.items():
        command = command.replace(name, value)
    return shlex.split(command)


@pytest.mark.parametrize(
    "recipe, substitutions",
    [
        ("deploy/slurm/train.sbatch", {'"$CKPT_DIR"': "/shared/ckpt"}),
        ("deploy/kubernetes/trainer.yaml", {"$JOB_COMPLETION_INDEX": "1"}),
    ],
)
def test_deploy_recipes_pass_arguments_the_trainer_accepts(recipe, substitutions):
    spec = importlib.util.spec_from_file_location("trainer", TRAINER)
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    args = trainer.parse_args(_recipe_arguments((ROOT / recipe).read_text(), substitutions))
    assert args.strategy == "multiworker" and args.resume and args.checkpoint_dir
    if "kubernetes" in recipe:
        # The explicit cluster the pods describe: process 1 of 2, coordinator on pod 0 via the headless service.
        assert (args.coordinator_address, args.num_processes, args.process_id) == ("pk-trainer-0.pk-trainer:1234", 2, 1)
        spec = pk.distributed.resolve_cluster(args.coordinator_address, args.num_processes, args.process_id, env={})
        assert (spec.source, spec.process_id) == ("explicit", 1)
    else:  # SLURM: no cluster flags; JAX's own detection takes over
        assert args.coordinator_address is None and not args.worker_hosts
        assert pk.distributed.resolve_cluster(env={"SLURM_JOB_ID": "1"}).source == "auto (SLURM)"
