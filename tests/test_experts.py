"""Mixture of experts: routing and capacity by hand and against NumPy, and expert parallelism equal to one device."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit.models.layers.experts import capacity, expert_parallel, init_moe_params, moe_layer

EXPERT_WEIGHTS = ("w_in", "w_out", "b_in", "b_out")
layer = jax.jit(moe_layer, static_argnames=("top_k", "capacity_factor", "groups"))  # one compile, not one per op


def labelled_experts(dim: int) -> dict[str, jax.Array]:
    """``dim`` experts whose output is their own one-hot label (zero weights, ``b_out = eye``), router ``4 * eye``:
    a token's output is then its kept gates, placed at its experts."""
    params = init_moe_params(jax.random.key(0), dim, 3, dim)
    params = {name: jnp.zeros_like(leaf) for name, leaf in params.items()}
    return params | {"router": 4 * jnp.eye(dim), "b_out": jnp.eye(dim)}


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gelu_tanh(h: np.ndarray) -> np.ndarray:
    return 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))


def numpy_moe(x, params, top_k, capacity_factor, groups):
    """The documented semantics, one token-choice at a time, in float64."""
    p = {name: np.asarray(leaf, np.float64) for name, leaf in params.items()}
    tokens = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    count, experts = len(tokens), p["router"].shape[1]
    per_group = count // groups
    cap = math.ceil(capacity_factor * top_k * per_group / experts)
    logits = tokens @ p["router"]
    probs = softmax(logits)
    choice = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    top = np.take_along_axis(probs, choice, axis=1)
    gates = top / top.sum(axis=1, keepdims=True)
    y, kept = np.zeros_like(tokens), np.zeros((count, top_k), bool)
    for g in range(groups):
        load = np.zeros(experts, int)
        for rank in range(top_k):  # all first choices in token order, then all second choices, ...
            for t in range(g * per_group, (g + 1) * per_group):
                e = choice[t, rank]
                if load[e] < cap:
                    load[e] += 1
                    kept[t, rank] = True
                    h = gelu_tanh(tokens[t] @ p["w_in"][e] + p.get("b_in", np.zeros_like(p["w_in"][:, 0]))[e])
                    y[t] += gates[t, rank] * (h @ p["w_out"][e] + p.get("b_out", np.zeros_like(p["w_out"][:, 0]))[e])
    f = np.bincount(choice[:, 0], minlength=experts) / count
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    aux = {
        "load_balancing_loss": experts * np.sum(f * probs.mean(axis=0)),
        "router_z_loss": np.mean(lse**2),
        "dropped_fraction": 1 - kept.mean(),
        "tokens_per_expert": np.bincount(choice.ravel(), minlength=experts),
        "kept_per_expert": np.bincount(choice[kept], minlength=experts),
    }
    return y.reshape(x.shape), aux


def random_problem(shape=(64, 8), hidden=16, experts=8, bias=True, seed=0):
    """Random tokens and parameters (biases made non-zero so that they count)."""
    kx, kp, kb = jax.random.split(jax.random.key(seed), 3)
    params = init_moe_params(kp, shape[-1], hidden, experts, bias=bias)
    params = {
        n: leaf + 0.1 * jax.random.normal(kb, leaf.shape) if n.startswith("b_") else leaf for n, leaf in params.items()
    }
    return jax.random.normal(kx, shape), params


# -- one device: by hand ---------------------------------------------------------------------------------------


def test_each_token_goes_to_the_experts_its_router_picks_with_gates_summing_to_one():
    params = labelled_experts(4)
    x = jnp.array([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 1.0, 3.0]])  # token 0 -> experts 0, 1; token 1 -> 3, 2
    y, aux = layer(x, params, top_k=2, capacity_factor=2.0)
    probs = softmax(4 * np.asarray(x))
    expected = np.zeros((2, 4))
    for t, chosen in enumerate(([0, 1], [3, 2])):
        expected[t, chosen] = probs[t, chosen] / probs[t, chosen].sum()
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    np.testing.assert_allclose(y.sum(axis=1), [1.0, 1.0], rtol=1e-6)  # nothing dropped: the gates sum to 1
    np.testing.assert_array_equal(aux["tokens_per_expert"], [1, 1, 1, 1])
    assert float(aux["dropped_fraction"]) == 0.0


def test_capacity_one_drops_the_later_token():
    params = labelled_experts(2)
    x = jnp.array([[2.0, 0.0], [3.0, 0.0]])  # both tokens' only choice is expert 0, which holds ceil(1*1*2/2) = 1
    y, aux = layer(x, params, top_k=1, capacity_factor=1.0)
    np.testing.assert_allclose(y, [[1.0, 0.0], [0.0, 0.0]])  # token 0 came first; token 1 adds nothing
    assert float(aux["dropped_fraction"]) == 0.5
    np.testing.assert_array_equal(aux["kept_per_expert"], [1, 0])


def test_first_choices_fill_the_capacity_before_second_choices():
    params = labelled_experts(3)
    # token 0: expert 0, then 1; token 1: expert 1, then 0; capacity ceil(0.75 * 2 * 2 / 3) = 1.
    x = jnp.array([[2.0, 1.0, 0.0], [1.0, 2.0, 0.0]])
    y, aux = layer(x, params, top_k=2, capacity_factor=0.75)
    gate = 1 / (1 + math.exp(-4.0))  # each token's first choice against its second, logits 8 and 4
    # token 1's first choice takes expert 1 before token 0's second choice, though token 0 comes first
    np.testing.assert_allclose(y, [[gate, 0.0, 0.0], [0.0, gate, 0.0]], rtol=1e-6)
    assert float(aux["dropped_fraction"]) == 0.5
    np.testing.assert_array_equal(aux["tokens_per_expert"], [2, 2, 0])
    np.testing.assert_array_equal(aux["kept_per_expert"], [1, 1, 0])


def test_capacity_formula():
    assert capacity(8, experts=4, top_k=2, capacity_factor=1.25) == 5
    assert capacity(6, experts=4, top_k=2, capacity_factor=1.0) == 3
    assert capacity(5, experts=3, top_k=1, capacity_factor=1.2) == 2  # 6/5 * 5/3 = 2 exactly, not 2.0000000000000004


# -- one device: against NumPy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "top_k", "capacity_factor", "groups", "bias"),
    [
        ((64, 8), 2, 1.25, 1, True),
        ((64, 8), 2, 0.5, 4, True),
        ((4, 8, 8), 1, 1.0, 2, False),
        ((4, 8, 8), 3, 2.0, 8, True),
    ],
)
def test_matches_numpy(shape, top_k, capacity_factor, groups, bias):
    x, params = random_problem(shape, bias=bias)
    y, aux = layer(x, params, top_k=top_k, capacity_factor=capacity_factor, groups=groups)
    y_np, aux_np = numpy_moe(x, params, top_k, capacity_factor, groups)
    # float32 against float64: sums of up to 16 products of O(1) terms, float32 rounding ~1e-7 each
    np.testing.assert_allclose(y, y_np, rtol=1e-5, atol=1e-6)
    for name, value in aux_np.items():
        np.testing.assert_allclose(aux[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    if capacity_factor < 1:
        assert float(aux["dropped_fraction"]) > 0  # the setting really drops


def test_groups_route_separately():
    x, params = random_problem((32, 8))
    y, aux = layer(x, params, capacity_factor=0.75, groups=2)
    halves = [layer(half, params, capacity_factor=0.75) for half in (x[:16], x[16:])]
    tree_allclose(y, jnp.concatenate([halves[0][0], halves[1][0]]))
    for name in ("tokens_per_expert", "kept_per_expert"):
        tree_allclose(aux[name], halves[0][1][name] + halves[1][1][name])
    one_group = layer(x, params, capacity_factor=0.75)[1]["kept_per_expert"]
    assert not np.array_equal(aux["kept_per_expert"], one_group)  # each group has its own capacity


def test_load_balancing_loss_has_a_gradient_only_through_the_probabilities():
    x, params = random_problem((16, 8))
    grad = jax.jit(jax.grad(lambda p: moe_layer(x, p)[1]["load_balancing_loss"]))(params)
    assert float(jnp.abs(grad["router"]).sum()) > 0
    assert all(float(jnp.abs(grad[name]).sum()) == 0 for name in EXPERT_WEIGHTS)


# -- expert parallelism ----------------------------------------------------------------------------------------

MESHES = [{"expert": 2}, {"expert": 4}, {"expert": 8}, {"expert": 4, "data": 2}]


def make_mesh(axes: dict[str, int]):
    return pk.mesh.make_mesh(jax.devices()[: math.prod(axes.values())], **axes)


def loss_and_grads(layer):
    """The gradients (params, x) of a loss that uses y and both aux losses, with y and aux beside them."""

    def loss(params, x):
        y, aux = layer(x, params)
        return jnp.sum(jnp.sin(y)) + aux["load_balancing_loss"] + aux["router_z_loss"], (y, aux)

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.slow
@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
@pytest.mark.parametrize("capacity_factor", [0.5, 4.0])  # 4.0: capacity = the group size, nothing dropped
def test_expert_parallel_equals_one_device(axes, capacity_factor):
    mesh = make_mesh(axes)
    x, params = random_problem((4, 16, 8))
    kw = dict(top_k=2, capacity_factor=capacity_factor, groups=mesh.size)
    expected = loss_and_grads(lambda x, p: moe_layer(x, p, **kw))(params, x)
    actual = loss_and_grads(lambda x, p: expert_parallel(x, p, mesh=mesh, **kw))(params, x)
    tree_allclose(actual, expected)
    dropped = float(expected[1][1]["dropped_fraction"])
    assert dropped > 0 if capacity_factor < 1 else dropped == 0


def test_moe_layer_under_rules_that_split_experts_is_expert_parallel():
    mesh = make_mesh({"expert": 4})
    x, params = random_problem((32, 8))
    expected = moe_layer(x, params, capacity_factor=0.5, groups=4)
    with pk.axes.active_rules(mesh, pk.AxisRules((("expert", "expert"),))):
        layer = jax.jit(lambda x, p: moe_layer(x, p, capacity_factor=0.5, groups=4))
        actual = layer(x, params)
        ops = [c.op for c in pk.inspect.collectives(layer, x, params)]
    tree_allclose(actual, expected)
    assert ops.count("all-to-all") == 2


def test_rules_that_leave_experts_whole_run_on_one_device():
    mesh = make_mesh({"expert": 1, "data": 4})
    x, params = random_problem((32, 8))
    with pk.axes.active_rules(mesh, pk.AxisRules((("expert", "expert"),))):
        layer = jax.jit(lambda x, p: moe_layer(x, p))  # groups=1 is fine: the experts are not split
        ops = [c.op for c in pk.inspect.collectives(layer, x, params)]
    assert "all-to-all" not in ops


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"expert": 4}, {"expert": 4, "data": 2}], ids=["expert4", "expert4xdata2"])
def test_dispatch_is_an_all_to_all_and_expert_weights_stay_split(axes):
    mesh = make_mesh(axes)
    x, params = random_problem((64, 6))  # dim 6, experts 8: no other parameter has an expert weight's shape
    n, experts, dim = mesh.shape["expert"], params["router"].shape[1], x.shape[1]
    specs = {name: P() if name == "router" else P("expert") for name in params}
    placed = {name: jax.device_put(leaf, NamedSharding(mesh, specs[name])) for name, leaf in params.items()}
    step = loss_and_grads(lambda x, p: expert_parallel(x, p, mesh=mesh, capacity_factor=1.0))
    compiled = step.lower(placed, x).compile()
    found = pk.inspect.parse_collectives(compiled.as_text())
    cap = capacity(len(x) // mesh.size, experts, 2, 1.0)
    exchanges = [c for c in found if c.op == "all-to-all"]
    # forward: tokens to their experts and back; backward: the same two, transposed
    assert len(exchanges) == 4
    assert all(c.bytes == experts * cap * dim * 4 for c in exchanges)  # one device's dispatched slots, f32
    whole = {f"f32[{','.join(map(str, params[name].shape))}]" for name in EXPERT_WEIGHTS}
    assert not [c for c in found if whole & set(c.shapes)]  # no collective makes a whole expert weight
    params_in, grads_out = compiled.input_shardings[0][0], compiled.output_shardings[0]
    for name in EXPERT_WEIGHTS:
        for sharding in (params_in[name], grads_out[0][name]):
            assert sharding.shard_shape(params[name].shape)[0] == experts // n  # each device: its experts only


# -- bad input -------------------------------------------------------------------------------------------------


def test_bad_input_errors():
    x, params = random_problem((16, 8), experts=6)
    with pytest.raises(ValueError, match="6 experts do not split over the 4 devices"):
        expert_parallel(x, params, mesh=make_mesh({"expert": 4}), groups=4)
    with pytest.raises(ValueError, match="top_k=7 but there are 6 experts"):
        moe_layer(x, params, top_k=7)
    for factor in (0, -1.0):
        with pytest.raises(ValueError, match="capacity_factor must be > 0"):
            moe_layer(x, params, capacity_factor=factor)
    with pytest.raises(ValueError, match="16 tokens do not cut into groups=3"):
        moe_layer(x, params, groups=3)
    with pytest.raises(ValueError, match="missing \\['w_out'\\]"):
        moe_layer(x, {name: leaf for name, leaf in params.items() if name != "w_out"})
    with pytest.raises(ValueError, match=r"x of shape \(tokens, 8\)"):
        moe_layer(x[:, :4], params)


def test_groups_must_match_the_devices_the_tokens_are_split_over():
    x, params = random_problem((16, 8))
    mesh = make_mesh({"expert": 4, "data": 2})
    with pytest.raises(ValueError, match="groups must equal the 8 devices .* got groups=4"):
        expert_parallel(x, params, mesh=mesh, groups=4)
    with pk.axes.active_rules(mesh, pk.AxisRules((("expert", "expert"),))):
        with pytest.raises(ValueError, match="pass groups=8"):
            moe_layer(x, params)


# -- the ExpertParallel strategy ----------------------------------------------------------------------------------


def moe_regression(groups: int, steps: int = 10):
    """(loss_fn, params, batches): a residual MoE layer and a linear head, fit to random targets; tokens dropped."""
    x, moe = random_problem((steps * 16, 4, 8))
    params = {"moe": moe, "head": jax.random.normal(jax.random.key(7), (8, 1)) / math.sqrt(8)}
    targets = jnp.sin(x.sum(axis=-1))

    def loss_fn(params, batch):
        y, aux = moe_layer(batch["x"], params["moe"], capacity_factor=0.75, groups=groups)
        out = ((batch["x"] + y) @ params["head"])[..., 0]
        return jnp.mean((out - batch["y"]) ** 2) + 0.01 * aux["load_balancing_loss"], {
            "dropped": aux["dropped_fraction"]
        }

    batches = [{"x": x[i : i + 16], "y": targets[i : i + 16]} for i in range(0, len(x), 16)]
    return loss_fn, params, batches


STRATEGY_MESHES = [(2, None), (4, None), (8, None), (4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize(("expert", "data"), STRATEGY_MESHES, ids=lambda v: str(v))
def test_expert_parallel_strategy_trains_as_one_device(expert, data):
    import optax

    count = expert * (data or 1)
    strategy = pk.ExpertParallel(expert=expert, data=data, devices=jax.devices()[:count])
    loss_fn, params, batches = moe_regression(groups=count)
    reference = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches)
    split = pk.fit(strategy, loss_fn, params, optax.sgd(0.1), batches)
    tree_allclose(split.params, reference.params)
    assert float(loss_fn(params, batches[0])[1]["dropped"]) > 0  # the setting really drops tokens
    for name in EXPERT_WEIGHTS:
        leaf = split.state.params["moe"][name]
        assert leaf.sharding.spec == P("expert")
        assert leaf.sharding.shard_shape(leaf.shape)[0] == leaf.shape[0] // expert  # no device holds every expert
    assert split.state.params["head"].sharding.spec == P()
    step = strategy.step(loss_fn)
    ops = [c.op for c in pk.inspect.collectives(step, split.state, batches[0])]
    # forward: to the experts and back; backward: the outputs' cotangents to the experts (none flows back to the
    # tokens: the batch needs no gradient, and the dispatch mask has none)
    assert ops.count("all-to-all") == 3 and "all-gather" not in ops


def test_expert_parallel_strategy_refuses_experts_the_axis_does_not_split():
    import optax

    loss_fn, params, batches = moe_regression(groups=4, steps=1)
    params["moe"] = random_problem((16, 8), experts=6)[1]
    strategy = pk.ExpertParallel(expert=4, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"moe/\w+ has shape \(6, .* does not split evenly over expert = 4"):
        pk.fit(strategy, loss_fn, params, optax.sgd(0.1), batches)


def test_expert_parallel_strategy_repr_and_mesh():
    strategy = pk.ExpertParallel(expert=4)
    assert repr(strategy) == "ExpertParallel(expert=4, data=2)"
    assert strategy.num_replicas == 8  # the batch is split over every device


def test_expert_parallel_strategy_accumulates_as_one_device_does():
    """Accumulated microbatches beside an expert axis: each microbatch routed in the same groups as one device's
    accumulated run, the gradients summed as they are (the layer's shard_map splits the replicas' own axes, so they
    are not mapped), equal parameters."""
    loss_fn, params, batches = moe_regression(groups=4, steps=2)
    runs = []
    for strategy in (pk.SingleDevice(), pk.ExpertParallel(expert=4, devices=jax.devices()[:4])):
        state, step = strategy.init(params, optax.sgd(0.1)), strategy.step(loss_fn, accumulate=2)
        for batch in batches:
            state, _ = step(state, batch)
        runs.append(strategy.unreplicate(state.params))
    tree_allclose(runs[1], runs[0])


def test_expert_parallel_strategy_takes_a_precision_policy():
    """bfloat16 compute under ExpertParallel: the step runs and keeps the parameters float32 (the master copy).

    Not compared with SingleDevice: in bfloat16 the two programs may round a router logit differently
    and so pick another expert for a token, a jump no rounding bound covers."""
    import optax

    loss_fn, params, batches = moe_regression(groups=4, steps=2)
    strategy = pk.ExpertParallel(expert=4, devices=jax.devices()[:4])
    run = pk.fit(strategy, loss_fn, params, optax.sgd(0.1), batches, precision=pk.Precision.bf16())
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(run.state.params))
    assert np.isfinite(run.history.losses).all()


# -- the MoE GPT ----------------------------------------------------------------------------------------------------

LENGTH = 16


def moe_gpt(groups: int = 1, **overrides) -> pk.models.GPT:
    """A tiny MoE GPT: 8 experts in each of its 2 blocks, top-2, capacity factor 1 (tokens are dropped)."""
    from flax import nnx

    config = dict(max_length=LENGTH, dim=16, heads=2, depth=2, mlp_dim=32, experts=8, capacity_factor=1.0)
    return pk.models.GPT(256, **(config | overrides), groups=groups, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def corpus() -> pk.data.Dataset:
    return pk.data.text(length=LENGTH, max_bytes=20_000)


def test_moe_gpt_adds_the_weighted_load_balancing_loss_and_reports_routing(corpus):
    model = moe_gpt(groups=2)
    apply, params = pk.models.functional(model)
    batch = next(pk.data.batches(corpus, 8, steps=1))
    logits, aux = jax.jit(apply)(params, batch["x"])
    loss, metrics = pk.models.lm_loss(apply)(params, batch)
    plain, plain_metrics = pk.models.lm_loss(apply, load_balancing=0.0)(params, batch)
    ce = optax_ce(logits, batch["y"])
    np.testing.assert_allclose(plain, ce, rtol=1e-6)
    np.testing.assert_allclose(loss, ce + 0.01 * np.sum(aux["load_balancing_loss"]), rtol=1e-6)
    np.testing.assert_allclose(metrics["perplexity"], np.exp(ce), rtol=1e-6)
    # Each block routes every token to top_k=2 experts: the counts of a block sum to 2 x tokens
    np.testing.assert_array_equal(metrics["tokens_per_expert"].sum(axis=1), [2 * batch["x"].size] * 2)
    assert metrics["tokens_per_expert"].shape == metrics["kept_per_expert"].shape == (2, 8)
    assert (metrics["kept_per_expert"] <= metrics["tokens_per_expert"]).all()
    kept = metrics["kept_per_expert"].sum(axis=1) / (2 * batch["x"].size)
    np.testing.assert_allclose(1 - kept, aux["dropped_fraction"], rtol=1e-6)  # the kept share is what is not dropped
    assert float(metrics["dropped_fraction"]) == pytest.approx(float(np.mean(aux["dropped_fraction"])))
    assert float(metrics["load_balancing_loss"]) == pytest.approx(float(np.sum(aux["load_balancing_loss"])))
    assert float(metrics["router_z_loss"]) == pytest.approx(float(np.mean(aux["router_z_loss"])))
    assert 0 < float(metrics["dropped_fraction"]) < 1  # capacity factor 1: some tokens find their experts full
    assert sorted(plain_metrics) == sorted(metrics)


def optax_ce(logits, labels):
    import optax

    return float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())


def test_moe_gpt_declares_the_expert_axis_first_on_every_expert_weight():
    axes = pk.models.param_axes(moe_gpt())["blocks"][0]
    assert "mlp_in" not in axes and "mlp_out" not in axes  # the MoE layer replaces the block's MLP
    assert axes["moe"] == {
        "router": ("embed", None),
        "w_in": ("expert", "embed", "mlp"),
        "w_out": ("expert", "mlp", "embed"),
        "b_in": ("expert", "mlp"),
        "b_out": ("expert", "embed"),
    }


def test_expert_parallel_splits_what_declares_the_expert_axis_and_by_name_what_declares_none():
    params = pk.models.functional(moe_gpt(groups=4))[1]
    specs = pk.ExpertParallel(expert=4, devices=jax.devices()[:4]).partition_specs(params)
    moe = specs["blocks"][0]["moe"]
    assert moe["w_in"] == moe["w_out"] == P("expert", None, None) and moe["b_in"] == P("expert", None)
    assert moe["router"] == P() and specs["embed"]["embedding"] == P()  # every other name replicated
    plain = {"moe": random_problem((16, 8))[1], "head": jnp.zeros((8, 1))}  # a plain dict: no declared axes
    by_name = pk.ExpertParallel(expert=4, devices=jax.devices()[:4]).partition_specs(plain)
    assert by_name["moe"]["w_in"] == P("expert") and by_name["moe"]["router"] == P() and by_name["head"] == P()


@pytest.mark.slow
@pytest.mark.parametrize(("expert", "data"), STRATEGY_MESHES, ids=lambda v: str(v))
def test_moe_gpt_under_expert_parallel_trains_as_one_device(corpus, expert, data):
    """10 Adam steps with tokens dropped: SingleDevice's parameters with the same groups; the experts split over
    `expert`, and the step's dispatch an all-to-all.

    Adam's eps is 1e-3, 10^5 times optax's default. With 1e-8, g / (sqrt(v) + eps) gives a near-zero gradient a
    full-size update, so the last-bit differences of two summation orders grow past the tolerance: measured on 4
    devices, 12 of this model's 28,416 parameters ended outside it after 10 steps (up to 1.3e-5 apart). With eps
    1e-3, or with SGD, none did."""
    import optax

    count = expert * (data or 1)
    apply, params = pk.models.functional(moe_gpt(groups=count))
    loss_fn, batches = pk.models.lm_loss(apply), list(pk.data.batches(corpus, 8, steps=10))
    tx = optax.adam(1e-2, eps=1e-3)
    strategy = pk.ExpertParallel(expert=expert, data=data, devices=jax.devices()[:count])
    reference = pk.fit(pk.SingleDevice(), loss_fn, params, tx, batches)
    split = pk.fit(strategy, loss_fn, params, tx, batches)
    tree_allclose(split.params, reference.params)
    dropped = split.history.metric("dropped_fraction")
    assert (dropped > 0).all()  # the setting really drops tokens, at every step
    np.testing.assert_array_equal(dropped, reference.history.metric("dropped_fraction"))
    assert split.history.metric("tokens_per_expert").shape == (10, 2, 8)
    for block in split.state.params["blocks"].values():
        for name in EXPERT_WEIGHTS:
            leaf = block["moe"][name]
            assert leaf.sharding.spec[0] == "expert"
            assert leaf.sharding.shard_shape(leaf.shape)[0] == 8 // expert  # no device holds every expert
        assert block["moe"]["router"].sharding.spec == P()
    ops = [c.op for c in pk.inspect.collectives(strategy.step(loss_fn), split.state, batches[0])]
    # per block: to the experts and back, forward and backward (the block's input needs its gradient)
    assert ops.count("all-to-all") == 4 * 2 and "all-gather" not in ops


def test_moe_gpt_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="top_k=9 but there are 8 experts"):
        moe_gpt(top_k=9)
    for factor in (0, -0.5):
        with pytest.raises(ValueError, match="capacity_factor must be > 0"):
            moe_gpt(capacity_factor=factor)
    with pytest.raises(ValueError, match=r"GPT\(groups=0\)"):
        moe_gpt(groups=0)
    with pytest.raises(ValueError, match=r"GPT\(experts=2.5\)"):
        moe_gpt(experts=2.5)


def test_moe_gpt_experts_the_axis_does_not_split_and_groups_that_do_not_match(corpus):
    import optax

    batch = next(pk.data.batches(corpus, 8, steps=1))
    strategy = pk.ExpertParallel(expert=4, devices=jax.devices()[:4])
    apply, params = pk.models.functional(moe_gpt(groups=4, experts=6))
    with pytest.raises(ValueError, match=r"blocks/0/moe/b_in has shape \(6, .* does not split evenly over expert = 4"):
        strategy.init(params, optax.sgd(0.1))
    apply, params = pk.models.functional(moe_gpt(groups=2))
    state = strategy.init(params, optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"groups must equal the 4 devices .* pass groups=4"):
        strategy.step(pk.models.lm_loss(apply))(state, batch)


@pytest.mark.slow
@pytest.mark.parametrize(("expert", "data"), [(4, None), (4, 2)], ids=str)
def test_cost_model_all_to_all_bytes_are_the_compiled_steps(corpus, expert, data):
    """What the cost model has each device send (pairwise exchanges of pk.experts.dispatch_bytes per MoE block,
    four times) against (n-1)/n of the all-to-all payloads the compiled step holds; the traffic report's
    all-to-all flow, and TopologyModel timing it."""
    import optax

    from parallelkit.measure import costmodel
    from parallelkit.models.layers.experts import dispatch_bytes

    count, batch_size, depth = expert * (data or 1), 8, 2
    apply, params = pk.models.functional(moe_gpt(groups=count))
    loss_fn, batch = pk.models.lm_loss(apply), next(pk.data.batches(corpus, batch_size, steps=1))
    strategy = pk.ExpertParallel(expert=expert, data=data, devices=jax.devices()[:count])
    state = strategy.init(params, optax.sgd(0.1))
    found = [c for c in pk.inspect.collectives(strategy.step(loss_fn), state, batch) if c.op == "all-to-all"]
    assert {c.group_size for c in found} == {expert}
    measured = sum(c.bytes for c in found) * (expert - 1) / expert  # what one device sends of its payloads

    per_device = batch_size // count  # sequences in each device's group
    slots = dispatch_bytes(per_device * LENGTH, dim=16, experts=8, top_k=2, capacity_factor=1.0)
    work = costmodel.Workload(0, 1e-3, per_device, all_to_alls=(slots / per_device,) * (4 * depth))
    cluster = costmodel.Cluster(1, count, costmodel.PRESETS["nvlink3"])
    rounds = costmodel.expert_rounds(work, cluster, expert)
    predicted = sum(b for r in rounds for source, _, b in r if source == 0)
    assert predicted == pytest.approx(measured, rel=1e-12)

    traffic = strategy.traffic(loss_fn, state, batch)
    flow = traffic.flow("other collectives (all-to-all)")
    assert traffic.pattern == "expert" and flow.measured == 4 * depth * slots
    model = pk.traffic.TopologyModel(device_link_GBps=100, host_link_GBps=25)
    exchanges = 4 * depth * model.alltoall_seconds(slots, count)
    assert model.seconds(traffic) == pytest.approx(model.mirrored_seconds(traffic.param_bytes, count) + exchanges)
