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
TENSOR_MODELS = ("mlp", "deep_mlp")  # TensorParallel's default rules cover the kit's MLPs
TENSOR_ONLY_MODELS = ("deep_mlp",)
OPTIMIZERS = {"sgd": ("sgd", 0.1), "adam": ("adam", 1e-3)}
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


def build(model: str, dataset):
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
        for opt_name, (factory, lr) in OPTIMIZERS.items():
            if model in TENSOR_ONLY_MODELS:
                chosen = tensor_strategies(devices)
            elif model == "mlp":
                chosen = strategies(devices) | tensor_strategies(devices)
            else:
                chosen = strategies(devices)
            for name, strategy in chosen.items():
                tx = getattr(optax, factory)(lr)
                result = pk.fit(strategy, loss_fn, params, tx, pk.data.batches(dataset, BATCH, steps=STEPS))
                assert int(strategy.unreplicate(result.state.step)) == STEPS
                for path, leaf in jax.tree_util.tree_flatten_with_path(result.params)[0]:
                    saved[f"{model}|{opt_name}|{name}|{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    np.savez(out, **saved)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
