"""Experts split over a tensor axis too (Megatron's expert tensor parallelism): each expert's hidden units over
``model``, the routed tokens gathered before the experts and the outputs reduce-scattered after; equal to one
device, and refused with a clear error where the axes cannot split the experts so."""

from __future__ import annotations

import jax
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_experts import loss_and_grads, make_mesh, random_problem

import parallelkit as pk
from parallelkit.models.layers.experts import expert_parallel, moe_layer


@pytest.mark.parametrize("axes", [{"expert": 2, "model": 2}, {"data": 2, "expert": 2, "model": 2}], ids=str)
def test_experts_split_over_a_tensor_axis_equal_one_device(axes):
    mesh = make_mesh(axes)
    x, params = random_problem((4, 16, 8))
    kw = dict(top_k=2, capacity_factor=0.5, groups=mesh.size)
    expected = loss_and_grads(lambda x, p: moe_layer(x, p, **kw))(params, x)
    actual = loss_and_grads(lambda x, p: expert_parallel(x, p, mesh=mesh, hidden_axis="model", **kw))(params, x)
    tree_allclose(actual, expected)


def test_each_device_holds_a_slice_of_its_experts_and_the_tokens_meet_over_the_tensor_axis():
    mesh = make_mesh({"expert": 2, "model": 2})
    x, params = random_problem((64, 8), hidden=16)
    specs = {"router": P(), "w_in": P("expert", None, "model"), "w_out": P("expert", "model"),
             "b_in": P("expert", "model"), "b_out": P("expert")}  # fmt: skip
    placed = {name: jax.device_put(leaf, NamedSharding(mesh, specs[name])) for name, leaf in params.items()}
    step = loss_and_grads(lambda x, p: expert_parallel(x, p, mesh=mesh, hidden_axis="model", capacity_factor=1.0))
    compiled = step.lower(placed, x).compile()
    ops = [c.op for c in pk.inspect.parse_collectives(compiled.as_text())]
    assert ops.count("all-to-all") == 4 and "all-gather" in ops  # the tokens, over expert; gathered over model
    grads = compiled.output_shardings[0][0]
    assert grads["w_in"].shard_shape(params["w_in"].shape) == (4, 8, 8)  # 8 experts / 2, hidden 16 / 2


def test_under_parallel_the_experts_hidden_units_follow_the_dense_mlp():
    strategy = pk.Parallel(expert=2, tensor=2, devices=jax.devices()[:4])
    with strategy.tracing():
        _, rules = pk.axes.active()
    assert rules.mesh_axes("expert") == "expert" and rules.mesh_axes("mlp") == "model"


def test_a_hidden_axis_that_cannot_split_the_experts_is_refused():
    mesh = make_mesh({"expert": 2, "model": 2})
    x, params = random_problem((16, 8), hidden=5)
    with pytest.raises(ValueError, match="other than the experts'"):
        expert_parallel(x, params, mesh=mesh, hidden_axis="expert", groups=4)
    with pytest.raises(ValueError, match="5 hidden units do not split over the 2 devices of hidden_axis 'model'"):
        expert_parallel(x, params, mesh=mesh, hidden_axis="model", groups=4)
