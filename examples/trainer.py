"""Train a small model across processes: one script for a laptop, a TF-style cluster, SLURM or Kubernetes.

Every process runs this same script (JAX's multi-controller model). Where it sits
in the cluster comes from, in order: ``--coordinator_address/--num_processes/--process_id``;
the local launcher; the TensorFlow-era flags ``--ps_hosts/--worker_hosts/--job_name/--task_index``;
``TF_CONFIG``; JAX's own detection (SLURM, Open MPI, ...); else one process.

    # a 2-process cluster on this machine, 2 simulated CPU devices each
    python -m parallelkit launch --processes 2 --devices-per-process 2 examples/trainer.py --steps 50

    # the TensorFlow way: run once per task, on each host (here both on 127.0.0.1)
    python examples/trainer.py --worker_hosts=127.0.0.1:2222,127.0.0.1:2223 --job_name=worker --task_index=0
    python examples/trainer.py --worker_hosts=127.0.0.1:2222,127.0.0.1:2223 --job_name=worker --task_index=1

    # SLURM: srun starts one process per task; JAX reads the SLURM environment
    srun python examples/trainer.py --checkpoint_dir /shared/ckpt --resume

Strategies:

- ``--strategy multiworker`` (default): :class:`parallelkit.MultiWorkerMirrored`, data
  parallel over every device of every process; the gradient all-reduce crosses processes.
- ``--strategy ps``: :class:`parallelkit.ParameterServer` *inside each process*. JAX has
  one kind of process, so ``--ps_hosts`` tasks become ordinary processes (after the
  workers) and there is no cross-process push/pull: each process keeps its own PS
  shards in the host memory of its local devices and trains on the whole global
  batch, so every process ends with the same parameters. It is the PS lesson run under
  the cluster flags, not a distributed parameter server; for training across
  processes use ``multiworker``. Checkpoints need global arrays, so they are refused
  here when there is more than one process.

Each process prints one ``RESULT {json}`` line; ``--output`` saves process 0's final
parameters (``.npz``, keys are the parameter paths).
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cluster = parser.add_argument_group("cluster (all optional: see the module docstring for the order)")
    cluster.add_argument("--ps_hosts", default="", help="comma-separated host:port of the ps tasks")
    cluster.add_argument("--worker_hosts", default="", help="comma-separated host:port of the worker tasks")
    cluster.add_argument("--job_name", default="", choices=("", "worker", "ps"), help="this task's job")
    cluster.add_argument("--task_index", type=int, default=None, help="this task's index within its job")
    cluster.add_argument("--coordinator_address", default=None, help="host:port of process 0 (explicit cluster)")
    cluster.add_argument("--num_processes", type=int, default=None)
    cluster.add_argument("--process_id", type=int, default=None)
    cluster.add_argument("--devices_per_process", type=int, default=None, help="simulated CPU devices per process")
    cluster.add_argument("--init_timeout", type=int, default=None, help="seconds for every process to join")
    train = parser.add_argument_group("training")
    train.add_argument("--strategy", choices=("multiworker", "ps"), default="multiworker")
    train.add_argument("--num_shards", type=int, default=2, help="PS shards per process (--strategy ps)")
    train.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    train.add_argument("--steps", type=int, default=50)
    train.add_argument("--batch_size", type=int, default=64, help="the global batch, over all devices")
    train.add_argument("--learning_rate", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0, help="seeds the model and the data order")
    train.add_argument("--checkpoint_dir", default=None, help="a directory every process sees")
    train.add_argument("--checkpoint_every", type=int, default=10)
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint, if there is one")
    train.add_argument("--output", default=None, help="save process 0's final parameters here (.npz)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import parallelkit as pk

    # First, before any JAX work: join the cluster (a no-op for a single process).
    spec = pk.distributed.initialize(
        args.coordinator_address,
        args.num_processes,
        args.process_id,
        local_devices=args.devices_per_process,
        ps_hosts=args.ps_hosts or None,
        worker_hosts=args.worker_hosts or None,
        job_name=args.job_name or None,
        task_index=args.task_index,
        initialization_timeout=args.init_timeout,
    )
    import jax
    import optax

    me = jax.process_index()
    print(f"process {me} of {jax.process_count()}: {spec.describe()}", flush=True)
    print(f"process {me}: {jax.local_device_count()} local of {jax.device_count()} global devices", flush=True)

    if args.strategy == "multiworker":
        strategy = pk.MultiWorkerMirrored()
    else:
        if args.checkpoint_dir and jax.process_count() > 1:
            raise SystemExit(
                "--strategy ps keeps each process's state on its own devices, so it cannot be checkpointed as one "
                "global state across processes. Drop --checkpoint_dir, or use --strategy multiworker."
            )
        strategy = pk.ParameterServer(args.num_shards, devices=jax.local_devices())

    dataset = pk.data.digits()
    apply, params = pk.models.build(args.model, dataset.input_shape, dataset.num_classes, seed=args.seed)
    loss_fn = pk.models.classifier_loss(apply)
    # Every process makes the same global batches (same seed); MultiWorkerMirrored places only its rows.
    batches = pk.data.batches(dataset, args.batch_size, steps=args.steps, seed=args.seed)
    resume = bool(args.resume and args.checkpoint_dir and pk.checkpoint.latest_step(args.checkpoint_dir) is not None)
    result = pk.fit(
        strategy,
        loss_fn,
        params,
        optax.adam(args.learning_rate),
        batches,
        steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=resume,
    )
    trained = result.params
    leaves = jax.tree_util.tree_flatten_with_path(trained)[0]
    losses = result.history.losses
    summary = {
        "process": me,
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "source": spec.source,
        "role": spec.role,
        "strategy": repr(strategy),
        "steps_run": len(losses),
        "resumed_from": result.resumed_from,
        "first_loss": float(losses[0]) if len(losses) else None,
        "final_loss": float(losses[-1]) if len(losses) else None,
        "param_sum": float(sum(float(abs(leaf).sum()) for _, leaf in leaves)),
    }
    print("RESULT " + json.dumps(summary), flush=True)
    if args.output and me == 0:
        import numpy as np

        np.savez(args.output, **{jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves})
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
