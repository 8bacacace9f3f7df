"""FLOPs from the compiler against counts worked out by hand."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import parallelkit as pk
from parallelkit.measure import flops


def _widths(params) -> tuple[int, ...]:
    """(input, hidden..., output) of the MLP, read from its kernels in layer order."""
    kernels = [params["hidden"][i]["kernel"] for i in sorted(params["hidden"])] + [params["head"]["kernel"]]
    return (kernels[0].shape[0], *(k.shape[1] for k in kernels))


def _step_cost(strategy, mlp, digits, batch_size: int) -> flops.StepCost:
    loss_fn, params = mlp
    batch = next(pk.data.batches(digits, batch_size, steps=1))
    return pk.inspect.flops(strategy.step(loss_fn), strategy.init(params, optax.sgd(0.1)), batch)


def test_inspect_reads_the_flops_of_this_module():
    assert pk.inspect.flops is flops.flops and pk.inspect.StepCost is flops.StepCost


def test_mlp_step_equals_hand_count_of_matmuls_within_ten_percent(mlp, digits):
    _, params = mlp
    cost = _step_cost(pk.SingleDevice(), mlp, digits, 64)
    hand = flops.mlp_matmul_flops(64, _widths(params))
    assert hand == 2 * 64 * (64 * 64 + 64 * 10) * 2 + 2 * 64 * 64 * 10  # forward, weight grads, one input grad
    # The compiler also counts what is not a matmul: bias adds, ReLU, softmax and the loss, the SGD
    # update of every parameter. On this small MLP that is a few percent; 10% bounds it, and the
    # compiler can never count less than the matmuls.
    assert hand <= cost.flops <= 1.10 * hand, (cost.flops, hand)
    assert cost.devices == 1 and cost.total_flops == cost.flops
    assert cost.bytes_accessed > 0 and cost.transcendentals is not None and cost.transcendentals > 0


def test_flops_grow_linearly_with_batch(mlp, digits):
    _, params = mlp
    costs = {b: _step_cost(pk.SingleDevice(), mlp, digits, b).flops for b in (32, 64, 128)}
    # Per-example work (matmuls, activations, loss) scales with the batch; the update does not:
    # an affine function of the batch, so equal steps in batch add equal FLOPs.
    np.testing.assert_allclose(costs[128] - costs[64], 2 * (costs[64] - costs[32]), rtol=1e-6)
    per_example = (costs[128] - costs[64]) / 64
    hand_per_example = flops.mlp_matmul_flops(1, _widths(params))
    assert hand_per_example <= per_example <= 1.10 * hand_per_example


def test_spmd_cost_is_one_devices_program(mlp, digits):
    single = _step_cost(pk.SingleDevice(), mlp, digits, 64)
    mirrored = _step_cost(pk.Mirrored(2), mlp, digits, 64)
    assert mirrored.devices == 2
    # Each of 2 devices runs half the batch; the replicated SGD update (2 FLOPs a parameter) is a
    # small constant on top, so one device's program is just over half the single-device step.
    assert 0.5 < mirrored.flops / single.flops < 0.55
    assert mirrored.total_flops == 2 * mirrored.flops


def test_dense_training_flops_hand_worked():
    params = {"w": np.zeros((10, 20)), "b": np.zeros(20)}  # 220 parameters
    assert flops.parameter_count(params) == 220
    assert flops.dense_training_flops(params, 5) == 6 * 220 * 5 == 6600
    # attention: 12 x 2 layers x 4 positions x 3 wide = 288 FLOPs a token, 5 tokens
    assert flops.dense_training_flops(220, 5, layers=2, seq_len=4, d_model=3) == 6600 + 1440


def test_mlp_matmul_flops_hand_worked():
    # widths 3 -> 4 -> 2, batch 5: forward 2*5*(12 + 8) = 200, weight grads 200, input grad of layer 2: 80
    assert flops.mlp_matmul_flops(5, (3, 4, 2), backward=False) == 200
    assert flops.mlp_matmul_flops(5, (3, 4, 2)) == 480


class _Compiled:
    """Stands in for a compiled program whose backend reports ``analysis``."""

    def __init__(self, analysis):
        self.analysis, self.input_shardings = analysis, ()

    def cost_analysis(self):
        return self.analysis


def test_cost_of_reads_a_dict_or_a_list_of_one():
    for analysis in ({"flops": 10.0, "bytes accessed": 5.0}, [{"flops": 10.0, "bytes accessed": 5.0}]):
        assert flops.cost_of(_Compiled(analysis)) == flops.StepCost(10.0, 5.0, None, 1)
    assert flops.cost_of(_Compiled({"flops": 10.0, "bytes accessed": 5.0})).intensity == 2.0


def test_missing_flop_count_says_what_to_do():
    with pytest.raises(ValueError, match="reports no FLOP count.*mlp_matmul_flops"):
        flops.cost_of(_Compiled({}))
    with pytest.raises(ValueError, match="cost analysis of one program, got 2"):
        flops.cost_of(_Compiled([{"flops": 1.0}, {"flops": 2.0}]))


@pytest.mark.parametrize(
    ("args", "message"),
    [((0, (3, 2)), "batch=0"), ((4, (3,)), "at least two widths"), ((4, (3, 0)), "widths=\\(3, 0\\)")],
)
def test_mlp_matmul_flops_rejects_bad_shapes(args, message):
    with pytest.raises(ValueError, match=message):
        flops.mlp_matmul_flops(*args)
