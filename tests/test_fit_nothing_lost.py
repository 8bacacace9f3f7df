"""fit loses nothing: a non-finite step hands back the last finite state; short or wrong batches are told."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose

import parallelkit as pk
from parallelkit import ShortRunWarning
from parallelkit.core import step as step_module


@pytest.fixture(scope="module")
def poisoned(digits):
    """Four batches of 64; the third holds a NaN input in every eighth example (so in every worker's slice, for
    up to 8 workers), so step 3's loss (and gradients) are NaN."""
    batches = list(pk.data.batches(digits, 64, steps=4))
    x = batches[2]["x"].copy()
    x[::8, 0, 0, 0] = np.nan
    batches[2] = {**batches[2], "x": x}
    return batches


@pytest.fixture(scope="module")
def deep_mlp(digits):
    """The kit's MLP as four layers, for pipelines: 64 -> 64 -> 32 -> 16 -> 10."""
    return pk.models.as_layers(pk.models.MLP(64, (64, 32, 16), digits.num_classes, rngs=nnx.Rngs(0)))


def _host(strategy, state):
    """The state's parameters, optimizer state and counter, one host copy each."""
    return strategy.unreplicate((state.params, state.opt_state, state.step, state.loss_scale))


def _all_finite(tree) -> bool:
    return all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(tree))


def _pipeline(deep_mlp, **options):
    layers, params = deep_mlp
    return pk.Pipeline(layers, 2, microbatches=4, **options), pk.models.cross_entropy, params


# Each case: (mlp, deep_mlp) -> (strategy, loss_fn, params).
STRATEGIES = {
    "mirrored-jit": lambda mlp, _: (pk.Mirrored(backend="jit"), *mlp),
    "single": lambda mlp, _: (pk.SingleDevice(), *mlp),
    "zero3": lambda mlp, _: (pk.FullySharded(3), *mlp),
    "mirrored-pmap": lambda mlp, _: (pk.Mirrored(4, backend="pmap"), *mlp),
    "central-storage": lambda mlp, _: (pk.CentralStorage(2), *mlp),
    "parameter-server": lambda mlp, _: (pk.ParameterServer(3, devices=2), *mlp),
    "parameter-server-async": lambda mlp, _: (pk.ParameterServer(2, mode="async", devices=2), *mlp),
    "pipeline": lambda _, deep_mlp: _pipeline(deep_mlp),
    "pipeline-1f1b-data": lambda _, deep_mlp: _pipeline(deep_mlp, schedule="1f1b", data=2),
}
FP16 = {"mirrored-fp16": "mirrored-jit", "central-storage-fp16": "central-storage", "pipeline-fp16": "pipeline"}


@pytest.mark.filterwarnings("ignore::parallelkit.DeviceSubsetWarning")  # pipelines leave devices idle on purpose
@pytest.mark.parametrize("case", [*STRATEGIES, *FP16])
def test_a_nan_loss_hands_back_the_state_after_the_step_before(mlp, deep_mlp, poisoned, case):
    strategy, loss_fn, params = STRATEGIES[FP16.get(case, case)](mlp, deep_mlp)
    tx, precision = optax.adam(1e-3), pk.Precision.fp16() if case in FP16 else None
    with pytest.raises(pk.NonFiniteLossError, match="at step 3 of the run") as raised:
        pk.fit(strategy, loss_fn, params, tx, poisoned, precision=precision)
    kept = raised.value.fit_result
    strategy = STRATEGIES[FP16.get(case, case)](mlp, deep_mlp)[0]  # a fresh one: an async run's workers are its own
    stopped = pk.fit(strategy, loss_fn, params, tx, poisoned, steps=2, precision=precision)
    assert _all_finite(_host(strategy, kept.state))
    tree_allclose(_host(strategy, kept.state), _host(strategy, stopped.state))
    updates = getattr(strategy, "updates_per_step", 1)
    assert int(np.asarray(_host(strategy, kept.state)[2]).reshape(-1)[0]) == 2 * updates
    notes = "".join(raised.value.__notes__)
    assert "holds the state after step 2, the last step whose loss was finite (step 3 changed nothing)" in notes
    assert "All its parameters and optimizer state are finite." in notes
    assert len(kept.history.records) == 3 and np.isnan(kept.history.losses[-1])  # the step is recorded, its loss NaN


def test_a_resumed_run_names_the_steps_of_the_run(mlp, poisoned, tmp_path):
    loss_fn, params = mlp
    strategy, tx = pk.SingleDevice(), optax.adam(1e-3)
    pk.fit(strategy, loss_fn, params, tx, poisoned, steps=1, checkpoint_dir=tmp_path)
    with pytest.raises(pk.NonFiniteLossError, match="at step 3 of the run") as raised:
        pk.fit(strategy, loss_fn, params, tx, poisoned, checkpoint_dir=tmp_path, resume=True)
    assert "holds the state after step 2, the last step whose loss was finite" in "".join(raised.value.__notes__)
    assert int(raised.value.fit_result.state.step) == 2


def test_a_nan_loss_at_the_first_step_hands_back_the_initial_state(mlp, poisoned):
    loss_fn, params = mlp
    with pytest.raises(pk.NonFiniteLossError, match="at step 1 of the run") as raised:
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.adam(1e-3), poisoned[2:])
    assert "holds the state the run started from (step 1 changed nothing)" in "".join(raised.value.__notes__)
    tree_allclose(raised.value.fit_result.params, params, rtol=0, atol=0)


def test_an_async_push_whose_loss_is_not_finite_changes_nothing_and_the_note_counts_them(mlp, digits):
    """One worker's slice of step 3 is NaN: its push changes nothing, the other worker's is applied."""
    loss_fn, params = mlp
    batches = list(pk.data.batches(digits, 64, steps=4))
    x = batches[2]["x"].copy()
    x[0, 0, 0, 0] = np.nan  # in the first worker's slice only
    batches[2] = {**batches[2], "x": x}
    strategy = pk.ParameterServer(2, mode="async", devices=2)
    with pytest.raises(pk.NonFiniteLossError, match="at step 3 of the run") as raised:
        pk.fit(strategy, loss_fn, params, optax.adam(1e-3), batches)
    state = raised.value.fit_result.state
    assert int(np.asarray(_host(strategy, state)[2])) == 5  # two steps of two pushes, and one push of step 3
    assert _all_finite(_host(strategy, state))
    notes = "".join(raised.value.__notes__)
    assert (
        "holds the state after step 2 and the 1 of step 3's 2 updates whose loss was finite (the other 1 changed "
        "nothing). All its parameters and optimizer state are finite." in notes
    )


class _NeverKeeping:
    """A step that applies every update: the ``keep_finite`` pk.fit sets on it is not passed on."""

    def __init__(self, step):
        self.step, self.keep_finite = step, False

    def __call__(self, state, batch):
        return self.step(state, batch)


def test_a_step_that_applies_a_non_finite_update_is_told_in_the_note(mlp, poisoned, monkeypatch):
    loss_fn, params = mlp
    strategy = pk.CentralStorage(2)
    step = _NeverKeeping(strategy.step(loss_fn))
    monkeypatch.setattr(strategy, "step", lambda *args, **kwargs: step)
    with pytest.raises(pk.NonFiniteLossError) as raised:
        pk.fit(strategy, loss_fn, params, optax.adam(1e-3), poisoned)
    notes = "".join(raised.value.__notes__)
    assert f"holds the state after step 3, whose loss was not finite: {strategy!r} applied its update" in notes
    assert "Not all its parameters and optimizer state are finite. Pass checkpoint_dir" in notes
    assert not _all_finite(_host(strategy, raised.value.fit_result.state))


def test_gradients_not_finite_under_a_finite_loss_are_told(digits):
    """sqrt at 0 has an infinite slope: step 2's loss is finite, its gradients NaN; step 3's loss is NaN."""

    def loss_fn(params, batch):
        logits = batch["x"].reshape(len(batch["x"]), -1) @ params["w"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss + jnp.sqrt(jnp.sum(params["w"] ** 2) * batch["scale"].mean())  # scale 0: sqrt(0)

    batches = [
        {**b, "scale": np.full(len(b["y"]), 0.0 if i == 1 else 1e-6, np.float32)}
        for i, b in enumerate(pk.data.batches(digits, 64, steps=4))
    ]
    params = {"w": np.full((64, digits.num_classes), 0.01, np.float32)}
    with pytest.raises(pk.NonFiniteLossError, match="at step 3 of the run") as raised:
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches)
    notes = "".join(raised.value.__notes__)
    assert "holds the state after step 2, the last step whose loss was finite (step 3 changed nothing)" in notes
    assert "Not all its parameters and optimizer state are finite: an update whose loss was finite" in notes


@pytest.mark.filterwarnings("ignore::parallelkit.DeviceSubsetWarning")
@pytest.mark.parametrize("case", ["mirrored-jit", "central-storage", "parameter-server", "pipeline"])
@pytest.mark.parametrize("select", [False, True], ids=["cond", "select"])
def test_a_step_that_keeps_finite_returns_its_input_state_unchanged(mlp, deep_mlp, poisoned, case, select):
    """Both ways of keeping it (lax.cond on CPU devices, a select elsewhere); a hand-written loop's step applies it."""
    strategy, loss_fn, params = STRATEGIES[case](mlp, deep_mlp)
    kept, applied = strategy.step(loss_fn), strategy.step(loss_fn)
    kept.keep_finite = True
    if select:
        kept._keep = step_module._selected  # what a step on accelerators compiles
    kept_state, applied_state = strategy.init(params, optax.adam(1e-3)), strategy.init(params, optax.adam(1e-3))
    for batch in poisoned[:2]:
        kept_state, _ = kept(kept_state, batch)
        applied_state, _ = applied(applied_state, batch)
    before = _host(strategy, kept_state)
    kept_state, metrics = kept(kept_state, poisoned[2])
    applied_state, _ = applied(applied_state, poisoned[2])
    assert np.isnan(float(metrics["loss"]))
    tree_allclose(_host(strategy, kept_state), before, rtol=0, atol=0)
    assert not _all_finite(_host(strategy, applied_state)[0])


def test_an_async_step_that_kept_its_pushes_continues_the_state_it_returned(mlp, poisoned):
    """Its check that it continues its own run counts the pushes that changed nothing."""
    loss_fn, params = mlp
    strategy = pk.ParameterServer(2, mode="async", devices=2)
    step, state = strategy.step(loss_fn), strategy.init(params, optax.adam(1e-3))
    step.keep_finite = True
    losses = []
    for batch in poisoned:  # step 3's pushes change nothing; step 4 continues from step 2's state
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isnan(losses[2]) and np.isfinite(losses[3])
    assert int(np.asarray(_host(strategy, state)[2])) == 6 and _all_finite(_host(strategy, state))


def test_keeping_finite_trains_as_a_plain_step_does(mlp, digits):
    loss_fn, params = mlp
    strategy, batches = pk.Mirrored(2), list(pk.data.batches(digits, 64, steps=3))
    fitted = pk.fit(strategy, loss_fn, params, optax.adam(1e-3), batches)
    step, state = strategy.step(loss_fn), strategy.init(params, optax.adam(1e-3))
    for batch in batches:
        state, _ = step(state, batch)
    tree_allclose(_host(strategy, fitted.state), _host(strategy, state))


def test_batches_that_end_before_steps_warn(mlp, digits):
    loss_fn, params = mlp
    batches = list(pk.data.batches(digits, 32, steps=3))
    with pytest.warns(ShortRunWarning, match=r"pk.fit\(steps=100\) trained 3 of the 100 steps asked: the batches "):
        result = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches, steps=100)
    assert len(result.history.records) == 3
    pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches, steps=3)  # as many as asked: no warning
    pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches, steps=0)


def test_empty_or_used_up_batches_warn_and_train_nothing(mlp, digits):
    loss_fn, params = mlp
    used = pk.data.batches(digits, 32, steps=2)
    list(used)
    for batches, steps in ((used, None), ([], None), (iter([]), 5)):
        with pytest.warns(ShortRunWarning, match="the batches yielded none .an empty or used-up iterator."):
            result = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches, steps=steps)
        assert result.history.records == []
        tree_allclose(result.params, params, rtol=0, atol=0)


def test_a_resumed_run_with_nothing_left_warns(mlp, digits, tmp_path):
    loss_fn, params = mlp
    batches = list(pk.data.batches(digits, 32, steps=2))
    pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches, checkpoint_dir=tmp_path)
    with pytest.warns(ShortRunWarning, match="trained no step: the batches ended with the 2 the checkpoint had"):
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches, checkpoint_dir=tmp_path, resume=True)


def test_one_batch_or_a_dataset_as_batches_is_refused_saying_what_to_pass(mlp, digits, batch):
    loss_fn, params = mlp
    cases = (
        (batch, r"got one batch \(a dict with keys \['x', 'y'\]\), not an iterable of batches. Pass \[batch\]"),
        (digits, r"got the dataset 'digits' itself, not batches of it. Pass pk.data.batches\(dataset, batch_size"),
        (64, r"got a value of type int, which is not an iterable of batches"),
    )
    for batches, message in cases:
        with pytest.raises(TypeError, match=message):
            pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches)
