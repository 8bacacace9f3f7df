"""FullySharded (ZeRO stages 1-3) and Hybrid (data x model): placement, memory, traffic, checkpoints, errors.

Equivalence with SingleDevice on 2, 4 and 8 devices is in test_equivalence.py.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_steps_compile_once, tree_allclose
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

import parallelkit as pk

ROWS = P("data", None)  # a square kernel is split along its first (largest, first among equals) axis


def wide_mlp():
    """An MLP whose large leaves all divide by 8: 64 -> 256 -> 256 -> 16."""
    model = pk.models.MLP(64, (256, 256), 16, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    return pk.models.classifier_loss(apply), params


def specs(tree) -> dict[str, P]:
    return {pk.partition.path_label(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_leaf_is_placed_as_its_stage_says(stage, mlp, digits):
    loss_fn, params = mlp
    strategy = pk.FullySharded(stage, 4)
    state = strategy.init(params, optax.adam(1e-3))
    sharded = {"hidden/0/kernel": ROWS}  # 4,096 elements; the head (640) and the biases are below min_size
    expected_params = {label: sharded.get(label, P()) if stage == 3 else P() for label in specs(state.params)}
    for when in ("after init", "after a step"):
        assert specs(state.params) == expected_params, when
        opt = specs(state.opt_state)
        for moment in ("mu", "nu"):  # Adam's moments are sharded in every stage
            assert opt[f"0/{moment}/hidden/0/kernel"] == ROWS and opt[f"0/{moment}/head/kernel"] == P()
        assert opt["0/count"] == P() and state.step.sharding.spec == P()
        state, _ = strategy.step(loss_fn)(state, next(pk.data.batches(digits, 32, steps=1)))
    assert_steps_compile_once(strategy, loss_fn, params, digits)


def test_the_sharding_rule_is_stated_and_followed():
    params = {"big": np.zeros((6, 64)), "square": np.zeros((64, 64)), "odd": np.zeros((30, 30)), "small": np.zeros(8)}
    got = pk.partition.fully_sharded_specs(params, "data", 4, min_size=100)
    # the largest dimension that divides (64 of 6 x 64); the first among equals; none divides 30; too small
    assert got == {"big": P(None, "data"), "square": P("data", None), "odd": P(), "small": P()}
    tensor = {"big": P(None, "model"), "square": P(), "odd": P(), "small": P()}
    with_model = pk.partition.fully_sharded_specs(params, "data", 2, min_size=100, base=tensor)
    assert with_model["big"] == P("data", "model")  # its model-split axis is taken: the other one
    assert with_model["square"] == P("data", None)


def test_zero3_holds_a_quarter_of_the_state_per_device_by_the_compilers_count(digits):
    """From the compiled step's memory analysis: arguments minus this device's batch slice = its state."""
    loss_fn, params = wide_mlp()
    batch = {"x": np.zeros((32, 64), np.float32), "y": np.zeros(32, np.int32)}
    per_device_batch = sum(x.nbytes for x in batch.values()) // 4
    total = {}
    for strategy in (pk.Mirrored(4), pk.FullySharded(3, 4)):
        state = strategy.init(params, optax.adam(1e-3))
        use = pk.inspect.memory_per_device(strategy.step(loss_fn), state, batch)
        total[repr(strategy)] = use.argument - per_device_batch
    whole = total["Mirrored(backend='jit', devices=4)"]  # parameters + Adam's mu and nu + count, whole
    assert whole == pytest.approx(3 * pk.models.param_bytes(params), abs=64)
    assert total["FullySharded(stage=3, devices=4)"] == pytest.approx(whole / 4, rel=0.10)


def _temp_bytes(model: nnx.Module, strategy: pk.Strategy, batch_size: int) -> int:
    """Temporary bytes per device of one SGD step, from the compiled program's memory analysis."""
    apply, params = pk.models.functional(model)
    batch = {"x": np.zeros((batch_size, 64), np.float32), "y": np.zeros(batch_size, np.int32)}
    step = strategy.step(pk.models.classifier_loss(apply))
    return pk.inspect.memory_per_device(step, strategy.init(params, optax.sgd(0.1)), batch).temp


def test_zero3_saves_no_temporaries_unless_the_layers_are_scanned_and_rematerialised():
    """The classic pitfall, on the compiler's count: what one more layer adds to the temporaries.

    Layers written as separate leaves in an unrolled loop (MLP): ZeRO-3's temporaries grow per
    layer as fast as mirrored's, though its program gathers every kernel. The same layers
    stacked, scanned and rematerialised (Tower with remat) add well under a kernel per layer.
    Batch 256 on 4 devices: large enough that XLA gathers the weights rather than moving
    activations (at a tiny batch it may keep the weights in place).
    """
    width, batch, layer = 256, 256, 256 * 256 * 4
    mirrored, zero3 = pk.Mirrored(4), pk.FullySharded(3, 4)

    def growth(make, strategy):  # temp bytes that 4 more layers add, per layer
        return (_temp_bytes(make(8), strategy, batch) - _temp_bytes(make(4), strategy, batch)) / 4

    def unrolled(depth):
        return pk.models.MLP(64, (width,) * (depth + 1), 10, rngs=nnx.Rngs(0))

    def scanned(depth):
        return pk.models.Tower(64, width, depth, 10, remat=True, rngs=nnx.Rngs(0))

    apply, params = pk.models.functional(unrolled(4))
    data = {"x": np.zeros((batch, 64), np.float32), "y": np.zeros(batch, np.int32)}
    found = pk.inspect.collectives(
        zero3.step(pk.models.classifier_loss(apply)), zero3.init(params, optax.sgd(0.1)), data
    )
    sharded = sum(x.nbytes for x in jax.tree.leaves(params) if x.size >= pk.partition.MIN_SHARD_SIZE)
    assert pk.inspect.summarize(found)["all-gather"]["bytes"] >= sharded  # every kernel gathered whole
    assert growth(unrolled, zero3) >= max(layer, 0.95 * growth(unrolled, mirrored))
    assert growth(scanned, zero3) <= min(0.6 * layer, 0.5 * growth(scanned, mirrored))


def test_a_tower_computes_the_same_with_and_without_remat():
    x = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    apply, params = pk.models.functional(pk.models.Tower(64, 32, 3, 10, rngs=nnx.Rngs(0)))
    apply_remat, params_remat = pk.models.functional(pk.models.Tower(64, 32, 3, 10, remat=True, rngs=nnx.Rngs(0)))
    assert params["kernels"].shape == (3, 32, 32) and params["biases"].shape == (3, 32)
    tree_allclose(params_remat, params, rtol=0, atol=0)
    loss = pk.models.classifier_loss(apply)
    loss_remat = pk.models.classifier_loss(apply_remat)
    batch = {"x": x, "y": np.arange(8) % 10}
    tree_allclose(jax.grad(lambda p: loss_remat(p, batch)[0])(params), jax.grad(lambda p: loss(p, batch)[0])(params))


def test_zero_memory_formulas():
    from parallelkit.strategies.fully_sharded import zero_state_bytes

    # float32 parameters P, gradients P, Adam's moments 2P; 4 devices
    p, opt = 1000, 2000
    assert zero_state_bytes(0, p, opt, 4) == {"parameters": 1000, "gradients": 1000, "optimizer": 2000}
    assert zero_state_bytes(1, p, opt, 4) == {"parameters": 1000, "gradients": 1000, "optimizer": 500}
    assert zero_state_bytes(2, p, opt, 4) == {"parameters": 1000, "gradients": 250, "optimizer": 500}
    assert zero_state_bytes(3, p, opt, 4) == {"parameters": 250, "gradients": 250, "optimizer": 500}
    # per parameter, float32 Adam is 4 + 4 + 8 and the paper's mixed precision 2 + 2 + 12: 16 bytes both,
    # but stage 1 on 8 devices leaves 4 + 4 + 1 against 2 + 2 + 1.5
    assert sum(zero_state_bytes(0, 4, 8, 8).values()) == sum(zero_state_bytes(0, 2, 12, 8).values()) == 16
    assert sum(zero_state_bytes(1, 4, 8, 8).values()) == 9 and sum(zero_state_bytes(1, 2, 12, 8).values()) == 5.5


def test_float32_adam_holds_4_4_and_8_bytes_a_parameter_as_the_formula_counts(mlp, batch):
    """Weights and Adam's moments from the placed state; the gradient from a compiled gradient's output.

    A training step's gradients sit in its temporaries beside the activations, which XLA's
    memory analysis does not split, so the gradient is read from ``jax.grad`` compiled alone.
    """
    from parallelkit.strategies.fully_sharded import zero_state_bytes

    loss_fn, params = mlp
    count = sum(x.size for x in jax.tree.leaves(params))
    strategy = pk.Mirrored(4)
    rows = strategy.describe(strategy.init(params, optax.adam(1e-3)))
    held = pk.strategies.bytes_by_part(rows)
    moments = sum(r.bytes_per_device for r in rows if r.path.startswith((".opt_state[0].mu", ".opt_state[0].nu")))
    counter = sum(r.bytes_per_device for r in rows if r.path == ".opt_state[0].count")
    assert held["opt_state"] == moments + counter and counter == 4  # Adam's state: mu, nu and a step count
    # one flat vector, so the compiled output is the gradient alone (a tuple of leaves adds its pointer table)
    grad = jax.jit(lambda p, b: ravel_pytree(jax.grad(lambda q: loss_fn(q, b)[0])(p))[0])
    gradient = pk.inspect.memory_per_device(grad, params, batch).output
    per_parameter = {"parameters": held["params"] / count, "gradients": gradient / count, "optimizer": moments / count}
    assert per_parameter == zero_state_bytes(0, 4, 8, 4) == {"parameters": 4, "gradients": 4, "optimizer": 8}


def test_traffic_read_from_the_compiled_program(mlp, digits):
    loss_fn, params = mlp
    batch = next(pk.data.batches(digits, 32, steps=1))
    sharded = 64 * 64 * 4  # S: the one leaf above min_size
    one = pk.FullySharded(1, 4)
    t = one.traffic(loss_fn, one.init(params, optax.adam(1e-3)), batch)
    assert t.flow("gradients and metrics (all-reduce)").measured == pk.models.param_bytes(params) + 8
    assert t.flow("parameter shards (all-gather)").measured == sharded  # each device updated its shard only
    t = one.traffic(loss_fn, one.init(params, optax.sgd(0.1)), batch)  # no optimizer state to shard:
    assert t.between_devices == t.total("device<->device", expected=True) == pk.models.param_bytes(params) + 8
    three = pk.FullySharded(3, 4)
    t = three.traffic(loss_fn, three.init(params, optax.sgd(0.1)), batch)
    assert t.flow("parameter shards (all-gather)").measured >= sharded  # gathered before use
    # XLA's CPU backend writes the reduce-scatter as an all-reduce whose shard each device keeps:
    # the measured payload says so, against the formula's reduce-scatter of S/n.
    scatter, reduce = t.flow("gradient shards (reduce-scatter)"), t.flow("small gradients")
    assert scatter.expected == sharded / 4
    assert scatter.measured + reduce.measured >= sharded / 4 + reduce.expected


def test_checkpoint_saved_fully_sharded_on_4_restores_onto_2_and_1(mlp, digits, tmp_path):
    loss_fn, params = mlp
    tx = optax.adam(1e-2)
    data = list(pk.data.batches(digits, 32, steps=6))
    whole = pk.fit(pk.SingleDevice(), loss_fn, params, tx, data)
    first = pk.fit(pk.FullySharded(3, 4), loss_fn, params, tx, data[:3])
    pk.checkpoint.save(tmp_path, first.state, first.strategy)
    for strategy in (pk.FullySharded(3, 2), pk.SingleDevice()):
        restored = pk.checkpoint.restore(tmp_path, strategy, params, tx)
        assert len(restored.params["hidden"][0]["kernel"].sharding.device_set) == len(strategy.devices)
        tree_allclose(strategy.unreplicate(restored.params), first.params, rtol=0, atol=0)
        rest = pk.fit(strategy, loss_fn, params, tx, data[3:], state=restored)
        tree_allclose(rest.params, whole.params)


def test_hybrid_splits_weights_over_model_and_the_batch_over_data(mlp, digits):
    loss_fn, params = mlp
    strategy = pk.Hybrid(data=2, model=4)
    assert (strategy.num_replicas, dict(strategy.mesh.shape)) == (2, {"data": 2, "model": 4})
    state = strategy.init(params, optax.adam(1e-3))
    assert specs(state.params)["hidden/0/kernel"] == P(None, "model")
    assert strategy.place_batch(next(pk.data.batches(digits, 32, steps=1)))["x"].sharding.spec == P("data")
    fsdp = pk.Hybrid(data=2, model=4, shard_data=True)
    state = fsdp.init(params, optax.adam(1e-3))
    assert specs(state.params)["hidden/0/kernel"] == P("data", "model")  # FSDP on data within each slice
    assert specs(state.opt_state)["0/mu/hidden/0/kernel"] == P("data", "model")
    found = pk.inspect.summarize(pk.inspect.collectives(fsdp.step(loss_fn), state, next(pk.data.batches(digits, 32))))
    assert {"all-reduce", "all-gather"} <= set(found)


class TestErrors:
    @pytest.mark.parametrize("stage", [0, 4, True, "3"])
    def test_stage_not_in_1_to_3(self, stage):
        with pytest.raises(ValueError, match="choose one of 1, 2, 3"):
            pk.FullySharded(stage)

    def test_min_size(self):
        with pytest.raises(ValueError, match="min_size=0"):
            pk.FullySharded(3, min_size=0)

    def test_a_mesh_that_does_not_fit_the_devices(self):
        with pytest.raises(pk.DeviceCountError, match="A mesh of data=2 x model=4 needs 8 devices, but 4 were given"):
            pk.Hybrid(2, 4, devices=jax.devices()[:4])
        with pytest.raises(pk.DeviceCountError, match="Asked for 16 devices"):
            pk.Hybrid(4, 4)

    @pytest.mark.parametrize("sizes", [(0, 2), (2, 0), (2.0, 2)])
    def test_an_axis_of_size_0(self, sizes):
        with pytest.raises(ValueError, match="an axis size must be a whole number >= 1"):
            pk.Hybrid(*sizes)
