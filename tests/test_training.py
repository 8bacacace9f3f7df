"""fit: records, callbacks, timing kept apart from compiling, interruption, continuation."""

from __future__ import annotations

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import parallelkit as pk


class Recorder(pk.Callback):
    def __init__(self, stop_after: int | None = None):
        self.events, self.stop_after = [], stop_after

    def on_train_begin(self, info):
        self.events.append(("begin", info))

    def on_step_end(self, record):
        self.events.append(("step", record))
        if record.step == self.stop_after:
            raise KeyboardInterrupt  # as when a learner presses "interrupt kernel"

    def on_train_end(self, history, interrupted):
        self.events.append(("end", (len(history.records), interrupted)))


def test_fit_records_every_step_and_tells_callbacks(mlp, digits):
    loss_fn, params = mlp
    recorder = Recorder()
    result = pk.fit(
        pk.Mirrored(4), loss_fn, params, optax.adam(1e-2), pk.data.batches(digits, 64, steps=20), callbacks=[recorder]
    )
    kinds = [kind for kind, _ in recorder.events]
    assert kinds == ["begin"] + ["step"] * 20 + ["end"]
    info = recorder.events[0][1]
    assert (info.strategy, info.devices, info.simulated) == ("Mirrored(backend='jit', devices=4)", 4, True)
    records = result.history.records
    assert [r.step for r in records] == list(range(1, 21))
    assert [r.compiled for r in records] == [True] + [False] * 19
    assert all(set(r.metrics) == {"loss", "accuracy"} for r in records)
    assert result.history.losses[-1] < result.history.losses[0]  # it learns
    times = result.history.times
    assert times.first_step_seconds == records[0].seconds
    assert times.step_seconds == tuple(r.seconds for r in records[1:])
    assert times.median == pytest.approx(np.median([r.seconds for r in records[1:]]))
    assert times.samples_per_second == pytest.approx(64 / times.median)
    assert recorder.events[-1] == ("end", (20, False)) and not result.interrupted


def test_steps_limits_an_endless_iterator(mlp, digits):
    loss_fn, params = mlp
    result = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32), steps=5)
    assert len(result.history.records) == 5
    assert int(result.state.step) == 5


def test_interrupt_keeps_the_work_done(mlp, digits):
    loss_fn, params = mlp
    recorder = Recorder(stop_after=3)
    strategy = pk.Mirrored(backend="pmap")
    result = pk.fit(
        strategy, loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=10), callbacks=[recorder]
    )
    assert result.interrupted and len(result.history.records) == 3
    assert recorder.events[-1] == ("end", (3, True))
    uninterrupted = pk.fit(strategy, loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=3))
    tree_allclose(result.params, uninterrupted.params, rtol=0, atol=0)


def test_continuing_from_a_state_equals_one_long_run(mlp, digits):
    loss_fn, params = mlp
    strategy, tx = pk.Mirrored(), optax.adam(1e-3)
    batches = list(pk.data.batches(digits, 64, steps=8))
    first = pk.fit(strategy, loss_fn, params, tx, batches[:5])
    rest = pk.fit(strategy, loss_fn, params, tx, batches[5:], state=first.state)
    whole = pk.fit(strategy, loss_fn, params, tx, batches)
    assert int(strategy.unreplicate(rest.state.step)) == 8
    tree_allclose(rest.params, whole.params, rtol=0, atol=0)


def test_a_consumed_state_is_refused_with_a_sentence(mlp, digits, batch):
    loss_fn, params = mlp
    for strategy in (pk.SingleDevice(), pk.Mirrored(2), pk.Mirrored(2, backend="pmap"), pk.CentralStorage(2)):
        first = pk.fit(strategy, loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=2))
        pk.fit(strategy, loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=2), state=first.state)
        with pytest.raises(ValueError, match="already consumed by a training step"):  # first.state was donated
            pk.fit(strategy, loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=2), state=first.state)
        step, state = strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1))
        step(state, batch)
        with pytest.raises(ValueError, match="already consumed"):  # pmap would crash the process on it
            step(state, batch)


def test_a_non_finite_loss_stops_fit_naming_the_step(mlp, digits):
    loss_fn, params = mlp
    huge = optax.sgd(1e30)  # the parameters overflow on the first update; step 2's loss is not finite
    with pytest.raises(pk.NonFiniteLossError, match="at step 2 of the run") as raised:
        pk.fit(pk.Mirrored(2), loss_fn, params, huge, pk.data.batches(digits, 64, steps=5))
    assert len(raised.value.fit_result.history.records) == 2
    unchecked = pk.fit(pk.Mirrored(2), loss_fn, params, huge, pk.data.batches(digits, 64, steps=5), check_finite=False)
    assert len(unchecked.history.records) == 5 and not np.isfinite(unchecked.history.losses[-1])


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs SIGALRM")
def test_an_interrupt_during_dispatch_waits_for_the_step_to_be_bound(mlp, digits):
    """A Ctrl-C that lands while the step is being dispatched is held back until the new state is bound."""
    loss_fn, params = mlp

    class InterruptDuringNextStep(pk.Callback):
        def on_step_end(self, record):
            if record.step == 2:  # the signal arrives inside the next step call
                signal.setitimer(signal.ITIMER_REAL, 1e-4)

    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        result = pk.fit(pk.Mirrored(2), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=50),
                        callbacks=[InterruptDuringNextStep()])  # fmt: skip
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert result.interrupted and 2 <= len(result.history.records) < 50
    assert not any(x.is_deleted() for x in jax.tree.leaves(result.state))
    continued = pk.fit(pk.Mirrored(2), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 64, steps=1),
                       state=result.state)  # fmt: skip
    assert int(continued.state.step) == len(result.history.records) + 1


@pytest.mark.parametrize("make", [pk.SingleDevice, lambda: pk.Mirrored(2)])
def test_init_copies_arrays_already_on_the_device_so_donation_spares_them(make, mlp, batch):
    """The caller's parameters and optimizer state, already on device 0, survive a donating step unchanged."""
    loss_fn, params = mlp
    tx = optax.adam(1e-3)
    on_device = jax.tree.map(lambda x: x + 0, params)  # buffers of JAX's own on device 0, no host view
    opt_state = tx.init(on_device)
    before = jax.tree.map(lambda x: x + 0, (on_device, opt_state))  # not device_get: a host view blocks donation
    strategy = make()
    state = strategy.init(on_device, tx, opt_state=opt_state)
    strategy.step(loss_fn)(state, batch)
    mine = jax.tree.leaves((on_device, opt_state))
    assert not any(x.is_deleted() for x in mine)
    tree_allclose((on_device, opt_state), before, rtol=0, atol=0)


def test_loss_without_aux_is_accepted(mlp, batch):
    _, params = mlp
    apply, _ = pk.models.build("mlp", (8, 8, 1), 10)

    def loss_only(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(apply(p, b["x"]), b["y"]).mean()

    strategy = pk.Mirrored(backend="pmap")
    _, metrics = strategy.step(loss_only)(strategy.init(params, optax.sgd(0.1)), batch)
    assert set(metrics) == {"loss"}


def test_a_metric_with_axes_is_recorded_as_an_array_per_step(mlp, digits):
    loss_fn, params = mlp

    def with_counts(p, b):
        loss, aux = loss_fn(p, b)
        return loss, {**aux, "per_class": jnp.bincount(b["y"], length=10)}  # an array metric, exact counts

    batches = list(pk.data.batches(digits, 32, steps=3))
    history = pk.fit(pk.SingleDevice(), with_counts, params, optax.sgd(0.1), batches).history
    counts = history.metric("per_class")
    np.testing.assert_array_equal(counts, [np.bincount(b["y"], minlength=10) for b in batches])
    assert isinstance(history.records[0].metrics["loss"], float) and history.losses.shape == (3,)


def test_history_times_need_a_step():
    with pytest.raises(ValueError, match="No step"):
        _ = pk.History().times


def test_scaling_efficiency():
    assert pk.scaling_efficiency(800.0, 100.0, 8) == 1.0
    assert jax.device_count() == 8
