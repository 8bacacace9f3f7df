"""TensorParallel: per-leaf placement, the all-reduces of a Megatron MLP, errors, checkpoints across layouts.

Equivalence with SingleDevice on 2, 4 and 8 devices runs in tests/test_equivalence.py
(one process per device count); here the suite's 8 simulated devices are shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_steps_compile_once, tree_allclose
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit.strategies.tensor import megatron_mlp_allreduces

COLUMNS, ROWS = P(None, "model"), P("model", None)

# TensorParallel(model=2 or 4) leaves some of the suite's 8 devices idle on purpose here.
pytestmark = pytest.mark.filterwarnings("ignore::parallelkit.DeviceSubsetWarning")


def deep_mlp(hidden=(64, 32, 16)):
    apply, params = pk.models.functional(pk.models.MLP(64, hidden, 10, rngs=nnx.Rngs(0)))
    return pk.models.classifier_loss(apply), params


def specs_by_path(state) -> dict[str, P]:
    return {
        pk.partition.path_label(path): leaf.sharding.spec for path, leaf in jax.tree_util.tree_leaves_with_path(state)
    }


EXPECTED_MLP_SPECS = {
    "hidden/0/kernel": COLUMNS,
    "hidden/0/bias": P("model"),
    "head/kernel": ROWS,
    "head/bias": P(),
}


@pytest.mark.parametrize("k", [2, 4])
def test_every_parameter_and_optimizer_leaf_is_placed_by_its_rule(k, mlp, batch):
    loss_fn, params = mlp
    strategy = pk.TensorParallel(model=k)
    assert strategy.num_replicas == 1 and dict(strategy.mesh.shape) == {"data": 1, "model": k}
    state = strategy.init(params, optax.adam(1e-3))
    for when in ("after init", "after a step"):
        specs = specs_by_path(state)
        assert specs["step"] == P() and specs["opt_state/0/count"] == P(), when
        for path, spec in EXPECTED_MLP_SPECS.items():
            assert specs[f"params/{path}"] == spec, (when, path)
            assert specs[f"opt_state/0/mu/{path}"] == spec and specs[f"opt_state/0/nu/{path}"] == spec, (when, path)
        assert all(len(leaf.sharding.device_set) == k for leaf in jax.tree.leaves(state))
        state, _ = strategy.step(loss_fn)(state, batch)


def test_split_leaves_hold_one_kth_of_their_bytes_on_each_device(mlp):
    loss_fn, params = mlp
    rows = {
        row.path: row
        for row in pk.TensorParallel(model=4).describe(pk.TensorParallel(model=4).init(params, optax.sgd(0.1)))
    }
    kernel = rows[".params['hidden'][0]['kernel']"]
    assert kernel.copies == 1 and kernel.bytes_per_device == params["hidden"][0]["kernel"].nbytes // 4
    bias = rows[".params['head']['bias']"]
    assert bias.copies == 4 and bias.bytes_per_device == params["head"]["bias"].nbytes


def test_init_never_gathers_the_state_on_one_device(mlp):
    """Each device receives only its own slices: the jitted constructor writes each shard in place."""
    _, params = mlp
    state = pk.TensorParallel(model=4).init(params, optax.adam(1e-3))
    kernel = state.opt_state[0].mu["hidden"][0]["kernel"]
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(64, 16)}


@pytest.mark.parametrize("hidden", [(64,), (64, 32), (64, 32, 16)], ids=["1 block", "1 block + head", "2 blocks"])
def test_all_reduces_of_one_step_match_the_megatron_formula(hidden, digits):
    loss_fn, params = deep_mlp(hidden)
    strategy = pk.TensorParallel(model=4)
    state = strategy.init(params, optax.sgd(0.1))
    batch = next(pk.data.batches(digits, 32, steps=1))
    found = pk.inspect.collectives(strategy.step(loss_fn), state, batch)
    assert {c.op for c in found} == {"all-reduce"} and all(c.group_size == 4 for c in found)
    expected = megatron_mlp_allreduces(32, [64, *hidden, 10])
    assert sorted(c.elements for c in found) == sorted(expected)
    assert sum(c.bytes for c in found) == 4 * sum(expected)


def test_second_step_does_not_recompile(mlp, digits):
    loss_fn, params = mlp
    assert_steps_compile_once(pk.TensorParallel(model=2), loss_fn, params, digits)


def test_a_model_of_its_own_takes_rules(digits):
    loss_fn, params = deep_mlp((32, 32))
    rules = [("hidden/0/kernel", COLUMNS), ("hidden/0/bias", P("model")), ("hidden/1/kernel", ROWS), (".*", P())]
    strategy = pk.TensorParallel(model=2, rules=rules)
    reference = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32, steps=5))
    split = pk.fit(strategy, loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32, steps=5))
    tree_allclose(split.params, reference.params)
    assert split.state.params["hidden"][1]["kernel"].sharding.spec == ROWS


def test_flax_partitioning_metadata_is_honoured(digits):
    class Annotated(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, (None, "model")), rngs=rngs)
            self.down = nnx.Linear(32, 10, kernel_init=nnx.with_partitioning(init, ("model", None)), rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x.reshape(x.shape[0], -1))))

    with nnx.use_eager_sharding(False):  # keep the annotations as metadata; the strategy places the values
        module = Annotated(nnx.Rngs(0))
    apply, params = pk.models.functional(module)
    specs = pk.partition.nnx_specs(module)
    assert specs["up"]["kernel"] == COLUMNS and specs["down"]["bias"] == P()
    loss_fn = pk.models.classifier_loss(apply)
    split = pk.fit(pk.TensorParallel(model=2, rules=specs), loss_fn, params, optax.sgd(0.1),
                   pk.data.batches(digits, 32, steps=4))  # fmt: skip
    reference = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32, steps=4))
    tree_allclose(split.params, reference.params)
    assert split.state.params["down"]["kernel"].sharding.spec == ROWS


def declared_and_megatron_specs(params, megatron_rules):
    """The specs TensorParallel(2) finds from the declared axes, and the specs of the Megatron regex rules."""
    return pk.TensorParallel(model=2).partition_specs(params), pk.partition.param_specs(params, megatron_rules)


@pytest.mark.parametrize("hidden", [(), (8,), (8, 6), (8, 6, 4), (8, 6, 4, 2)])
def test_the_mlps_declared_axes_give_megatrons_alternation(hidden):
    _, params = pk.models.functional(pk.models.MLP(12, hidden, 10, rngs=nnx.Rngs(0)))
    declared, megatron = declared_and_megatron_specs(params, pk.models.megatron_mlp_rules(len(hidden)))
    assert declared == megatron


@pytest.mark.parametrize("channels", [(4, 6), (4, 6, 2)])
@pytest.mark.parametrize("batch_norm", [False, True])
def test_the_cnns_declared_axes_split_its_first_two_convolutions(channels, batch_norm):
    params = pk.models.from_nnx(pk.models.CNN((8, 8, 1), 10, channels, batch_norm=batch_norm, rngs=nnx.Rngs(0))).params
    declared, megatron = declared_and_megatron_specs(params, pk.models.megatron_cnn_rules())
    assert declared == megatron


def test_the_transformers_declared_axes_split_heads_and_mlp(digits):
    _, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    declared, megatron = declared_and_megatron_specs(params, pk.models.megatron_transformer_rules())
    assert declared == megatron
    assert declared["blocks"][0]["key"]["kernel"] == COLUMNS and declared["blocks"][0]["mlp_out"]["kernel"] == ROWS


class Annotated(nnx.Module):
    """A model of one's own whose parameters declare logical axes (or mesh axes: ``names`` decides)."""

    def __init__(self, up, down, rngs):
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        named = dict(eager_sharding=False)  # keep the names as metadata; the strategy places the values
        self.up = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, up, **named),
                             bias_init=nnx.with_partitioning(zeros, up[1:], **named), rngs=rngs)  # fmt: skip
        self.down = nnx.Linear(32, 10, kernel_init=nnx.with_partitioning(init, down, **named), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x.reshape(x.shape[0], -1))))


@pytest.mark.parametrize(
    ("up", "down"),
    [(("pixels", "mlp"), ("mlp", "logits")), ((None, "model"), ("model", None))],
    ids=["logical", "mesh"],
)
def test_a_model_of_its_own_declaring_axes_needs_no_rules(up, down, digits):
    apply, params = pk.models.functional(Annotated(up, down, nnx.Rngs(0)))
    loss_fn = pk.models.classifier_loss(apply)
    split = pk.fit(pk.TensorParallel(model=2), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32, steps=4))
    reference = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), pk.data.batches(digits, 32, steps=4))
    tree_allclose(split.params, reference.params)
    specs = specs_by_path(split.state.params)
    assert specs == {"up/kernel": COLUMNS, "up/bias": P("model"), "down/kernel": ROWS, "down/bias": P()}


def test_axis_rules_choose_which_declared_names_split(digits):
    _, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    specs = pk.TensorParallel(model=2, rules=pk.AxisRules((("mlp", "model"),))).partition_specs(params)
    assert specs["blocks"][0]["mlp_in"]["kernel"] == COLUMNS and specs["blocks"][0]["mlp_out"]["kernel"] == ROWS
    assert specs["blocks"][0]["query"]["kernel"] == P() and specs["blocks"][0]["out"]["kernel"] == P()


@pytest.mark.timeout(120)
def test_checkpoint_restores_across_layouts(mlp, digits, tmp_path):
    """tensor 2 -> one device -> tensor 2, each continuing the run: the same parameters as one uninterrupted run."""
    loss_fn, params = mlp
    tx = optax.adam(1e-2)
    data = list(pk.data.batches(digits, 32, steps=9))
    whole = pk.fit(pk.SingleDevice(), loss_fn, params, tx, data)
    first = pk.fit(pk.TensorParallel(model=2), loss_fn, params, tx, data[:3])
    pk.checkpoint.save(tmp_path / "a", first.state, first.strategy)
    single = pk.checkpoint.restore(tmp_path / "a", pk.SingleDevice(), params, tx)
    assert single.params["hidden"][0]["kernel"].sharding.device_set == {jax.devices()[0]}
    second = pk.fit(pk.SingleDevice(), loss_fn, params, tx, data[3:6], state=single)
    pk.checkpoint.save(tmp_path / "b", second.state, second.strategy)
    split = pk.checkpoint.restore(tmp_path / "b", pk.TensorParallel(model=2), params, tx)
    assert split.params["hidden"][0]["kernel"].sharding.spec == COLUMNS
    third = pk.fit(pk.TensorParallel(model=2), loss_fn, params, tx, data[6:], state=split)
    tree_allclose(third.params, whole.params)


class TestErrors:
    def test_a_width_that_does_not_divide_names_the_leaf_and_the_numbers(self):
        loss_fn, params = deep_mlp((30,))
        with pytest.raises(ValueError, match=r"head/kernel has shape \(30, 10\): its dimension 0 \(30\) does not "
                                             r"split evenly over model = 4 devices"):  # fmt: skip
            pk.TensorParallel(model=4).init(params, optax.sgd(0.1))

    def test_unmatched_leaves_are_listed(self, mlp):
        _, params = mlp
        with pytest.raises(ValueError, match="No partition rule matches 2 parameter.*head/bias, head/kernel"):
            pk.TensorParallel(model=2, rules=[("hidden", P())]).init(params, optax.sgd(0.1))

    def test_a_rule_naming_an_axis_the_mesh_lacks(self, mlp):
        _, params = mlp
        with pytest.raises(ValueError, match="names mesh axis 'stage', but the mesh has only"):
            pk.TensorParallel(model=2, rules=[("kernel", P(None, "stage")), (".*", P())]).init(params, optax.sgd(0.1))

    def test_a_mesh_that_does_not_fit_the_devices(self):
        with pytest.raises(pk.DeviceCountError, match="A mesh of data=1 x model=4 needs 4 devices, but 2 were given"):
            pk.TensorParallel(model=4, devices=jax.devices()[:2])
        with pytest.raises(pk.DeviceCountError, match="Asked for 16 devices but JAX has 8"):
            pk.TensorParallel(model=16)
        with pytest.raises(ValueError, match="whole number of devices"):
            pk.TensorParallel(model=0)

    def test_other_models_need_rules(self):
        params = {"embed": jnp.zeros((16, 4)), "proj": {"kernel": jnp.zeros((4, 4))}}
        with pytest.raises(ValueError, match="default rules only for models whose parameters declare logical axes"):
            pk.TensorParallel(model=2).init(params, optax.sgd(0.1))

    def test_a_module_without_declared_axes_needs_rules(self):
        class Plain(nnx.Module):
            def __init__(self, rngs):
                self.up = nnx.Linear(64, 32, rngs=rngs)

        _, params = pk.models.functional(Plain(nnx.Rngs(0)))
        with pytest.raises(ValueError, match=r"give rules=\[\(regex, PartitionSpec\), ...\] for this model"):
            pk.TensorParallel(model=2).init(params, optax.sgd(0.1))


def test_mesh_factory_errors():
    with pytest.raises(ValueError, match="needs a whole number >= 1"):
        pk.mesh.make_mesh(model=0)
    with pytest.raises(pk.DeviceCountError, match="do not split into groups of 3"):
        pk.mesh.make_mesh(model=3)
    mesh = pk.mesh.make_mesh(model=2)
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert np.array_equal(np.vectorize(lambda d: d.id)(mesh.devices), np.arange(8).reshape(4, 2))


def test_transformer_heads_split_and_its_all_reduces(digits):
    """Per block: forward, one all-reduce after attention and one after the MLP (batch x tokens x dim each).
    Backward, the gradient of each block's input: one array for the MLP branch and three for attention,
    since XLA all-reduces the partial gradients from query, key and value separately instead of adding
    them first as Megatron's hand-written backward does (3x the bytes for that branch)."""
    apply, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    strategy = pk.TensorParallel(model=4)
    state = strategy.init(params, optax.sgd(0.1), rng=0)
    specs = specs_by_path(state)
    assert specs["params/blocks/0/query/kernel"] == COLUMNS and specs["params/blocks/0/out/kernel"] == ROWS
    assert specs["params/blocks/1/mlp_in/bias"] == P("model") and specs["params/embed/kernel"] == P()
    found = pk.inspect.collectives(
        strategy.step(pk.models.classifier_loss(apply)), state, next(pk.data.batches(digits, 32, steps=1))
    )
    activation = 32 * 8 * 32  # batch x tokens (pixel rows) x dim
    depth = len(params["blocks"])
    assert {c.op for c in found} == {"all-reduce"}
    arrays = [c.elements // len(c.shapes) for c in found for _ in c.shapes]
    assert arrays == [activation] * (depth * (2 + 1 + 3))


def test_memory_per_device_from_the_compiled_program(mlp, batch):
    """XLA's memory analysis of the step: splitting the weights over 4 devices shrinks what each holds."""
    loss_fn, params = mlp
    use = {}
    for name, strategy in (("mirrored", pk.Mirrored(4)), ("tensor", pk.TensorParallel(model=4))):
        use[name] = pk.inspect.memory_per_device(strategy.step(loss_fn), strategy.init(params, optax.adam(1e-3)), batch)
        assert use[name].total == use[name].argument + use[name].output + use[name].temp - use[name].alias
    state_bytes = 3 * pk.models.param_bytes(params)  # params, mu, nu
    # The outputs are the new state (and the metrics): Mirrored writes the whole state on each device,
    # TensorParallel about a quarter of it plus the small replicated leaves.
    assert use["mirrored"].output >= state_bytes
    assert use["tensor"].output < use["mirrored"].output / 3
