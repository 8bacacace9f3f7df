"""Mixed precision and loss scaling, ``strategy.step(loss_fn, precision=pk.Precision(...))``.

On the suite's 8 simulated devices. Reduced-precision runs are compared with SingleDevice
under the same policy, within the bfloat16 tolerance that ``assert_within_bf16`` states and explains;
float32 runs keep rtol 1e-5, atol 1e-6 (and ``precision=None`` must be bit-identical).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose

import parallelkit as pk

STEPS, BATCH, LR = 10, 64, 0.1

# TensorParallel(model=2) and Hybrid(2, 2) leave some of the suite's 8 devices idle on purpose here.
pytestmark = pytest.mark.filterwarnings("ignore::parallelkit.DeviceSubsetWarning")

STRATEGIES = {
    "mirrored-jit": lambda: pk.Mirrored(backend="jit"),
    "mirrored-pmap": lambda: pk.Mirrored(backend="pmap"),
    "mirrored-jit-ring": lambda: pk.Mirrored(backend="jit", allreduce="ring"),
    "multiworker": lambda: pk.MultiWorkerMirrored(),
    "central-storage": lambda: pk.CentralStorage(),
    "parameter-server": lambda: pk.ParameterServer(3),
    "tensor": lambda: pk.TensorParallel(model=2),
    "fully-sharded-3": lambda: pk.FullySharded(3, min_size=1),
    "hybrid": lambda: pk.Hybrid(2, 2, shard_data=True, min_size=1),
}

# bfloat16 keeps 8 significant bits: one rounding is off by at most u = 2^-8 of the value.
U_BF16 = 2.0**-8


def train(strategy, loss_fn, params, batches, precision=None, accumulate=1, tx=None):
    """(the parameters after each step, host copies with the initial ones first; the last state; metrics)."""
    state = strategy.init(params, tx or optax.sgd(LR))
    step = strategy.step(loss_fn, precision=precision, accumulate=accumulate)
    trace, history = [strategy.unreplicate(state.params)], []
    for batch in batches:
        state, metrics = step(state, batch)
        trace.append(strategy.unreplicate(state.params))
        history.append(jax.device_get(metrics))
    return trace, state, history


def assert_within_bf16(trace, reference, layers: int) -> None:
    """The parameters after the last step agree with the reference's within a tolerance scaled by bfloat16's u.

    Under the same policy two strategies run the same operations in bfloat16, but their
    programs may round different intermediates: XLA may keep excess precision inside a fusion
    (``xla_allow_excess_precision``, on by default), and the sum of the gradient over the batch
    is rounded once on one device, once per replica or microbatch elsewhere. In a chain of
    ``layers`` dense layers a parameter's gradient goes through at most ``2 x layers + 1``
    roundings (each layer's output, each cotangent, and the sum over the batch), each off by at
    most ``u`` of its value. From the same parameters, to first order, a step's gradient may
    then differ by ``(2 layers + 1) u |g_t|``, and with SGD (``dp_t = -lr g_t``) its update by as
    much of ``|dp_t|``. The tolerance adds these up over the steps: for each parameter array,
    ``|p - p_ref| <= (2 layers + 1) u sum_t |dp_t|`` in the Euclidean norm, ``dp_t`` the
    reference's updates.

    It is a tolerance, not a bound. After the first step the two runs' parameters differ, and
    that difference changes every later gradient as it passes through the later steps and
    layers; the sum leaves that growth out, and the second-order terms too. It was chosen as
    this first-order count of each step's own roundings, and the runs here stay within it.
    """
    bound = (2 * layers + 1) * U_BF16
    moved = jax.tree.map(
        lambda *ps: sum(float(np.linalg.norm(np.asarray(b) - np.asarray(a))) for a, b in zip(ps, ps[1:], strict=False)),
        *reference,
    )
    for (path, got), want, total in zip(
        jax.tree_util.tree_flatten_with_path(trace[-1])[0],
        jax.tree.leaves(reference[-1]),
        jax.tree.leaves(moved),
        strict=True,
    ):
        diff = float(np.linalg.norm(np.asarray(got) - np.asarray(want)))
        assert diff <= bound * total, f"{jax.tree_util.keystr(path)}: {diff:.3g} > {bound:.3g} x {total:.3g}"


def dense_layers(params) -> int:
    """How many dense layers ``params`` hold (one kernel each)."""
    return sum("kernel" in jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def assert_float32_state(strategy, state) -> None:
    for leaf in jax.tree.leaves(strategy.unreplicate((state.params, state.opt_state))):
        if np.issubdtype(np.asarray(leaf).dtype, np.floating):
            assert np.asarray(leaf).dtype == np.float32


@pytest.fixture(scope="module")
def batches(digits):
    return list(pk.data.batches(digits, BATCH, steps=STEPS))


@pytest.fixture(scope="module")
def bf16_reference(mlp, batches):
    """SingleDevice under the bfloat16 policy: the yardstick of every bfloat16 run."""
    loss_fn, params = mlp
    trace, state, history = train(pk.SingleDevice(), loss_fn, params, batches, pk.Precision.bf16())
    assert_float32_state(pk.SingleDevice(), state)
    assert not np.allclose(jax.tree.leaves(trace[-1])[0], jax.tree.leaves(params)[0]), "training moved nothing"
    return trace


@pytest.mark.parametrize("name", STRATEGIES)
def test_bf16_equals_single_device_under_the_same_policy(name, mlp, batches, bf16_reference):
    loss_fn, params = mlp
    strategy = STRATEGIES[name]()
    trace, state, history = train(strategy, loss_fn, params, batches, pk.Precision.bf16())
    assert_within_bf16(trace, bf16_reference, dense_layers(params))
    assert_float32_state(strategy, state)
    assert history[-1]["loss"].dtype == np.float32 and "loss_scale" not in history[-1]


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_bf16_with_accumulation_equals_single_device(backend, mlp, batches, bf16_reference):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend=backend)
    trace, state, _ = train(strategy, loss_fn, params, batches, pk.Precision.bf16(), accumulate=4)
    assert_within_bf16(trace, bf16_reference, dense_layers(params))
    assert_float32_state(strategy, state)


def test_bf16_differs_from_float32(mlp, batches, bf16_reference):
    """The policy is applied: bfloat16 passes do not give float32's parameters."""
    loss_fn, params = mlp
    trace, _, _ = train(pk.SingleDevice(), loss_fn, params, batches[:1])
    assert not np.allclose(jax.tree.leaves(trace[1])[0], jax.tree.leaves(bf16_reference[1])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", [pk.Precision.bf16(), pk.Precision.fp16()], ids=["bf16", "fp16"])
def test_gradients_meet_in_float32(precision, mlp, batch):
    """16-bit passes under Mirrored(jit): the gradient all-reduce carries float32.

    Left to itself XLA's partitioner all-reduces the batch contraction's partial sums inside the
    backward pass, in float16 (it did, before each replica's gradients became their own row); the
    step casts each replica's row back first.
    """
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state = strategy.init(params, optax.sgd(LR))
    found = pk.inspect.collectives(strategy.step(loss_fn, precision=precision), state, batch)
    reduced = [c for c in found if c.op == "all-reduce" and not all(s.startswith("pred[") for s in c.shapes)]
    assert reduced and all(shape.startswith("f32[") for c in reduced for shape in c.shapes), reduced
    assert sum(c.bytes for c in reduced) == gradient_bytes(params) + 8  # float32 gradients, loss and accuracy


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("precision", [pk.Precision.bf16(), pk.Precision.fp16()], ids=["bf16", "fp16"])
def test_sharded_gradients_meet_in_float32(stage, precision, mlp, batch):
    """16-bit passes under FullySharded(2) and (3): every gradient reduction carries float32.

    Left to itself XLA's partitioner reduced the batch contraction's partial sums in float16 here
    (it did, before each replica differentiated a copy of the parameters of its own); the copies'
    transpose casts each replica's gradient back first.
    """
    loss_fn, params = mlp
    strategy = pk.FullySharded(stage, min_size=1)
    state = strategy.init(params, optax.sgd(LR))
    found = pk.inspect.collectives(strategy.step(loss_fn, precision=precision), state, batch)
    syncs = [c for c in found if c.op in ("all-reduce", "reduce-scatter")]
    reduced = [c for c in syncs if not all(s.startswith("pred[") for s in c.shapes)]  # not the finite check
    assert reduced and all(shape.startswith("f32[") for c in reduced for shape in c.shapes), reduced
    # the whole gradient is reduced (on this CPU backend an all-reduce whose shard each device keeps), and the metrics
    assert sum(c.bytes for c in reduced) == gradient_bytes(params) + 8, reduced


def gradient_bytes(params) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))


def test_zero3_under_16_bit_compute_holds_one_whole_gradient_and_its_sharded_state(mlp, batch):
    """The price of casting before the reduction: under bfloat16 passes ZeRO-3's temporaries reach
    Mirrored's (each device holds its replica's whole float32 gradient while it is reduced), and no more,
    while the state it places stays sharded (an eighth of Mirrored's, on 8 devices)."""
    loss_fn, params = mlp
    use = {}
    for name, strategy in (("mirrored", pk.Mirrored(backend="jit")), ("zero3", pk.FullySharded(3, min_size=1))):
        state = strategy.init(params, optax.sgd(LR))
        use[name] = pk.inspect.memory_per_device(strategy.step(loss_fn, precision=pk.Precision.bf16()), state, batch)
    assert use["zero3"].temp <= 1.1 * use["mirrored"].temp, use
    assert use["zero3"].temp >= gradient_bytes(params), use  # a whole float32 gradient, as the docs say
    assert use["zero3"].argument < use["mirrored"].argument / 4, use


@pytest.mark.parametrize(
    "make", [pk.SingleDevice, lambda: pk.Mirrored(backend="pmap"), pk.CentralStorage, lambda: pk.ParameterServer(2)]
)
def test_no_precision_is_bit_identical(make, mlp, batches):
    loss_fn, params = mlp
    strategy = make()
    runs = []
    for kwargs in ({}, {"precision": None}):
        state = strategy.init(params, optax.adam(1e-2))
        step = strategy.step(loss_fn, **kwargs)
        for batch in batches[:3]:
            state, metrics = step(state, batch)
        assert state.loss_scale is None and set(metrics) == {"loss", "accuracy"}
        runs.append(jax.device_get((state.params, state.opt_state, metrics)))
    jax.tree.map(np.testing.assert_array_equal, *runs)


DEBUG_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def test_no_precision_compiles_the_same_program(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(backend="jit")
    state = strategy.init(params, optax.sgd(LR))

    def program(**kwargs) -> str:
        """The compiled HLO without its source locations (which hold this file's line numbers)."""
        text = pk.inspect.compiled_text(strategy.step(loss_fn, **kwargs), state, batch)
        blocks = [b for b in text.split("\n\n") if not b.startswith(DEBUG_TABLES)]
        return re.sub(r", metadata=\{[^}]*\}", "", "\n\n".join(blocks))

    assert "all-reduce" in program() and program(precision=None) == program()


def poisoned(batch):
    """``batch`` with inputs beyond float16's largest finite value (65504): its forward pass overflows."""
    return {**batch, "x": np.full_like(batch["x"], 1e5)}


LOSS_SCALE_STRATEGIES = {
    "single": pk.SingleDevice,
    "mirrored-jit": lambda: pk.Mirrored(backend="jit"),
    "central-storage": pk.CentralStorage,
    "mirrored-pmap": lambda: pk.Mirrored(backend="pmap"),
    "parameter-server": lambda: pk.ParameterServer(2),
}


def assert_scale_cycle(strategy, loss_fn, params, batches, accumulate: int = 1) -> None:
    """fp16 with ``period=2``: a good step, an overflowing one (skipped, the scale halved), then two
    good steps, after which the scale doubles."""
    precision = pk.Precision.fp16(period=2, initial_scale=1024.0)
    state = strategy.init(params, optax.sgd(LR, momentum=0.9))
    step = strategy.step(loss_fn, precision=precision, accumulate=accumulate)
    feed = [batches[0], poisoned(batches[1]), batches[2], batches[3], batches[4]]
    scales, finite, counters = [], [], []
    for i, batch in enumerate(feed):
        before = jax.device_get(jax.tree.map(jnp.copy, (state.params, state.opt_state)))
        state, metrics = step(state, batch)
        after = jax.device_get((state.params, state.opt_state))
        scales.append(float(np.asarray(metrics["loss_scale"]).reshape(-1)[0]))
        finite.append(bool(np.asarray(metrics["grads_finite"]).reshape(-1)[0]))
        counters.append(int(np.asarray(jax.device_get(state.step)).reshape(-1)[0]))
        if i == 1:  # skipped: parameters and optimizer state exactly as before
            jax.tree.map(np.testing.assert_array_equal, after, before)
        else:
            assert not np.array_equal(jax.tree.leaves(after[0])[0], jax.tree.leaves(before[0])[0]), i
    assert finite == [True, False, True, True, True]
    # the scale each step used: 1024, overflow -> 512 for two good steps -> doubled to 1024
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 1024.0]
    assert counters == [1, 2, 3, 4, 5]  # the skipped step still counts
    final = jax.device_get(state.loss_scale)
    assert float(np.asarray(final.scale).reshape(-1)[0]) == 1024.0 and int(np.asarray(final.good_steps).max()) == 1


@pytest.mark.parametrize("name", LOSS_SCALE_STRATEGIES)
def test_dynamic_loss_scale_skips_halves_and_doubles(name, mlp, batches):
    loss_fn, params = mlp
    assert_scale_cycle(LOSS_SCALE_STRATEGIES[name](), loss_fn, params, batches)


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_dynamic_loss_scale_with_accumulation(backend, mlp, batches):
    loss_fn, params = mlp
    assert_scale_cycle(pk.Mirrored(backend=backend), loss_fn, params, batches, accumulate=4)


@pytest.fixture(scope="module")
def layers(digits):
    """The small MLP as a pipeline's layers, and its per-layer parameters."""
    return pk.models.as_layers(pk.models.MLP(64, (64, 32), digits.num_classes, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_bf16_pipeline_equals_single_device_under_the_same_policy(schedule, layers, batches):
    apply, params = layers
    single = pk.pipeline.sequential_loss(apply, pk.models.cross_entropy)
    reference, _, _ = train(pk.SingleDevice(), single, params, batches, pk.Precision.bf16())
    pipe = pk.Pipeline(apply, 2, microbatches=2, schedule=schedule)
    trace, state, _ = train(pipe, pk.models.cross_entropy, params, batches, pk.Precision.bf16())
    assert_within_bf16(trace, reference, dense_layers(params))
    assert_float32_state(pipe, state)


def test_a_pipeline_skips_halves_and_doubles_its_loss_scale(layers, batches):
    apply, params = layers
    assert_scale_cycle(pk.Pipeline(apply, 2, microbatches=2), pk.models.cross_entropy, params, batches)


def test_a_skipped_step_keeps_the_key_and_a_huge_scale_halves(mlp, batches):
    """The first scale overflows float16 (2^40 x the loss's gradients): skipped, key kept, scale halved."""
    loss_fn, params = mlp
    strategy = pk.SingleDevice()
    precision = pk.Precision(compute="float16", loss_scale="dynamic", initial_scale=2.0**40)
    state = strategy.init(params, optax.adam(1e-3), rng=0)
    key = jax.device_get(state.rng)

    def keyed(params, batch, rng):  # the state's key reaches the loss (as for dropout)
        return loss_fn(params, batch)

    state, metrics = strategy.step(keyed, precision=precision)(state, batch=batches[0])
    assert not bool(metrics["grads_finite"]) and float(state.loss_scale.scale) == 2.0**39
    np.testing.assert_array_equal(jax.device_get(state.rng), key)
    tree_allclose(jax.device_get(state.params), params, rtol=0, atol=0)


def test_a_fixed_loss_scale_trains_like_no_scale_in_float32(mlp, batches):
    """A power-of-two scale is exact in float32: multiplying then dividing changes no bit of the update."""
    loss_fn, params = mlp
    plain, _, _ = train(pk.SingleDevice(), loss_fn, params, batches[:3])
    scaled, state, history = train(
        pk.SingleDevice(), loss_fn, params, batches[:3], pk.Precision("float32", "float32", loss_scale=1024.0)
    )
    tree_allclose(scaled[-1], plain[-1])
    assert state.loss_scale is None and float(history[-1]["loss_scale"]) == 1024.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compute": "bf16"}, r"unknown dtype; use one of \('float16', 'bfloat16', 'float32', 'float64'\)"),
        ({"params": "int32"}, "not a floating dtype"),
        ({"loss_scale": 0}, "'dynamic', a fixed number > 0"),
        ({"loss_scale": "auto"}, "'dynamic', a fixed number > 0"),
        ({"period": 0}, "integer >= 1"),
        ({"initial_scale": float("inf")}, "finite number > 0"),
    ],
)
def test_bad_policies_say_what_works(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pk.Precision(**kwargs)


def test_bad_precision_arguments_are_refused_clearly(mlp, batch):
    loss_fn, params = mlp
    with pytest.raises(TypeError, match=r"pass a pk.Precision"):
        pk.SingleDevice().step(loss_fn, precision="bf16")
    strategy = pk.SingleDevice()
    state = strategy.init(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), optax.sgd(LR))
    with pytest.raises(ValueError, match=r"is bfloat16, but the precision policy keeps parameters in float32"):
        strategy.step(loss_fn, precision=pk.Precision.bf16())(state, batch)


def test_async_parameter_servers_skip_and_scale_push_by_push(mlp, batches):
    """Each push is an update of its own: an overflowing round of 2 pushes halves the scale twice
    and changes nothing; 4 finite pushes later (``period=4``) it doubles."""
    loss_fn, params = mlp
    strategy = pk.ParameterServer(2, mode="async", devices=2)
    state = strategy.init(params, optax.sgd(LR, momentum=0.9))
    step = strategy.step(loss_fn, precision=pk.Precision.fp16(period=4, initial_scale=1024.0))
    state, metrics = step(state, batches[0])
    assert float(metrics["grads_finite"]) == 1.0 and float(state.loss_scale.scale) == 1024.0
    before = strategy.unreplicate(jax.tree.map(jnp.copy, (state.params, state.opt_state)))
    state, metrics = step(state, poisoned(batches[1]))
    jax.tree.map(np.testing.assert_array_equal, strategy.unreplicate((state.params, state.opt_state)), before)
    assert float(metrics["grads_finite"]) == 0.0 and float(state.loss_scale.scale) == 256.0
    assert float(metrics["loss_scale"]) == 256.0  # the scale after the round, not the mean 768 of 1024 and 512
    for batch in batches[2:4]:
        state, metrics = step(state, batch)
        assert float(metrics["grads_finite"]) == 1.0
    assert float(state.loss_scale.scale) == 512.0 and int(state.step) == 8


def test_fit_passes_precision_and_accumulate_to_the_step(mlp, batches):
    loss_fn, params = mlp
    precision = pk.Precision.fp16(period=2, initial_scale=1024.0)
    result = pk.fit(pk.Mirrored(), loss_fn, params, optax.sgd(LR), batches[:3], precision=precision, accumulate=2)
    assert list(result.history.metric("loss_scale")) == [1024.0, 1024.0, 2048.0]
    assert list(result.history.metric("grads_finite")) == [1.0, 1.0, 1.0]


def test_an_async_rounds_loss_scale_metric_outlives_the_next_round(mlp, batches):
    """The metric is read later (the skipped-steps watch reads it once ready): the next round's donation
    of the state must not delete it."""
    loss_fn, params = mlp
    strategy = pk.ParameterServer(2, mode="async", devices=2)
    step = strategy.step(loss_fn, precision=pk.Precision.fp16(initial_scale=1024.0))
    state, first = step(strategy.init(params, optax.sgd(LR)), batches[0])
    state, _ = step(state, batches[1])
    assert not first["loss_scale"].is_deleted() and float(first["loss_scale"]) == 1024.0
