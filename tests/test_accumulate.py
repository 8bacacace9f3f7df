"""Gradient accumulation, ``strategy.step(loss_fn, accumulate=K)``: one step on the whole batch, one sync a step.

On the suite's 8 simulated devices. Tolerance: float32, rtol 1e-5, atol 1e-6; bfloat16 runs are held
to SingleDevice under the same policy within the bound derived in ``test_precision.assert_within_bf16``.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose
from test_precision import assert_float32_state, assert_scale_cycle, assert_within_bf16, dense_layers
from test_precision import train as train_with_precision

import parallelkit as pk

K, STEPS, BATCH = 4, 10, 64

# TensorParallel(model=2) and Hybrid(2, 2) leave some of the suite's 8 devices idle on purpose here.
pytestmark = pytest.mark.filterwarnings("ignore::parallelkit.DeviceSubsetWarning")

STRATEGIES = {
    "single": lambda: pk.SingleDevice(),
    "mirrored-jit": lambda: pk.Mirrored(backend="jit"),
    "mirrored-pmap": lambda: pk.Mirrored(backend="pmap"),
    "mirrored-jit-ring": lambda: pk.Mirrored(backend="jit", allreduce="ring"),
    "tensor": lambda: pk.TensorParallel(model=2),
    "fully-sharded-3": lambda: pk.FullySharded(3, min_size=1),
    "fully-sharded-2": lambda: pk.FullySharded(2, min_size=1),
    "hybrid": lambda: pk.Hybrid(2, 2, shard_data=True, min_size=1),
    "central-storage": lambda: pk.CentralStorage(),
    "parameter-server": lambda: pk.ParameterServer(3),
}

# The strategies whose workers push their gradients to the state's owners (sync mode).
OFF_DEVICE = {name: STRATEGIES[name] for name in ("central-storage", "parameter-server")}


def train(strategy, loss_fn, params, batches, accumulate=1):
    """Parameters and every step's metrics after training ``strategy`` on ``batches``."""
    state = strategy.init(params, optax.sgd(0.1, momentum=0.9))
    step = strategy.step(loss_fn, accumulate=accumulate)
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return strategy.unreplicate(state.params), history


@pytest.fixture(scope="module")
def batches(digits):
    return list(pk.data.batches(digits, BATCH, steps=STEPS))


@pytest.fixture(scope="module")
def reference(mlp, batches):
    """One device, one pass over each whole batch."""
    loss_fn, params = mlp
    return train(pk.SingleDevice(), loss_fn, params, batches)


@pytest.mark.parametrize("name", STRATEGIES)
def test_accumulated_microbatches_equal_one_step_on_the_whole_batch(name, mlp, batches, reference):
    loss_fn, params = mlp
    trained, history = train(STRATEGIES[name](), loss_fn, params, batches, accumulate=K)
    expected, expected_history = reference
    tree_allclose(trained, expected)
    # the metrics are the whole batch's: the mean over equal microbatches of their means
    for got, want in zip(history, expected_history, strict=True):
        tree_allclose(got, want)
    assert not np.allclose(jax.tree.leaves(expected)[0], jax.tree.leaves(params)[0]), "training moved nothing"


def entry_collectives(hlo: str) -> tuple[list[pk.inspect.Collective], list[pk.inspect.Collective]]:
    """(the collectives of the ENTRY computation, which run once a call; those of every other computation)."""
    blocks = re.split(r"\n(?=\S)", hlo)
    entry = [b for b in blocks if b.startswith("ENTRY")]
    rest = [b for b in blocks if not b.startswith("ENTRY")]
    return pk.inspect.parse_collectives("\n".join(entry)), pk.inspect.parse_collectives("\n".join(rest))


def gradient_bytes(params) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))


def test_mirrored_jit_all_reduces_the_gradients_once_a_step_however_many_microbatches(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state = strategy.init(params, optax.sgd(0.1))
    once, in_loops = entry_collectives(pk.inspect.compiled_text(strategy.step(loss_fn, accumulate=K), state, batch))
    assert in_loops == [], "a collective inside the microbatch loop runs once per microbatch"
    reduced = sum(c.bytes for c in once if c.op == "all-reduce")
    # P + M: the gradients, and the loss and accuracy (4 bytes each)
    assert reduced == gradient_bytes(params) + 8, once
    assert {c.op for c in once} == {"all-reduce"}


def test_multisteps_all_reduces_the_gradients_on_every_call(mlp, batch):
    """``optax.MultiSteps`` accumulates in the optimizer: each of its K calls is a step that all-reduces P."""
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state = strategy.init(params, optax.MultiSteps(optax.sgd(0.1), every_k_schedule=K))
    step = strategy.step(loss_fn)
    once, in_loops = entry_collectives(pk.inspect.compiled_text(step, state, batch))
    assert in_loops == []
    assert sum(c.bytes for c in once if c.op == "all-reduce") == gradient_bytes(params) + 8
    before = jax.device_get(state.params)
    for call in range(K):  # K calls, K all-reduces of P, one update
        micro = jax.tree.map(lambda x, call=call: x[call * BATCH // K : (call + 1) * BATCH // K], batch)
        state, _ = step(state, micro)
        moved = not np.allclose(jax.device_get(state.params)["head"]["bias"], before["head"]["bias"])
        assert moved == (call == K - 1), call


def test_pmap_syncs_once_after_its_loop(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="pmap")
    state = strategy.init(params, optax.sgd(0.1))
    once, in_loops = entry_collectives(pk.inspect.compiled_text(strategy.step(loss_fn, accumulate=K), state, batch))
    assert in_loops == []
    assert sum(c.bytes for c in once if c.op == "all-reduce") == gradient_bytes(params) + 8


def test_accumulation_with_model_state_and_dropout_trains(digits, batch):
    """BatchNorm's new statistics are averaged as the metrics are; each microbatch draws its own dropout key,
    and the transformer's activation constraints hold inside the mapped replicas."""
    cnn = pk.models.from_nnx(pk.models.CNN(digits.input_shape, digits.num_classes, batch_norm=True, rngs=nnx.Rngs(0)))
    apply, params = pk.models.functional(
        pk.models.Transformer(digits.input_shape, digits.num_classes, dropout=0.1, rngs=nnx.Rngs(0))
    )
    runs = [(s, cnn.apply, cnn.params, {"model_state": cnn.model_state}) for s in ("jit", "pmap")]
    runs += [(s, apply, params, {"rng": 0}) for s in ("jit", "hybrid")]
    for name, model, weights, extras in runs:
        strategy = pk.Hybrid(2, 2) if name == "hybrid" else pk.Mirrored(backend=name)
        state = strategy.init(weights, optax.sgd(0.1), **extras)
        before = strategy.unreplicate(state.model_state)
        state, metrics = strategy.step(pk.models.classifier_loss(model), accumulate=2)(state, batch)
        assert np.isfinite(float(metrics["loss"])), name
        if before is not None:
            assert not np.allclose(
                jax.tree.leaves(strategy.unreplicate(state.model_state))[0], jax.tree.leaves(before)[0]
            )


def test_a_batch_that_does_not_split_into_microbatches_on_every_replica_names_the_three_numbers(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state = strategy.init(params, optax.sgd(0.1))
    short = jax.tree.map(lambda x: x[:48], batch)
    with pytest.raises(ValueError, match=r"48 examples .* 4 microbatches .* 8 replicas.* 4 x 8 = 32"):
        strategy.step(loss_fn, accumulate=K)(state, short)


@pytest.mark.parametrize("accumulate", [0, -1, 2.0, True, "4"])
def test_accumulate_must_be_a_whole_number_of_microbatches(mlp, accumulate):
    loss_fn, _ = mlp
    for strategy in (pk.SingleDevice(), pk.Mirrored(backend="pmap"), pk.CentralStorage(2)):
        with pytest.raises(ValueError, match=r"accumulate=.*whole number >= 1"):
            strategy.step(loss_fn, accumulate=accumulate)


def test_strategies_that_cannot_accumulate_yet_say_which_can_and_why(mlp, digits):
    loss_fn, _ = mlp
    strategy = pk.ParameterServer(2, mode="async")
    strategy.step(loss_fn, accumulate=1)  # one pass over the batch: as before
    with pytest.raises(
        NotImplementedError, match=r"yet; SingleDevice, .*ParameterServer \(mode='sync'\).*no step-wide"
    ):
        strategy.step(loss_fn, accumulate=2)
    layers, _ = pk.models.as_layers(pk.models.MLP(64, (64,), digits.num_classes, rngs=nnx.Rngs(0)))
    pipe = pk.Pipeline(layers, 2, microbatches=2)
    head_loss = pk.models.cross_entropy
    pipe.step(head_loss, accumulate=1)
    with pytest.raises(NotImplementedError, match=r"use Pipeline\(\.\.\., microbatches=\.\.\.\)"):
        pipe.step(head_loss, accumulate=2)


def test_sharded_strategies_reduce_the_gradients_over_data_once_a_step(mlp, batch):
    """ZeRO-3 and Hybrid: no collective over ``data`` runs per microbatch except ZeRO-3's activation moves;
    the gradients' all-reduce (a reduce-scatter on accelerators) runs once, the same as without accumulation."""
    loss_fn, params = mlp
    for strategy in (pk.FullySharded(3, min_size=1), pk.Hybrid(4, 2, shard_data=True, min_size=1)):
        state = strategy.init(params, optax.sgd(0.1))
        once, in_loops = entry_collectives(pk.inspect.compiled_text(strategy.step(loss_fn, accumulate=K), state, batch))
        plain, _ = entry_collectives(pk.inspect.compiled_text(strategy.step(loss_fn), state, batch))
        data = strategy.mesh.shape["data"]
        over_data = sorted(c.bytes for c in once if c.op == "all-reduce" and c.group_size == data)
        assert over_data == sorted(c.bytes for c in plain if c.op == "all-reduce" and c.group_size == data), strategy
        assert not [c for c in in_loops if c.op == "all-reduce" and c.group_size == data], strategy


@pytest.mark.parametrize("name", ["mirrored-jit", "mirrored-pmap", "fully-sharded-3"])
def test_an_accumulating_step_compiles_once(name, mlp, batches):
    loss_fn, params = mlp
    strategy = STRATEGIES[name]()
    step, state = strategy.step(loss_fn, accumulate=K), strategy.init(params, optax.sgd(0.1))
    state, _ = step(state, batches[0])
    with pk.inspect.count_compilations() as compiles:
        for batch in batches[1:3]:
            state, _ = step(state, batch)
        jax.block_until_ready(state)
    assert compiles == []


@pytest.fixture(scope="module")
def bf16_reference(mlp, batches):
    """SingleDevice under the bfloat16 policy, one pass over each whole batch: the parameters after each step."""
    loss_fn, params = mlp
    return train_with_precision(pk.SingleDevice(), loss_fn, params, batches, pk.Precision.bf16())[0]


@pytest.mark.parametrize("name", OFF_DEVICE)
def test_off_device_bf16_with_accumulation_equals_single_device_under_the_same_policy(
    name, mlp, batches, bf16_reference
):
    """The bound and its reason: ``assert_within_bf16`` in test_precision.py."""
    loss_fn, params = mlp
    strategy = OFF_DEVICE[name]()
    trace, state, _ = train_with_precision(strategy, loss_fn, params, batches, pk.Precision.bf16(), accumulate=K)
    assert_within_bf16(trace, bf16_reference, dense_layers(params))
    assert_float32_state(strategy, state)


@pytest.mark.parametrize("name", OFF_DEVICE)
def test_off_device_dynamic_loss_scale_with_accumulation(name, mlp, batches):
    loss_fn, params = mlp
    assert_scale_cycle(OFF_DEVICE[name](), loss_fn, params, batches, accumulate=K)


@pytest.mark.parametrize("name", OFF_DEVICE)
def test_off_device_batch_that_does_not_split_into_microbatches_names_the_three_numbers(name, mlp, batch):
    loss_fn, params = mlp
    strategy = OFF_DEVICE[name]()
    state = strategy.init(params, optax.sgd(0.1))
    short = jax.tree.map(lambda x: x[:48], batch)
    with pytest.raises(ValueError, match=r"48 examples .* 4 microbatches .* 8 replicas.* 4 x 8 = 32"):
        strategy.step(loss_fn, accumulate=K)(state, short)


@pytest.mark.parametrize("name", OFF_DEVICE)
def test_off_device_workers_pull_and_push_the_same_bytes_however_many_microbatches(name, mlp, batch):
    """Measured on the arrays the workers' programs really return and the programs' HLO (the traffic report)."""
    loss_fn, params = mlp
    strategy = OFF_DEVICE[name]()
    state = strategy.init(params, optax.sgd(0.1))
    plain, accumulated = (strategy.traffic(loss_fn, state, batch, accumulate=k) for k in (1, K))
    assert accumulated.flows == plain.flows
    assert accumulated.owner_flows == plain.owner_flows and accumulated.owner_bytes == plain.owner_bytes
    pushed = {f.what: f.measured for f in accumulated.flows}[strategy.push_label]
    assert pushed == gradient_bytes(params), "each worker pushes one gradient row a step, not K"
    assert {f.what: f.measured for f in accumulated.flows}["collectives"] == 0
    # the workers' program does run K microbatches: one loop of K trips
    loops = {
        k: re.findall(
            r'known_trip_count":\{"n":"(\d+)"',
            pk.inspect.compiled_text(strategy.step(loss_fn, accumulate=k), state, batch),
        )
        for k in (1, K)
    }
    assert loops == {1: [], K: [str(K)]}
