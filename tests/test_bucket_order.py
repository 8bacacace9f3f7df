"""Gradient buckets follow the backward pass: the last layer's gradients travel first, the embeddings' last.

The backward pass produces the head's gradients first and the embeddings' last, so PyTorch's
DDP fills its buckets in that order and starts each all-reduce while the backward pass goes
on. Here the order is read from the loss (``parallelkit.core.backward.gradient_order``), not
from ``jax.tree.leaves``, which sorts dict keys. Proven on notebook 01's MLP and on the kit's
GPT: the compiled step's all-reduces carry the head first and the embeddings last, no
all-reduce waits for a gradient of a bucket after it, and the parameters equal one device's.
Then the buckets' bad inputs, each a clear error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose
from jax.extend.core import Var

import parallelkit as pk
from parallelkit.core.backward import gradient_order
from parallelkit.measure.traffic import sizes
from parallelkit.strategies import data_parallel
from parallelkit.strategies.allreduce import bucket_plan

LENGTH = 32  # the GPT's tokens per sequence
# Bytes per bucket: the MLP's head and its hidden bias (2,856 B) in one, its first kernel
# (16 kB) alone; the GPT's head (33 kB) starts the first of several, its embedding (32 kB) ends them.
CAPS = {"mlp": 3_000, "gpt": 40_000}
FIRST_LAYER = {"mlp": "['hidden'][0]['kernel']", "gpt": "['embed']['embedding']"}
HEAD = ("['head']['bias']", "['head']['kernel']")


@pytest.fixture(scope="module")
def corpus() -> pk.data.Dataset:
    return pk.data.text(length=LENGTH)


@pytest.fixture(scope="module", params=["mlp", "gpt"])
def model(request, mlp, digits, corpus):
    """(name, loss_fn, params, batches): notebook 01's MLP on the digits, or a small GPT on text."""
    if request.param == "mlp":
        loss_fn, params = mlp
        return "mlp", loss_fn, params, list(pk.data.batches(digits, 64, steps=3))
    gpt = pk.models.GPT(256, max_length=LENGTH, dim=32, heads=4, depth=2, mlp_dim=64, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(gpt)
    return "gpt", pk.models.lm_loss(apply), params, list(pk.data.batches(corpus, 8, steps=3))


def leaf_names(params) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]


def named_plan(name, loss_fn, params, batch) -> list[list[str]]:
    """The step's buckets, each as its leaves' paths."""
    nbytes = [4 * x.size for x in jax.tree.leaves(params)]
    names = leaf_names(params)
    plan = bucket_plan(nbytes, CAPS[name], gradient_order(loss_fn, params, batch))
    return [[names[i] for i in bucket] for bucket in plan]


def test_the_first_bucket_holds_the_head_and_the_last_the_first_layer(model):
    name, loss_fn, params, batches = model
    plan = named_plan(name, loss_fn, params, batches[0])
    assert len(plan) > 1
    assert set(HEAD) <= set(plan[0])
    assert FIRST_LAYER[name] in plan[-1]
    if name == "gpt":  # and the blocks in between, the last block's before the first's
        blocks = [next(k for k, bucket in enumerate(plan) if any(f"['blocks'][{b}]" in n for n in bucket))
                  for b in (1, 0)]  # fmt: skip
        assert blocks == sorted(blocks)


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_the_compiled_all_reduces_carry_the_head_first(model, backend):
    """The step's all-reduces in order: the head's bucket (and the metrics) first, the first layer's last."""
    name, loss_fn, params, batches = model
    strategy = pk.Mirrored(4, backend=backend, bucket_bytes=CAPS[name])
    state = strategy.init(params, optax.sgd(0.1))
    leaf_bytes = dict(zip(leaf_names(params), (4 * x.size for x in jax.tree.leaves(params)), strict=True))
    expected = [sum(leaf_bytes[n] for n in bucket) for bucket in named_plan(name, loss_fn, params, batches[0])]
    assert strategy.gradient_buckets(loss_fn, state, batches[0]) == expected
    found = [c.bytes for c in pk.inspect.collectives(strategy.step(loss_fn), state, batches[0]) if c.op == "all-reduce"]
    metrics = sizes(strategy, loss_fn, state, batches[0]).metrics
    assert found == [expected[0] + metrics, *(b + 4 for b in expected[1:])]  # each later one: a float of the one before


def _cone(eqns, var: Var) -> set:
    """Every value ``var`` is computed from, in a flat list of equations (a nested call counts as one)."""
    producer = {v: eqn for eqn in eqns for v in eqn.outvars}
    seen, todo = set(), [var]
    while todo:
        v = todo.pop()
        if v in seen or v not in producer:
            continue
        seen.add(v)
        todo += [u for u in producer[v].invars if isinstance(u, Var)]
    return seen


def _source(eqns, var: Var) -> Var:
    """The gradient behind a bucket's piece: back through the flattening and the cast to float32."""
    producer = {v: eqn for eqn in eqns for v in eqn.outvars}
    while var in producer and producer[var].primitive.name in ("reshape", "convert_element_type"):
        var = producer[var].invars[0]
    return var


def test_no_all_reduce_waits_for_a_later_buckets_gradients(model):
    """Bucket ``k``'s all-reduce waits for its own gradients and bucket ``k-1``'s result, never a later bucket's
    gradient: the head's starts before the backward pass reaches the embeddings (or on a backend that overlaps)."""
    name, loss_fn, params, batches = model
    state = pk.SingleDevice().init(params, optax.sgd(0.1))
    local = jax.tree.map(lambda x: x[: len(x) // 4], batches[0])
    step = data_parallel.replica_step(loss_fn, None, bucket_bytes=CAPS[name])
    eqns = jax.make_jaxpr(step, axis_env=[("data", 4)])(state, local).jaxpr.eqns
    producer = {v: eqn for eqn in eqns for v in eqn.outvars}
    reduces = [eqn for eqn in eqns if eqn.primitive.name == "psum"]
    assert len(reduces) == len(named_plan(name, loss_fn, params, batches[0])) > 1
    pieces = []  # each bucket's gradients, as the backward pass returns them
    for k, eqn in enumerate(reduces):
        concatenated = producer[eqn.invars[0]].invars
        pieces.append({_source(eqns, v) for v in (concatenated[:-1] if k else concatenated)})
    for k, eqn in enumerate(reduces):
        waits_for = _cone(eqns, eqn.invars[0])
        for later in pieces[k + 1 :]:
            assert not later & waits_for, f"bucket {k}'s all-reduce waits for a gradient of a later bucket"


@pytest.mark.parametrize("backend", ["jit", "pmap"])
def test_bucketed_training_in_the_backward_order_equals_one_device(model, backend):
    name, loss_fn, params, batches = model
    results = []
    for strategy in (pk.SingleDevice(), pk.Mirrored(4, backend=backend, bucket_bytes=CAPS[name])):
        state, step = strategy.init(params, optax.adam(1e-3)), strategy.step(loss_fn)
        for batch in batches:
            state, _ = step(state, batch)
        results.append(strategy.unreplicate(state.params))
    tree_allclose(results[1], results[0])


def test_the_order_skips_what_only_prepares_a_parameter_and_puts_an_unread_one_first():
    def loss(p, b):  # "a" is cast and reshaped before it meets the data; "unused" is never read
        a = p["a"].astype(jnp.bfloat16).astype(jnp.float32).reshape(3, 4)
        return jnp.mean((jnp.tanh(jnp.tanh(b["x"] @ p["first"]) @ a) @ p["last"]) ** 2)

    params = {"a": jnp.ones(12), "first": jnp.ones((2, 3)), "last": jnp.ones((4, 1)), "unused": jnp.ones(5)}
    names = leaf_names(params)
    order = gradient_order(loss, params, {"x": jnp.ones((8, 2))})
    assert [names[i] for i in order] == ["['unused']", "['last']", "['a']", "['first']"]


def test_the_order_looks_inside_a_jitted_loss():
    def layers(p, x):
        return jnp.tanh(jnp.tanh(x @ p["z_first"]) @ p["a_last"])

    def loss(p, b):
        return jnp.mean(jax.jit(layers)(p, b["x"]) ** 2)

    params = {"a_last": jnp.ones((3, 1)), "z_first": jnp.ones((2, 3))}
    assert gradient_order(loss, params, {"x": jnp.ones((4, 2))}) == (0, 1)


# Bad inputs: each a clear error.


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_gradient_buckets_refuses_what_mirrored_refuses(bad):
    params = {"a": np.zeros(100), "b": np.zeros(300)}
    with pytest.raises(ValueError, match=rf"gradient_buckets\(bucket_bytes={bad!r}\).*whole number >= 1"):
        data_parallel.gradient_buckets(params, bad, [1, 0])
    with pytest.raises(ValueError, match=rf"Mirrored\(bucket_bytes={bad!r}\).*whole number >= 1"):
        pk.Mirrored(2, bucket_bytes=bad)


def test_a_numpy_integer_is_a_whole_number_of_bytes():
    params = {"a": np.zeros(100), "b": np.zeros(300)}
    assert data_parallel.gradient_buckets(params, np.int64(1000), [1, 0]) == [1200, 400]
    assert repr(pk.Mirrored(2, bucket_bytes=np.int64(4096))) == "Mirrored(backend='jit', devices=2, bucket_bytes=4096)"


def test_gradient_buckets_of_no_parameters_is_a_clear_error():
    with pytest.raises(ValueError, match=r"gradient_buckets\(params=\{\}\): the parameters hold no arrays"):
        data_parallel.gradient_buckets({}, 100, [])


def test_a_plan_order_that_misses_a_leaf_is_a_clear_error():
    with pytest.raises(ValueError, match=r"order=\[1\].*each of the 2 leaves once"):
        bucket_plan([400, 400], 800, [1])
    with pytest.raises(ValueError, match=r"order=None.*each of the 2 leaves once"):
        bucket_plan([400, 400], 800, None)


def test_strategy_gradient_buckets_names_what_it_needs(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.Mirrored(2, bucket_bytes=1000)
    with pytest.raises(TypeError, match=r"gradient_buckets\(loss_fn, state, batch\) got \(dict\).*Pass the loss"):
        strategy.gradient_buckets(params)
    with pytest.raises(TypeError, match=r"got \(function, dict, dict\).*the state strategy.init returned"):
        strategy.gradient_buckets(loss_fn, params, batch)
    with pytest.raises(ValueError, match="needs a batch as well"):
        strategy.gradient_buckets(loss_fn, strategy.init(params, optax.sgd(0.1)))


FOUR = pk.costmodel.Cluster(1, 4, pk.costmodel.Link("test", GBps=10, latency_us=5, source="by hand"))


def test_a_timeline_of_a_generator_plays_every_bucket():
    timeline = pk.costmodel.bucket_timeline(FOUR, (b for b in [1e6] * 4), backward_s=1e-3)
    assert timeline == pk.costmodel.bucket_timeline(FOUR, [1e6] * 4, backward_s=1e-3)
    assert len(timeline.ends) == 4


@pytest.mark.parametrize("buckets", [[float("inf")], [1e6, float("nan")], [-1.0], ["1e6"]])
def test_a_bucket_that_is_not_a_finite_number_of_bytes_is_refused(buckets):
    with pytest.raises(ValueError, match="finite number of bytes > 0"):
        pk.costmodel.bucket_timeline(FOUR, buckets, backward_s=1e-3)


@pytest.mark.parametrize("backward_s", [float("nan"), float("inf"), -1.0, None])
def test_a_backward_time_that_is_not_a_finite_number_is_refused(backward_s):
    with pytest.raises(ValueError, match=r"backward_s=.*finite number of seconds >= 0"):
        pk.costmodel.bucket_timeline(FOUR, [1e6], backward_s=backward_s)
