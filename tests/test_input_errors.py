"""Inputs that need clear words: a batch the loss cannot read or fit, and devices left idle or shared.

Every strategy's loss runs through one guard (``parallelkit.core.contract.guard_inputs``)
while its step is traced, so each case below fails at the first call, before any program
runs, and names the strategy, the batch's arrays and the weights.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallelkit as pk

# Two or four devices each (the suite's other devices stay idle, so the subsets are named).
STRATEGIES = {
    "SingleDevice": lambda: pk.SingleDevice(),
    "Mirrored(jit)": lambda: pk.Mirrored(2, backend="jit"),
    "Mirrored(pmap)": lambda: pk.Mirrored(2, backend="pmap"),
    "Mirrored(ring)": lambda: pk.Mirrored(2, allreduce="ring"),
    "CentralStorage": lambda: pk.CentralStorage(2),
    "PS(sync)": lambda: pk.ParameterServer(2, devices=2),
    "PS(async)": lambda: pk.ParameterServer(2, mode="async", devices=2),
    "TensorParallel": lambda: pk.TensorParallel(2, devices=jax.devices()[:2]),
    "FullySharded": lambda: pk.FullySharded(3, 2),
    "Hybrid": lambda: pk.Hybrid(2, 2, devices=jax.devices()[:4]),
    "MultiWorkerMirrored": lambda: pk.MultiWorkerMirrored(jax.devices()[:2]),
    "Pipeline": None,  # built from the model's layers, below
}


@pytest.fixture(scope="module")
def layers():
    """The kit's MLP 64-16-10 as two layers, for the pipeline."""
    return pk.models.as_layers(pk.models.MLP(64, (16,), 10, rngs=nnx.Rngs(0)))


def setup(name: str, mlp, layers):
    """(strategy, step, state, first weight's label and shape) for the strategy ``name``."""
    if name == "Pipeline":
        strategy = pk.Pipeline(layers.apply, 2, microbatches=2, devices=jax.devices()[:2])
        loss_fn, params, first = pk.models.cross_entropy, layers.params, "0/kernel (64, 16)"
    else:
        strategy = STRATEGIES[name]()
        (loss_fn, params), first = mlp, "hidden/0/kernel (64, 64)"
    return strategy, strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1)), first


def raised(step, state, batch) -> pytest.ExceptionInfo:
    with pytest.raises(ValueError) as info:
        step(state, batch)
    return info


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_batch_without_the_key_the_loss_reads_names_the_key_the_batch_keys_and_the_strategy(name, mlp, layers, batch):
    strategy, step, state, _ = setup(name, mlp, layers)
    info = raised(step, state, {"image": batch["x"], "y": batch["y"]})
    message = str(info.value)
    assert message.startswith(f"{strategy!r}: ")
    assert "batch['x']" in message and "no key 'x'" in message and "its keys: 'image', 'y'" in message
    assert isinstance(info.value, pk.core.contract.LossInputError)
    assert isinstance(info.value.__cause__, KeyError)  # the loss's own error, chained
    # Nothing ran, so nothing was consumed: the same step then trains on a good batch.
    state, metrics = step(state, batch)
    updates = strategy.num_replicas if name == "PS(async)" else 1  # async: one update per worker's push
    assert np.isfinite(float(metrics["loss"])) and int(strategy.unreplicate(state.step)) == updates


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_wrong_feature_size_names_the_batch_array_and_the_weights_with_their_shapes(name, mlp, layers, batch):
    strategy, step, state, first = setup(name, mlp, layers)
    narrow = {"x": batch["x"].reshape(64, -1)[:, :32], "y": batch["y"]}
    info = raised(step, state, narrow)
    message = str(info.value)
    assert message.startswith(f"{strategy!r}: ")
    assert "The batch holds x (64, 32) float32, y (64,) int32" in message
    assert first in message
    assert "No weight takes x's features: x has 32 values on its last axis" in message
    # JAX's own error stays in the message and in the chain
    assert isinstance(info.value.__cause__, TypeError) and "dot_general" in str(info.value.__cause__)
    assert "dot_general" in message


def test_the_weights_whose_input_size_the_error_names_come_first(digits, batch):
    apply, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    strategy = pk.SingleDevice()
    step, state = strategy.step(pk.models.classifier_loss(apply)), strategy.init(params, optax.sgd(0.1))
    message = str(raised(step, state, {"x": batch["x"][:, :, :4], "y": batch["y"]}).value)
    assert "got (4,) and (8,)" in message  # JAX's words: the rows of 4 pixels meet the embedding's 8 inputs
    assert "The batch holds x (64, 8, 4, 1) float32, y (64,) int32; the weights are embed/kernel (8, 32)," in message


@pytest.mark.parametrize("name", STRATEGIES)
def test_float_labels_are_refused_as_not_integer_class_ids(name, mlp, layers, batch):
    strategy, step, state, _ = setup(name, mlp, layers)
    info = raised(step, state, {"x": batch["x"], "y": batch["y"].astype(np.float32)})
    message = str(info.value)
    assert message.startswith(f"{strategy!r}: ")
    assert "Labels must be integer class ids" in message and "y (64,) float32" in message
    assert "No weight takes" not in message  # the features fit: only the labels are wrong


def test_lowering_a_step_explains_the_batch_too(mlp, batch):
    strategy = pk.Mirrored(2)
    step, state = strategy.step(mlp[0]), strategy.init(mlp[1], optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"^Mirrored\(backend='jit', devices=2\): The loss reads batch\['x'\]"):
        step.lower(state, {"image": batch["x"], "y": batch["y"]})


def test_jax_tracer_errors_in_the_loss_pass_through_unchanged(mlp, batch):
    def branching_loss(params, batch):
        loss, aux = mlp[0](params, batch)
        if loss > 0:  # a Python `if` on a traced value: the loss's bug, not the batch's
            return loss, aux
        return -loss, aux

    strategy = pk.SingleDevice()
    with pytest.raises(jax.errors.TracerBoolConversionError):
        strategy.step(branching_loss)(strategy.init(mlp[1], optax.sgd(0.1)), batch)


def test_cross_entropy_refuses_float_and_one_hot_labels():
    logits = jnp.zeros((4, 3))
    for labels in (np.array([0.0, 1.0, 2.0, 1.0]), np.eye(3, dtype=np.float32)[[0, 1, 2, 1]]):
        with pytest.raises(TypeError, match=r"Labels must be integer class ids \(0 to 2, one per example\)"):
            pk.models.cross_entropy(logits, {"y": labels})
    loss, _ = pk.models.cross_entropy(logits, {"y": np.array([0, 1, 2, 1])})
    assert np.isclose(float(loss), np.log(3))


# -- devices left idle or shared --------------------------------------------------------------


def subset_warnings(make) -> list[str]:
    """The DeviceSubsetWarning messages that ``make()`` raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught if issubclass(w.category, pk.DeviceSubsetWarning)]


def test_hybrid_on_fewer_devices_than_exist_names_the_idle_ones():
    (message,) = subset_warnings(lambda: pk.Hybrid(3, 2))
    assert message.startswith("Hybrid(data=3, model=2) runs on 6 of the 8 devices, so cpu devices 6, 7 stay idle.")
    assert "devices=jax.devices()[:6]" in message and "Hybrid(data=4, model=2)" in message


def test_tensor_parallel_and_pipeline_on_fewer_devices_name_the_idle_ones(layers):
    (tensor,) = subset_warnings(lambda: pk.TensorParallel(2))
    assert "TensorParallel(model=2) runs on 2 of the 8 devices, so cpu devices 2, 3, 4, 5, 6, 7 stay idle" in tensor
    (pipe,) = subset_warnings(lambda: pk.Pipeline(layers.apply, 2))
    assert "Pipeline(stages=2, data=1) runs on 2 of the 8 devices, so cpu devices 2, 3, 4, 5, 6, 7" in pipe
    assert "data=4" in pipe


def test_more_parameter_server_shards_than_devices_names_the_shared_ones():
    (message,) = subset_warnings(lambda: pk.ParameterServer(num_shards=9))
    assert "ParameterServer(num_shards=9) places 9 shards on 8 devices" in message
    assert "shards share cpu device 0 (device 0 holds shards 0, 8)" in message and "at most 8 shards" in message
    with pytest.warns(pk.DeviceSubsetWarning, match="shards share cpu devices 0, 1, 2, 3, 4, 5, 6, 7"):
        pk.ParameterServer(num_shards=17)


@pytest.mark.parametrize(
    "make",
    [
        lambda: pk.Hybrid(3, 2, devices=jax.devices()[:6]),
        lambda: pk.TensorParallel(2, devices=jax.devices()[:2]),
        lambda: pk.ParameterServer(num_shards=9, devices=jax.devices()),
        lambda: pk.ParameterServer(3, devices=2),
        lambda: pk.Mirrored(2),  # a count is a choice
        lambda: pk.SingleDevice(),
        lambda: pk.Hybrid(4, 2),  # every device
        lambda: pk.TensorParallel(8),
        lambda: pk.ParameterServer(8),
        lambda: pk.FullySharded(),
        lambda: pk.CentralStorage(),
        lambda: pk.MultiWorkerMirrored(),
    ],
    ids=[
        "hybrid-chosen", "tensor-chosen", "ps-chosen", "ps-count", "mirrored-count", "single",
        "hybrid-all", "tensor-all", "ps-8", "fsdp-all", "central-all", "multiworker-all",
    ],
)  # fmt: skip
def test_chosen_devices_or_every_device_give_no_warning(make):
    assert subset_warnings(make) == []


def test_a_pipeline_over_every_device_gives_no_warning(layers):
    assert subset_warnings(lambda: pk.Pipeline(layers.apply, 2, data=4)) == []
