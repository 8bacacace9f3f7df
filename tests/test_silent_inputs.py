"""Inputs that used to fail silently, or with an error that blamed the wrong thing: each now says what to do.

Beside ``test_input_errors.py`` (a batch the loss cannot read or fit, idle devices): mixed
precision that never trains, names and devices a mesh or strategy cannot use, the loss's own
mistakes, and tools handed the wrong object.
"""

from __future__ import annotations

import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallelkit as pk
from parallelkit.core.skipped import SKIPPED_STEPS_LIMIT

FP16_OVERFLOW = pk.Precision("float32", "float16", loss_scale=2.0**20)  # the seed gradient 2^20 is inf in float16


def batches(digits, n: int, size: int = 64) -> list:
    return list(pk.data.batches(digits, size, steps=n))


def nan_gradient_loss(loss_fn):
    """``loss_fn`` plus ``0 x sqrt(|w - w|)`` of one head weight: the loss stays finite, that gradient is NaN."""

    def loss(params, batch):
        value, aux = loss_fn(params, batch)
        w = params["head"]["kernel"][0, 0]
        return value + 0.0 * jnp.sqrt(jnp.abs(w - w)), aux

    return loss


# --- fp16 runs that never train -------------------------------------------------------------------


def test_fit_stops_a_run_whose_fixed_scale_overflows_every_step_naming_the_gradients(mlp, digits):
    loss_fn, params = mlp
    with pytest.raises(pk.NonFiniteGradientsError) as info:
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches(digits, SKIPPED_STEPS_LIMIT + 5),
               precision=FP16_OVERFLOW)  # fmt: skip
    message = str(info.value)
    assert f"At step {SKIPPED_STEPS_LIMIT} of the run: {SKIPPED_STEPS_LIMIT} steps in a row were skipped" in message
    assert "loss scale 1.04858e+06" in message and "['head']['kernel']" in message and "Precision.fp16()" in message
    assert len(info.value.fit_result.history.records) == SKIPPED_STEPS_LIMIT  # the work done is handed back


def test_fit_stops_at_once_when_a_dynamic_scale_skips_at_its_floor(mlp, digits):
    loss_fn, params = mlp
    precision = pk.Precision.fp16(initial_scale=4.0)  # skips at 4, 2, then 1: the floor
    with pytest.raises(pk.NonFiniteGradientsError, match=r"At step 3 of the run: 3 steps .* floor of 1") as info:
        pk.fit(pk.Mirrored(2), nan_gradient_loss(loss_fn), params, optax.sgd(0.1), batches(digits, 10),
               precision=precision)  # fmt: skip
    # Only the weight under the square root has a gradient that is not finite.
    assert "these gradients are not finite: ['head']['kernel']." in str(info.value)


def test_a_hand_written_loop_with_a_nan_in_the_batch_warns_once(mlp, digits):
    loss_fn, params = mlp
    strategy = pk.SingleDevice()
    state, step = strategy.init(params, optax.sgd(0.1)), strategy.step(loss_fn, precision=pk.Precision.fp16())
    poisoned = dict(batches(digits, 1)[0], x=np.full((64, 8, 8, 1), np.nan, np.float32))
    with pytest.warns(pk.SkippedStepsWarning, match=r"16 steps in a row were skipped .* floor of 1") as caught:
        for _ in range(20):  # 2^15 halves to 1 in 15 steps; the 16th skips at the floor
            state, metrics = step(state, poisoned)
            jax.block_until_ready(metrics)  # the step reads each flag once ready, never waiting itself
    assert len([w for w in caught if w.category is pk.SkippedStepsWarning]) == 1
    assert "check the batches for nan" in str(caught[0].message).lower()


def test_a_run_that_recovers_gives_no_warning(mlp, digits):
    loss_fn, params = mlp
    strategy = pk.SingleDevice()
    state = strategy.init(params, optax.sgd(0.1))
    # More skipped steps in a row than a fixed scale may take: a dynamic one halves on each until it fits.
    step = strategy.step(loss_fn, precision=pk.Precision.fp16(initial_scale=2.0**40))
    with warnings.catch_warnings():
        warnings.simplefilter("error", pk.SkippedStepsWarning)
        for batch in batches(digits, 2 * SKIPPED_STEPS_LIMIT):
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
    assert bool(metrics["grads_finite"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compute": None}, r"compute=None\): not a dtype; use one of"),
        ({"compute": "float8_e4m3fn"}, "float8_e4m3fn is not a floating dtype a step can train in"),
        ({"params": "float64"}, r"64-bit mode is off.*jax_enable_x64"),
        ({"params": "float16", "compute": "float16", "loss_scale": "dynamic"}, r"Keep the parameters in float32"),
        ({"initial_scale": 1e40}, r"float32 holds \(at most 3.403e\+38"),
        ({"loss_scale": 1e39}, "a fixed number > 0 that float32 holds"),
    ],
)
def test_policies_that_cannot_train_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pk.Precision(**kwargs)


def test_float16_compute_without_a_loss_scale_warns_naming_fp16():
    with pytest.warns(pk.PrecisionWarning, match=r"underflow to 0 .* pk.Precision.fp16\(\)"):
        pk.Precision(compute="float16")


def test_numpy_numbers_are_numbers(mlp, batch):
    assert pk.Precision(loss_scale=np.float32(8)).loss_scale == 8.0
    assert pk.Precision.fp16(period=np.int64(4)).period == 4
    loss_fn, params = mlp
    strategy = pk.Mirrored(2)
    _, metrics = strategy.step(loss_fn, accumulate=np.int64(2))(strategy.init(params, optax.sgd(0.1)), batch)
    assert np.isfinite(float(metrics["loss"]))


def test_resuming_says_which_loss_scale_wins(mlp, digits, tmp_path, caplog):
    loss_fn, params = mlp
    data = batches(digits, 4)
    fp16 = pk.Precision.fp16(period=2, initial_scale=1024.0)
    first = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data, steps=2, precision=fp16,
                   checkpoint_dir=tmp_path / "a", checkpoint_every=2)  # fmt: skip
    assert float(first.state.loss_scale.scale) == 2048.0
    with caplog.at_level(logging.WARNING, logger="parallelkit.run.training"):
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data, precision=pk.Precision.fp16(),
               checkpoint_dir=tmp_path / "a", resume=True)  # fmt: skip
    assert "Resumed with the checkpoint's loss scale 2048" in caplog.text and "initial_scale=32768" in caplog.text
    with pytest.warns(pk.PrecisionWarning, match=r"holds a dynamic loss scale \(\d+\), but .* has none"):
        # steps=4: the run's 4 steps are all done, so that training none is not told as batches ending early
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data, steps=4, precision=pk.Precision.bf16(),
               checkpoint_dir=tmp_path / "a", resume=True)  # fmt: skip
    pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data, steps=2, checkpoint_dir=tmp_path / "b")
    with pytest.warns(pk.PrecisionWarning, match=r"holds no loss scale .* starts one at initial_scale=32768"):
        pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), data, precision=pk.Precision.fp16(),
               checkpoint_dir=tmp_path / "b", resume=True)  # fmt: skip


# --- names, meshes and devices --------------------------------------------------------------------


def test_constrain_refuses_a_string_and_under_rules_a_name_nothing_knows():
    x = jnp.ones((2, 3))
    for names in ("batch", "ab"):
        with pytest.raises(TypeError, match=r"pass one name per dimension as a tuple"):
            pk.constrain(x, names)
    mesh = pk.mesh.make_mesh(jax.devices()[:2], data=2)
    rules = pk.AxisRules((("batch", "data"),))
    with pk.axes.active_rules(mesh, rules):
        assert pk.constrain(x, ("batch", "embed")).shape == (2, 3)  # a kit name no rule mentions: the compiler's
        with pytest.raises(ValueError, match=r"knows 'nonexistent' .* \('nonexistent', None\)"):
            pk.constrain(x, ("batch", "nonexistent"))
    assert pk.constrain(x, ("batch", "nonexistent")) is x  # no rules active: nothing to check against


@pytest.mark.parametrize(("name", "kit"), [("Model", "model"), ("SEQ", "seq"), ("data ", "data")])
def test_mesh_axis_names_that_differ_from_the_kits_only_by_case_or_spaces_are_refused(name, kit):
    with pytest.raises(ValueError, match=rf"is not the kit's '{kit}'"):
        pk.mesh.make_mesh(jax.devices(), **{name: 8})


def test_an_empty_axis_name_is_refused_and_a_name_of_ones_own_kept():
    with pytest.raises(ValueError, match="is empty"):
        pk.mesh.make_mesh(jax.devices(), **{"": 8})
    assert dict(pk.mesh.make_mesh(jax.devices(), data=2, pipe=4).shape) == {"data": 2, "pipe": 4}


def test_a_device_count_makes_a_mesh_and_devices_listed_twice_are_refused():
    assert dict(pk.mesh.make_mesh(8, data=8).shape) == {"data": 8}
    d0 = jax.devices()[0]
    for backend in ("jit", "pmap"):
        with pytest.raises(ValueError, match="lists device 0 more than once"):
            pk.Mirrored(devices=[d0, d0], backend=backend)
    with pytest.raises(TypeError, match="'cpu:0', which is not a JAX device"):
        pk.Mirrored(devices=["cpu:0", "cpu:1"])


@pytest.mark.parametrize(
    "make",
    [lambda: pk.ContextParallel(seq=3, data=2), lambda: pk.ExpertParallel(expert=3, data=2)],
    ids=["ContextParallel", "ExpertParallel"],
)
def test_an_idle_device_warning_never_offers_the_same_configuration(make):
    with pytest.warns(pk.DeviceSubsetWarning) as caught:
        strategy = make()
    offered = str(caught[0].message).split("or use every device")[1]
    assert repr(strategy).split("(")[0] + "(" not in offered and "x data = 8" in offered


def test_an_unbatched_token_array_is_told_to_gain_a_batch_axis():
    strategy = pk.ContextParallel(seq=2, data=2, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"give it one \(batch\['x'\]\[None\], shape \(1, 16\)\)"):
        strategy.place_batch({"x": np.zeros(16, np.int32)})


# --- the loss's own mistakes ----------------------------------------------------------------------


def test_a_key_error_on_the_losss_own_dictionary_is_not_blamed_on_the_batch(mlp, batch):
    loss_fn, params = mlp

    def reads_a_metric_it_lacks(p, b):
        value, aux = loss_fn(p, b)
        return value + aux["load_balance_loss"], aux

    strategy = pk.SingleDevice()
    with pytest.raises(KeyError, match="load_balance_loss") as info:
        strategy.step(reads_a_metric_it_lacks)(strategy.init(params, optax.sgd(0.1)), batch)
    assert not isinstance(info.value, pk.core.contract.LossInputError)
    assert "did not come from reading the batch (whose keys are 'x', 'y')" in "".join(info.value.__notes__)

    def reads_the_batch(p, b):
        return loss_fn(p, {"x": b["image"], "y": b["y"]})

    with pytest.raises(ValueError, match=r"reads batch\['image'\], but the batch has no key"):
        strategy.step(reads_the_batch)(strategy.init(params, optax.sgd(0.1)), batch)


@pytest.mark.parametrize(
    ("loss", "error", "match"),
    [
        (lambda p, b: jnp.ones(b["y"].shape) * p["head"]["bias"].sum(), ValueError, r"shape \(64,\).* the mean"),
        (lambda p, b: jnp.int32(3), TypeError, r"an integer \(int32\), which has no gradient"),
    ],
    ids=["per-example", "integer"],
)
def test_a_loss_that_is_not_one_floating_number_says_so(mlp, batch, loss, error, match):
    _, params = mlp
    strategy = pk.Mirrored(2)
    with pytest.raises(error, match=match):
        strategy.step(loss)(strategy.init(params, optax.sgd(0.1)), batch)


def test_a_scalar_in_the_batch_is_named(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.SingleDevice()
    with pytest.raises(ValueError, match=r"batch\['scale'\] = np.float32\(2.0\), which has no leading \(batch\)"):
        strategy.step(loss_fn)(strategy.init(params, optax.sgd(0.1)), dict(batch, scale=np.float32(2.0)))


def test_a_pipeline_given_a_whole_model_loss_is_told_about_head_losses(mlp, batch):
    layers = pk.models.as_layers(pk.models.MLP(64, (16,), 10, rngs=nnx.Rngs(0)))
    strategy = pk.Pipeline(layers.apply, 2, microbatches=2, devices=jax.devices()[:2])
    loss_fn, _ = mlp
    with pytest.raises(ValueError, match=r"A pipeline's loss is a head loss, head_loss\(output, batch\)"):
        strategy.step(loss_fn)(strategy.init(layers.params, optax.sgd(0.1)), batch)


# --- tools handed the wrong object ----------------------------------------------------------------


@pytest.mark.parametrize(
    "tool",
    [pk.inspect.flops, pk.profile, pk.inspect.collectives, pk.inspect.memory_per_device],
    ids=["flops", "profile", "collectives", "memory_per_device"],
)
def test_tools_name_what_they_were_given_and_what_they_take(mlp, batch, tool):
    loss_fn, params = mlp
    strategy = pk.SingleDevice()
    state, step = strategy.init(params, optax.sgd(0.1)), strategy.step(loss_fn)
    with pytest.raises(TypeError, match=r"got the strategy SingleDevice.*pass step = strategy.step\(loss_fn\)"):
        tool(strategy, state, batch)
    with pytest.raises(TypeError, match=r"got 'loss_fn'.*not a compiled step"):
        tool(loss_fn, state, batch)
    with pytest.raises(TypeError, match=r"got a dict as the state: .*not the parameters"):
        tool(step, params, batch)


def test_a_capacity_factor_must_be_a_finite_python_number():
    x = jnp.ones((16, 8))
    params = pk.experts.init_moe_params(jax.random.key(0), dim=8, hidden=16, experts=4)
    for factor, error, match in [
        (float("inf"), ValueError, r"> 0 and finite, got inf.*experts / top_k keeps every token"),
        ("1.25", TypeError, r"capacity_factor='1.25' is not a number"),
    ]:
        with pytest.raises(error, match=match):
            pk.experts.moe_layer(x, params, capacity_factor=factor)
    with pytest.raises(TypeError, match=r"capacity_factor is traced by jax.jit.*static_argnames"):
        jax.jit(lambda f: pk.experts.moe_layer(x, params, capacity_factor=f))(1.25)
    assert pk.experts.moe_layer(x, params, capacity_factor=np.float32(1.25))[0].shape == (16, 8)
    with pytest.raises(ValueError, match=r"capacity_factor must be > 0 and finite, got inf"):
        pk.models.GPT(256, max_length=8, dim=8, heads=2, depth=1, experts=4, capacity_factor=float("inf"),
                      rngs=nnx.Rngs(0))  # fmt: skip


def test_an_async_parameter_server_takes_a_batch_of_new_shape(mlp, digits):
    loss_fn, params = mlp
    strategy = pk.ParameterServer(2, mode="async", devices=2)
    state, step = strategy.init(params, optax.sgd(0.1)), strategy.step(loss_fn)
    state, _ = step(state, batches(digits, 1, 64)[0])
    state, metrics = step(state, batches(digits, 1, 32)[0])  # each worker compiles for the new slices
    assert int(state.step) == 4 and np.isfinite(float(metrics["loss"]))


def test_multiworker_unreplicate_takes_host_arrays():
    np.testing.assert_array_equal(pk.MultiWorkerMirrored().unreplicate({"w": np.ones(3)})["w"], np.ones(3))


@pytest.mark.parametrize(
    "kwargs",
    [{"steps": -1}, {"steps": 2.5}, {"steps": True}, {"checkpoint_every": 0}, {"prefetch": -1}, {"prefetch": "2"}],
)
def test_fit_refuses_a_count_that_would_train_silently_wrong(mlp, digits, kwargs):
    """steps=-1 trained zero steps and returned as if it had trained; the others failed far from their cause."""
    loss, params = mlp
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"fit\({name}={re.escape(repr(value))}\): give a whole number of at least"):
        pk.fit(pk.SingleDevice(), loss, params, optax.sgd(0.1), pk.data.batches(digits, 8, steps=2), **kwargs)
