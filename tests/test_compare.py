"""The one runner: strategies side by side from one start, each compared with a reference."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import parallelkit as pk
from parallelkit.run.compare import fresh_batches, run_side_by_side


@pytest.fixture(scope="module")
def setup():
    apply, params = pk.models.build("mlp", (64,), 10)
    batches = list(pk.data.batches(pk.data.digits(), 32, steps=5))
    return pk.models.classifier_loss(apply), params, batches


def _strategies():
    return {
        "SingleDevice": pk.SingleDevice(),
        "Mirrored(jit)": pk.Mirrored(2),
        "PS(2, async)": pk.ParameterServer(2, mode="async", devices=2),
    }


@pytest.mark.parametrize("interleave", [False, True])
def test_every_run_is_compared_with_the_reference_and_timed_after_its_warmup(setup, interleave):
    loss, params, batches = setup
    runs = run_side_by_side(
        _strategies(), loss, params, optax.sgd(0.1), batches, warmup=1, interleave=interleave,
        meant_to_differ={"PS(2, async)"},
    )  # fmt: skip
    assert list(runs) == ["SingleDevice", "Mirrored(jit)", "PS(2, async)"]
    one, two, ps = runs.values()
    assert one.max_param_diff == 0 and one.equals_reference and one.meant_to_equal
    assert two.equals_reference and two.devices == 2  # rtol 1e-5, atol 1e-6 of SingleDevice
    pk.tour.assert_close(two.params, one.params)
    assert not ps.meant_to_equal and not ps.equals_reference and ps.max_param_diff > 1e-4  # by design
    for run in runs.values():  # 5 steps: the first apart, 1 warm-up left out, 3 timed
        assert len(run.result.history.records) == 5 and len(run.times.step_seconds) == 3
        assert run.times.batch_size == 32 and np.isfinite(run.times.median)


def test_both_orders_train_the_same_parameters(setup):
    loss, params, batches = setup
    strategies = {"SingleDevice": pk.SingleDevice()}
    one = run_side_by_side(strategies, loss, params, optax.sgd(0.1), batches)["SingleDevice"]
    two = run_side_by_side(strategies, loss, params, optax.sgd(0.1), batches, interleave=True)["SingleDevice"]
    pk.tour.assert_close(one.params, two.params, rtol=0, atol=0)


def test_against_compares_with_the_parameters_given(setup):
    loss, params, batches = setup
    run = run_side_by_side({"one": pk.SingleDevice()}, loss, params, optax.sgd(0.1), batches, against=params)["one"]
    assert not run.equals_reference and run.max_param_diff > 0  # trained parameters are not the initial ones


def test_bad_input_is_refused_before_anything_trains(setup):
    loss, params, batches = setup
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match="at least one strategy"):
        run_side_by_side({}, loss, params, tx, batches)
    with pytest.raises(ValueError, match="reference='nothing' is not one of"):
        run_side_by_side({"one": pk.SingleDevice()}, loss, params, tx, batches, reference="nothing")
    with pytest.raises(ValueError, match="one-shot iterator"):
        fresh_batches(iter(batches))
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match=r"warmup=.*whole number of steps >= 0"):
            run_side_by_side({"one": pk.SingleDevice()}, loss, params, tx, batches, warmup=bad)
        with pytest.raises(ValueError, match=r"steps=.*whole number of steps >= 1"):
            run_side_by_side({"one": pk.SingleDevice()}, loss, params, tx, batches, steps=bad if bad != -1 else 0)
    with pytest.raises(ValueError, match="interleave=False"):
        run_side_by_side({"one": pk.SingleDevice()}, loss, params, tx, batches, interleave=True, callbacks=lambda n: [])
