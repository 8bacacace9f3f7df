"""fit loses nothing: a non-finite step hands back the last finite state; short or wrong batches are told."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import parallelkit as pk
from parallelkit import ShortRunWarning
from parallelkit.core import step as step_module


@pytest.fixture(scope="module")
def poisoned(digits):
    """Four batches of 64; the third holds a NaN input, so step 3's loss (and gradients) are NaN."""
    batches = list(pk.data.batches(digits, 64, steps=4))
    x = batches[2]["x"].copy()
    x[0, 0, 0, 0] = np.nan
    batches[2] = {**batches[2], "x": x}
    return batches


def _host(strategy, state):
    """The state's parameters, optimizer state and counter, one host copy each."""
    return strategy.unreplicate((state.params, state.opt_state, state.step, state.loss_scale))


def _all_finite(tree) -> bool:
    return all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    ("make", "precision"),
    [
        (lambda: pk.Mirrored(backend="jit"), None),
        (pk.SingleDevice, None),
        (lambda: pk.FullySharded(3), None),
        (lambda: pk.Mirrored(4, backend="pmap"), None),
        (lambda: pk.Mirrored(4), pk.Precision.fp16()),
    ],
    ids=["mirrored-jit", "single", "zero3", "mirrored-pmap", "mirrored-fp16"],
)
def test_a_nan_loss_hands_back_the_state_after_the_step_before(mlp, poisoned, make, precision):
    loss_fn, params = mlp
    strategy, tx = make(), optax.adam(1e-3)
    with pytest.raises(pk.NonFiniteLossError, match="at step 3 of the run") as raised:
        pk.fit(strategy, loss_fn, params, tx, poisoned, precision=precision)
    kept = raised.value.fit_result
    stopped = pk.fit(strategy, loss_fn, params, tx, poisoned, steps=2, precision=precision)
    assert _all_finite(_host(strategy, kept.state))
    tree_allclose(_host(strategy, kept.state), _host(strategy, stopped.state))
    assert int(np.asarray(_host(strategy, kept.state)[2]).reshape(-1)[0]) == 2
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


def test_a_strategy_that_applies_the_step_is_named_in_the_note(mlp, poisoned):
    """CentralStorage's step is not train_step: it applies the NaN update, and the note says so."""
    loss_fn, params = mlp
    strategy = pk.CentralStorage(2)
    with pytest.raises(pk.NonFiniteLossError) as raised:
        pk.fit(strategy, loss_fn, params, optax.adam(1e-3), poisoned)
    notes = "".join(raised.value.__notes__)
    assert (
        f"holds the state after step 3, whose loss was not finite: {strategy!r} applies such a step's update" in notes
    )
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


@pytest.mark.parametrize("select", [False, True], ids=["cond", "select"])
def test_a_step_that_keeps_finite_returns_its_input_state_unchanged(mlp, poisoned, select):
    """Both ways of keeping it (lax.cond on CPU devices, a select elsewhere); a hand-written loop's step applies it."""
    loss_fn, params = mlp
    strategy = pk.Mirrored(2)
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
