"""Child process of test_equivalence: train every case on N devices, save the parameters.

Usage: python tests/equivalence_worker.py DEVICES OUT.npz

The device count is fixed per process, so each count runs in a process of its own.
Every case starts from the same parameters and sees the same batches.
"""

from __future__ import annotations

import sys

import numpy as np

import parallelkit as pk

MODELS = ("mlp", "cnn")
TENSOR_MODELS = ("mlp", "cnn", "deep_mlp", "transformer")  # TensorParallel's default rules cover these
TENSOR_ONLY_MODELS = ("deep_mlp", "transformer")
# The transformer trains with dropout on (a PRNG key in the state). Under jax.jit the key draws
# the dropout masks for the global batch, so the jit strategies equal SingleDevice exactly.
DROPOUT_SEED = 0
OPTIMIZERS = {"sgd": ("sgd", 0.1), "adam": ("adam", 1e-3)}


def optimizers(model: str) -> dict:
    """The optimizers a model trains with here: both for the MLPs and the CNN, SGD for the transformers.

    SGD is the stricter check (Adam divides each update by its gradient's own scale, so a gradient
    off by a constant factor would still pass), and the MLPs already cover Adam's optimizer state
    on every strategy; the transformers add dropout keys and split heads, which SGD exercises.
    """
    return {k: v for k, v in OPTIMIZERS.items() if "transformer" not in model or k == "sgd"}


STEPS = 12
BATCH = 32  # divisible by 1, 2, 4 and 8
PS_SHARDS = (1, 2, 3)  # 3 does not divide the parameter count: the partition must still balance


def strategies(devices: int) -> dict:
    return {
        "single": pk.SingleDevice(),
        "jit": pk.Mirrored(devices, backend="jit"),
        "pmap": pk.Mirrored(devices, backend="pmap"),
        "central": pk.CentralStorage(devices),
        **{f"ps{k}": pk.ParameterServer(k, devices=devices) for k in PS_SHARDS},
    }


def tensor_strategies(devices: int) -> dict:
    """TensorParallel over all devices (none on one device: there is nothing to split)."""
    return {"single": pk.SingleDevice(), **({"tensor": pk.TensorParallel(model=devices)} if devices > 1 else {})}


HYBRIDS = {4: ((2, 2),), 8: ((4, 2), (2, 4))}  # data x model meshes per device count
ZERO_STAGES = (1, 2, 3)


def sharded_names(devices: int) -> list[str]:
    """FullySharded stages 1-3 over all devices; Hybrid 2x2 on 4 devices, 4x2 and 2x4 on 8."""
    zero = [f"zero{k}" for k in ZERO_STAGES] if devices > 1 else []
    return zero + [f"hybrid{d}x{m}" for d, m in HYBRIDS.get(devices, ())]


def sharded_strategies(devices: int) -> dict:
    return {
        **({f"zero{k}": pk.FullySharded(k, devices) for k in ZERO_STAGES} if devices > 1 else {}),
        **{f"hybrid{d}x{m}": pk.Hybrid(d, m) for d, m in HYBRIDS.get(devices, ())},
    }


def dropout_strategies(devices: int) -> dict:
    """Strategies whose step sees the global batch, so dropout equals SingleDevice's exactly."""
    import jax

    return {
        **tensor_strategies(devices),
        **sharded_strategies(devices),
        "jit": pk.Mirrored(devices, backend="jit"),
        "multiworker": pk.MultiWorkerMirrored(jax.devices()[:devices]),  # one process: its jit step
    }


PIPELINE_DEVICES = 4  # the worker with this many devices also trains the pipelines
PIPELINE_MODELS = ("mlp", "transformer")  # as layers (pk.models.as_layers): 4 layers each, no dropout
PIPELINE_RUNS = [
    *(
        (f"pipe{stages}s{micro}m-{schedule}", stages, micro, schedule, 1)
        for stages in (2, 4)
        for micro in (1, 4, 8)
        for schedule in ("gpipe", "1f1b")
    ),
    *((f"pipe2x2-{schedule}", 2, 4, schedule, 2) for schedule in ("gpipe", "1f1b")),  # stages x data
]


def train_pipelines(dataset) -> dict[str, np.ndarray]:
    """Every pipeline run beside SingleDevice on the same layers (keys as in main: model|optimizer|name|path)."""
    import jax
    import optax
    from flax import nnx

    saved = {}
    for model in PIPELINE_MODELS:
        module = (
            pk.models.MLP(int(np.prod(dataset.input_shape)), (64, 32, 16), dataset.num_classes, rngs=nnx.Rngs(0))
            if model == "mlp"
            else pk.models.Transformer(dataset.input_shape, dataset.num_classes, rngs=nnx.Rngs(0))
        )
        layers, params = pk.models.as_layers(module)
        head = pk.models.cross_entropy
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            saved[f"pipe_{model}|-|init|{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
        runs = [("single", pk.SingleDevice(), pk.pipeline.sequential_loss(layers, head))]
        runs += [
            (name, pk.Pipeline(layers, st, mb, sc, data=d, devices=jax.devices()[: st * d]), head)
            for name, st, mb, sc, d in PIPELINE_RUNS
        ]
        for opt_name, (factory, lr) in optimizers(model).items():
            tx = getattr(optax, factory)(lr)
            for name, strategy, loss_fn in runs:
                result = pk.fit(strategy, loss_fn, params, tx, pk.data.batches(dataset, BATCH, steps=STEPS))
                for path, leaf in jax.tree_util.tree_flatten_with_path(result.params)[0]:
                    saved[f"pipe_{model}|{opt_name}|{name}|{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    return saved


def build(model: str, dataset):
    if model == "transformer":
        return pk.models.build("transformer", dataset.input_shape, dataset.num_classes)
    if model == "deep_mlp":  # two Megatron blocks: an all-reduce forward and one backward
        from flax import nnx

        features = int(np.prod(dataset.input_shape))
        return pk.models.functional(pk.models.MLP(features, (64, 32, 16), dataset.num_classes, rngs=nnx.Rngs(0)))
    return pk.models.build(model, dataset.input_shape, dataset.num_classes)


def main(devices: int, out: str) -> None:
    pk.simulate_devices(devices)
    import jax
    import optax

    dataset = pk.data.digits()
    saved = {}
    for model in (*MODELS, *TENSOR_ONLY_MODELS):
        apply, params = build(model, dataset)
        loss_fn = pk.models.classifier_loss(apply)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            saved[f"{model}|-|init|{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
        for opt_name, (factory, lr) in optimizers(model).items():
            if model == "transformer":
                chosen = dropout_strategies(devices)
            elif model in TENSOR_ONLY_MODELS:
                chosen = tensor_strategies(devices)
            elif model == "mlp":
                chosen = strategies(devices) | tensor_strategies(devices) | sharded_strategies(devices)
            elif model in TENSOR_MODELS:
                chosen = strategies(devices) | tensor_strategies(devices)
            else:
                chosen = strategies(devices)
            for name, strategy in chosen.items():
                dropout = model == "transformer"
                tx = getattr(optax, factory)(lr)
                batches = pk.data.batches(dataset, BATCH, steps=STEPS)
                result = pk.fit(strategy, loss_fn, params, tx, batches, rng=DROPOUT_SEED if dropout else None)
                assert int(strategy.unreplicate(result.state.step)) == STEPS
                for path, leaf in jax.tree_util.tree_flatten_with_path(result.params)[0]:
                    saved[f"{model}|{opt_name}|{name}|{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    if devices == PIPELINE_DEVICES:
        saved.update(train_pipelines(dataset))
    np.savez(out, **saved)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
