"""Child process of test_reliability: plain, unblocked training loops, as a learner writes them.

Usage: python tests/loop_worker.py CASE OUT.npz

- ``readme``: the README's loop (digits MLP, Adam 1e-3, global batch 64) for 300 steps on 8
  simulated devices, with every data-parallel strategy and SingleDevice as the reference.
- ``wide``: an MLP 784-1024-1024-10, SGD, global batch 256, 110 steps, on 2 devices.
- ``hand``: the README loop written in plain JAX (jit + NamedSharding, no parallelkit step).

No loop here waits for a step: the point is that the queue of dispatched steps stays safe.
The parameters each loop ends on are saved for the test to compare.
"""

from __future__ import annotations

import sys

import numpy as np

import parallelkit as pk

DEVICES = {"readme": 8, "wide": 2, "hand": 8}
STEPS = {"readme": 300, "wide": 110, "hand": 300}


def plain_loop(strategy, loss_fn, params, tx, batches):
    """The README's loop, unchanged: nothing blocks."""
    state = strategy.init(params, tx)
    step = strategy.step(loss_fn)
    for batch in batches:
        state, metrics = step(state, batch)
    return strategy.unreplicate(state.params)


def hand_written_loop(loss_fn, params, tx, batches):
    """The same loop in plain JAX: jit with shardings, the batch placed each step."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def train_step(params, opt_state, batch):
        grads, _ = jax.grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(train_step, out_shardings=(replicated, replicated), donate_argnums=(0, 1))
    params, opt_state = jax.device_put(jax.device_get((params, tx.init(params))), replicated)  # copies
    for batch in batches:
        params, opt_state = step(params, opt_state, jax.device_put(batch, split))
    return jax.device_get(params)


def main(case: str, out: str) -> None:
    pk.simulate_devices(DEVICES[case])
    import jax
    import optax
    from flax import nnx

    if case == "wide":
        data = pk.data.synthetic(2048, (784,), 10)
        apply, params = pk.models.functional(pk.models.MLP(784, (1024, 1024), 10, rngs=nnx.Rngs(0)))
        tx, batch = optax.sgd(0.05), 256
    else:
        data = pk.data.digits()
        apply, params = pk.models.build("mlp", data.input_shape, data.num_classes)
        tx, batch = optax.adam(1e-3), 64
    loss_fn = pk.models.classifier_loss(apply)

    def batches():
        return pk.data.batches(data, batch, steps=STEPS[case])

    results = {"single": plain_loop(pk.SingleDevice(), loss_fn, params, tx, batches())}
    if case == "hand":
        results["hand"] = hand_written_loop(loss_fn, params, tx, batches())
    else:
        strategies = {"jit": pk.Mirrored(backend="jit"), "pmap": pk.Mirrored(backend="pmap")}
        if case == "readme":
            strategies |= {
                "central": pk.CentralStorage(),
                "ps": pk.ParameterServer(2),
                "multiworker": pk.MultiWorkerMirrored(),
            }
        for name, strategy in strategies.items():
            results[name] = plain_loop(strategy, loss_fn, params, tx, batches())
    flat = {
        f"{name}|{jax.tree_util.keystr(path)}": np.asarray(leaf)
        for name, tree in results.items()
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    np.savez(out, **flat)
    print("finished", case, sorted(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
