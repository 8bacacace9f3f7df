"""Randomness and model state in the step: what "equal to SingleDevice" means for each.

- Dropout under ``jax.jit`` with shardings: the key draws the masks for the global batch,
  so Mirrored(jit) equals SingleDevice (tested per device count in test_equivalence.py).
- Dropout under ``pmap``, CentralStorage and ParameterServer: each replica folds its index
  into the step's key and draws its own masks; tested here against that computation written
  out by hand, and shown to differ from SingleDevice.
- BatchNorm: statistics of the global batch (SyncBatchNorm) equal SingleDevice: under jit
  always; under pmap, CentralStorage and ParameterServer when the model averages them over
  the replica axis; per-replica statistics do not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose
from jax.sharding import PartitionSpec as P

import parallelkit as pk

STEPS, BATCH = 6, 32


def transformer(digits):
    apply, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    return pk.models.classifier_loss(apply), params


def train(strategy, loss_fn, params, digits, tx=None, **extras):
    result = pk.fit(strategy, loss_fn, params, tx or optax.sgd(0.1), pk.data.batches(digits, BATCH, steps=STEPS),
                    **extras)  # fmt: skip
    state = result.state
    return result.params, strategy.unreplicate(state.model_state), strategy.unreplicate(state.rng)


def max_diff(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_the_key_advances_every_step_and_dropout_changes_training(digits):
    loss_fn, params = transformer(digits)
    with_dropout, _, key = train(pk.SingleDevice(), loss_fn, params, digits, rng=7)
    without, _, no_key = train(pk.SingleDevice(), loss_fn, params, digits)
    assert no_key is None
    expected = jax.random.PRNGKey(7)
    for _ in range(STEPS):
        expected, _ = jax.random.split(expected)
    np.testing.assert_array_equal(key, expected)
    assert max_diff(with_dropout, without) > 1e-3  # dropout was really on
    again, _, _ = train(pk.SingleDevice(), loss_fn, params, digits, rng=7)
    tree_allclose(again, with_dropout, rtol=0, atol=0)  # and reproducible from the seed


# Strategies whose replicas compute on their own and draw their own randomness.
PER_REPLICA = {
    "pmap": lambda n: pk.Mirrored(n, backend="pmap"),
    "central": pk.CentralStorage,
    "ps": lambda n: pk.ParameterServer(3, devices=n),
}


@functools.cache
def single_device_with_dropout() -> tuple:
    """SingleDevice's parameters and key after training with dropout from seed 3 (shared by the tests below)."""
    digits = pk.data.digits()
    params, _, key = train(pk.SingleDevice(), *transformer(digits), digits, rng=3)
    return params, key


@functools.cache
def replicas_by_hand(n: int):
    """The mean over replicas r of grad(loss)(params, slice_r, rng=fold_in(key, r)), STEPS steps of SGD."""
    digits = pk.data.digits()
    loss_fn, params = transformer(digits)
    grad = jax.jit(jax.grad(lambda p, b, k: loss_fn(p, b, rng=k)[0]))
    by_hand, rng = params, jax.random.PRNGKey(3)
    for batch in pk.data.batches(digits, BATCH, steps=STEPS):
        rng, key = jax.random.split(rng)
        slices = [jax.tree.map(lambda x, r=r: x[r * BATCH // n : (r + 1) * BATCH // n], batch) for r in range(n)]
        grads = [grad(by_hand, s, jax.random.fold_in(key, r)) for r, s in enumerate(slices)]
        mean = jax.tree.map(lambda *g: sum(g) / n, *grads)
        by_hand = jax.tree.map(lambda p, g: p - 0.1 * g, by_hand, mean)
    return by_hand


@pytest.mark.parametrize("name", PER_REPLICA)
@pytest.mark.parametrize("n", [2, 4])
def test_replicas_that_draw_their_own_dropout_do_as_documented(n, name, digits):
    """The step == the mean over replicas r of grad(loss)(params, slice_r, rng=fold_in(key, r)), by hand."""
    loss_fn, params = transformer(digits)
    per_replica, _, key = train(PER_REPLICA[name](n), loss_fn, params, digits, rng=3)
    single, single_key = single_device_with_dropout()
    np.testing.assert_array_equal(key, single_key)  # the state's key advances as on one device
    tree_allclose(per_replica, replicas_by_hand(n))
    assert max_diff(per_replica, single) > 1e-4  # other masks than one device's: not SingleDevice's parameters


def bn_model(axis_name=None):
    return pk.models.from_nnx(pk.models.CNN((8, 8, 1), 10, batch_norm=True, bn_axis_name=axis_name, rngs=nnx.Rngs(0)))


def train_bn(strategy, model, digits):
    loss_fn = pk.models.classifier_loss(model.apply)
    params, stats, _ = train(strategy, loss_fn, model.params, digits, model_state=model.model_state)
    return params, stats


@pytest.mark.parametrize("n", [2, 4])
def test_batchnorm_with_global_statistics_equals_single_device(n, digits):
    reference = train_bn(pk.SingleDevice(), bn_model(), digits)
    assert max_diff(reference[1], bn_model().model_state) > 1e-3  # the running statistics moved
    tree_allclose(train_bn(pk.Mirrored(n), bn_model(), digits), reference)  # jit: the batch is the global batch
    tree_allclose(train_bn(pk.MultiWorkerMirrored(jax.devices()[:n]), bn_model(), digits), reference)
    first_conv_split = [("convs/0/kernel", P(None, None, None, "model")), ("convs/0/bias", P("model")), (".*", P())]
    tree_allclose(
        train_bn(pk.TensorParallel(2, rules=first_conv_split, devices=jax.devices()[:2]), bn_model(), digits), reference
    )
    # BatchNorm(axis_name="data"): statistics averaged over the replicas (SyncBatchNorm)
    for name, make in PER_REPLICA.items():
        tree_allclose(train_bn(make(n), bn_model("data"), digits), reference, err_msg=name)


@pytest.mark.parametrize("name", PER_REPLICA)
def test_per_replica_batchnorm_statistics_differ_from_single_device(name, digits):
    reference = train_bn(pk.SingleDevice(), bn_model(), digits)
    per_replica = train_bn(PER_REPLICA[name](4), bn_model(), digits)
    # Each replica normalised with the statistics of its own 8 examples: other activations, other gradients.
    assert max_diff(per_replica[0], reference[0]) > 1e-4


def test_inference_uses_the_running_averages(digits):
    model = bn_model()
    batch = next(pk.data.batches(digits, BATCH, steps=1))
    logits, moved = model.apply(model.params, batch["x"], model_state=model.model_state)
    assert logits.shape == (BATCH, 10) and max_diff(moved, model.model_state) > 0
    frozen = model.apply(model.params, batch["x"], model_state=moved, train=False)
    assert frozen.shape == (BATCH, 10) and not jnp.allclose(frozen, logits)


class TestErrors:
    def test_a_loss_that_ignores_model_state_is_told_what_to_return(self, digits, mlp):
        loss_fn, params = mlp
        with pytest.raises(ValueError, match="has no state besides its parameters, but model_state was given"):
            pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 8, steps=1),
                   model_state={"x": jnp.zeros(1)})  # fmt: skip

    def test_functional_points_stateful_modules_to_from_nnx(self):
        with pytest.raises(ValueError, match="use pk.models.from_nnx"):
            pk.models.functional(pk.models.CNN((8, 8, 1), 10, batch_norm=True, rngs=nnx.Rngs(0)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make",
    [pk.SingleDevice, lambda: pk.Mirrored(2), lambda: pk.TensorParallel(2, devices=jax.devices()[:2])],
    ids=["single", "jit", "tensor"],
)
def test_resuming_continues_the_dropout_key_exactly(make, digits, tmp_path):
    loss_fn, params = transformer(digits)

    def run(steps, **options):
        batches = pk.data.batches(digits, BATCH, steps=steps)
        return pk.fit(make(), loss_fn, params, optax.sgd(0.1), batches, rng=5, **options)

    whole = run(STEPS)
    run(3, checkpoint_dir=tmp_path)
    resumed = run(STEPS, checkpoint_dir=tmp_path, resume=True)
    assert resumed.resumed_from == 3
    tree_allclose(resumed.params, whole.params, rtol=0, atol=0)
    key = resumed.strategy.unreplicate(resumed.state.rng)
    np.testing.assert_array_equal(key, whole.strategy.unreplicate(whole.state.rng))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make, axis", [(pk.SingleDevice, None), (lambda: pk.Mirrored(2, backend="pmap"), "data")], ids=["single", "pmap"]
)
def test_resuming_restores_batchnorm_statistics(make, axis, digits, tmp_path):
    model = bn_model(axis)
    loss_fn = pk.models.classifier_loss(model.apply)

    def run(steps, **options):
        batches = pk.data.batches(digits, BATCH, steps=steps)
        return pk.fit(make(), loss_fn, model.params, optax.sgd(0.1), batches, model_state=model.model_state, **options)

    whole = run(STEPS)
    run(3, checkpoint_dir=tmp_path)
    resumed = run(STEPS, checkpoint_dir=tmp_path, resume=True)
    tree_allclose(resumed.params, whole.params, rtol=0, atol=0)
    stats = resumed.strategy.unreplicate(resumed.state.model_state)
    tree_allclose(stats, whole.strategy.unreplicate(whole.state.model_state), rtol=0, atol=0)
