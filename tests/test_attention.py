"""pk.attention: every context-parallel method equals dense attention, moves what it claims, and splits the scores."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import parallelkit as pk
from parallelkit import attention

SEQ_RULES = (("batch", pk.DATA), ("length", pk.SEQ))
CLAIMED = {
    "allgather": "all-gather",
    "ring": "collective-permute",
    "ring_zigzag": "collective-permute",
    "ulysses": "all-to-all",
}


def _qkv(length: int = 32, heads: int = 8, batch: int = 2, seed: int = 0) -> tuple[jax.Array, ...]:
    return tuple(jax.random.normal(jax.random.key(seed), (3, batch, length, heads, 8)))


def _seq_mesh(n: int):
    return pk.mesh.make_mesh(jax.devices()[:n], seq=n)


def _grads(fn, q, k, v):
    return jax.grad(lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))), argnums=(0, 1, 2))(q, k, v)


def _with_grads(fn):
    """``fn``'s output and the gradients of a sum through it, in one compiled program."""
    return jax.jit(lambda q, k, v: (fn(q, k, v), _grads(fn, q, k, v)))


DENSE = {causal: _with_grads(partial(attention.dense, causal=causal)) for causal in (True, False)}


def test_dense_is_the_softmax_of_the_scaled_scores_with_a_causal_mask():
    q, k, v = (np.asarray(x, np.float64) for x in _qkv(length=6, heads=2))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((6, 6), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(attention.dense(*_qkv(length=6, heads=2)), expected, rtol=1e-5, atol=1e-6)


def test_dense_is_stable_for_large_scores():
    q, k, v = (x * 1e3 for x in _qkv(length=8, heads=2))  # exp of unshifted scores would overflow float32
    assert bool(jnp.isfinite(attention.dense(q, k, v)).all())


def test_dense_underflows_a_far_term_to_zero_and_that_is_harmless():
    """Scores 0 and 200 in a row: shifted by the row's maximum, the far term is exp(-200), 0 in float32; the row's
    sum is exactly 1 and the output is the float32 rounding of the exact (float64) softmax."""
    q = jnp.ones((1, 2, 1, 1))
    k, v = (jnp.array(pair).reshape(1, 2, 1, 1) for pair in ([0.0, 200.0], [5.0, 7.0]))
    _, total, _ = attention._block(q, k, v)  # no mask: both rows see both keys
    assert np.asarray(total).tolist() == [[[1.0, 1.0]]]  # exp(0) plus an underflowed exp(-200)
    far = np.exp(-200.0)  # about 1e-87 in float64
    exact = np.float32((5 * far + 7) / (far + 1))
    assert np.asarray(attention.dense(q, k, v, causal=False))[0, :, 0, 0].tolist() == [exact, exact] == [7.0, 7.0]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("method", attention.METHODS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_each_method_equals_dense_with_its_gradients(n, method, causal):
    """Outputs and the gradients of q, k, v; with ``causal`` the first device's queries see none of the
    later blocks (whole blocks of the mask are empty) and the ring skips them."""
    q, k, v = _qkv()
    mesh = _seq_mesh(n)
    split = _with_grads(partial(attention.context_parallel, mesh=mesh, method=method, causal=causal))
    tree_allclose(split(q, k, v), DENSE[causal](q, k, v))


@pytest.mark.parametrize("batch_axes", [pk.DATA, None], ids=["batch-split", "batch-replicated"])
@pytest.mark.parametrize("method", attention.METHODS)
def test_two_tokens_per_device_with_the_batch_split_or_replicated(method, batch_axes):
    """8 tokens on seq=4 (most of the causal mask whole empty blocks), the batch split over data=2 or
    replicated across it: outputs and gradients equal dense's."""
    q, k, v = _qkv(length=8, heads=4, batch=4)
    mesh = pk.mesh.make_mesh(jax.devices()[:8], data=2, seq=4)
    split = _with_grads(partial(attention.context_parallel, mesh=mesh, method=method, batch_axes=batch_axes))
    out, grads = split(q, k, v)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(batch_axes, pk.SEQ, None, None)), out.ndim)
    tree_allclose((out, grads), DENSE[True](q, k, v))


def _ops(fn, *args) -> dict[str, dict[str, int]]:
    return pk.inspect.summarize(pk.inspect.collectives(jax.jit(fn), *args))


@pytest.mark.parametrize("method", attention.METHODS)
def test_the_compiled_program_holds_the_methods_collectives(method):
    q, k, v = _qkv()
    n, mesh = 4, _seq_mesh(4)
    forward = _ops(lambda q, k, v: attention.context_parallel(q, k, v, mesh=mesh, method=method), q, k, v)
    assert set(forward) == {CLAIMED[method]}  # nothing else moves in the forward pass
    block = q.nbytes // n  # one device's slice of q (or of k, or of v)
    if method.startswith("ring"):  # n - 1 steps, each passing one block of k and one of v; never all of k or v
        layout = 4 * block if method == "ring_zigzag" else 0  # q, k, v to the zig-zag layout and the output back
        assert forward["collective-permute"]["bytes"] == (n - 1) * 2 * block + layout
        backward = _ops(
            lambda q, k, v: _grads(lambda *a: attention.context_parallel(*a, mesh=mesh, method=method), q, k, v),
            q,
            k,
            v,
        )
        assert "all-gather" not in backward and "collective-permute" in backward
    elif method == "allgather":  # each device ends with the whole of k and of v
        assert forward["all-gather"]["bytes"] == 2 * q.nbytes
    else:  # q, k, v to heads and the output back: four all-to-alls of one block each
        assert forward["all-to-all"]["bytes"] == 4 * block


@pytest.mark.parametrize("method", attention.METHODS)
@pytest.mark.parametrize("shape", [{"data": 2, "seq": 2}, {"data": 2, "seq": 4}], ids=["data2-seq2", "data2-seq4"])
def test_attend_under_spmd_rules_runs_the_method_and_equals_dense(shape, method):
    """Inside a strategy's tracing with length on seq, attend is the method (its collective in the program)."""
    q, k, v = _qkv(heads=4)
    mesh = pk.mesh.make_mesh(jax.devices()[: shape["data"] * shape["seq"]], **shape)
    strategy = pk.SPMD(mesh, rules=SEQ_RULES)
    placed = jax.device_put((q, k, v), NamedSharding(mesh, P(pk.DATA, pk.SEQ)))
    fn = jax.jit(lambda q, k, v: attention.attend(q, k, v))
    with strategy.tracing(), attention.method(method):
        out = fn(*placed)
        ops = _ops(fn, *placed)
    assert CLAIMED[method] in ops
    assert out.sharding.is_equivalent_to(placed[0].sharding, out.ndim)  # the output laid out as the queries
    np.testing.assert_allclose(out, attention.dense(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", attention.METHODS)
def test_attend_keeps_the_heads_split_the_rules_give(method):
    """Heads on model=2 and length on seq=2: each device attends half the heads of half the tokens."""
    q, k, v = _qkv(heads=4)
    mesh = pk.mesh.make_mesh(jax.devices()[:4], seq=2, model=2)
    strategy = pk.SPMD(mesh, rules=(("length", pk.SEQ), ("heads", pk.MODEL)))
    fn = jax.jit(lambda q, k, v: attention.attend(q, k, v))
    with strategy.tracing(), attention.method(method):
        out = fn(q, k, v)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, pk.SEQ, pk.MODEL, None)), out.ndim)
    np.testing.assert_allclose(out, attention.dense(q, k, v), rtol=1e-5, atol=1e-6)


def test_ulysses_counts_the_heads_left_after_the_rules_split_them():
    q, k, v = _qkv(heads=2)
    mesh = pk.mesh.make_mesh(jax.devices()[:4], seq=2, model=2)
    with pk.SPMD(mesh, rules=(("length", pk.SEQ), ("heads", pk.MODEL))).tracing(), attention.method("ulysses"):
        with pytest.raises(ValueError, match=r"1 head\(s\) do not divide by its 2 devices"):
            attention.attend(q, k, v)


def test_attend_is_dense_outside_a_strategy_and_when_length_is_not_split():
    q, k, v = _qkv()
    assert _ops(attention.attend, q, k, v) == {}
    np.testing.assert_array_equal(attention.attend(q, k, v), attention.dense(q, k, v))
    batch_only = pk.SPMD(pk.mesh.make_mesh(jax.devices()[:2], data=2), rules=(("batch", pk.DATA),))
    with batch_only.tracing():
        assert _ops(attention.attend, q, k, v) == {}


def _attention_loss(params, batch):
    b, t, _ = batch["x"].shape
    q, k, v = jnp.split((batch["x"] @ params["w"]).reshape(b, t, 4, 24), 3, axis=-1)
    return jnp.mean((attention.attend(q, k, v) - batch["y"]) ** 2)


@pytest.mark.parametrize(("method", "accumulate"), [("ring", 1), ("ring_zigzag", 2)])
def test_an_spmd_step_with_ring_attention_trains_as_one_device(method, accumulate):
    """Three SGD steps of one attention layer, tokens over seq=4, the batch over data=2: SingleDevice's parameters
    (with ``accumulate=2`` too, where the replicas are a ``jax.vmap`` axis around the ``shard_map``)."""
    data = jax.random.normal(jax.random.key(1), (3, 4, 32, 16))
    batches = [{"x": x, "y": x[..., :8].reshape(4, 32, 1, 8)} for x in data]
    params = {"w": jax.random.normal(jax.random.key(2), (16, 96)) * 0.3}
    mesh = pk.mesh.make_mesh(jax.devices()[:8], data=2, seq=4)
    axes = {"x": ("batch", "length", None), "y": ("batch", "length", None, None)}

    def train(strategy, accumulate=1):
        state, step = strategy.init(params, optax.sgd(0.5)), strategy.step(_attention_loss, accumulate=accumulate)
        with attention.method(method):
            for batch in batches:
                state, _ = step(state, batch)
        return state, step

    state, step = train(pk.SPMD(mesh, rules=SEQ_RULES, batch_axes=axes), accumulate)
    expected, _ = train(pk.SingleDevice())  # one step on the whole batch
    tree_allclose(state.params, expected.params)
    assert "collective-permute" in step.lower(state, batches[0]).compile().as_text()


def test_bad_input_gets_a_clear_error():
    q, k, v = _qkv(length=30, heads=6)
    mesh = _seq_mesh(4)
    with pytest.raises(ValueError, match="length 30 does not split over the 4 devices"):
        attention.context_parallel(q, k, v, mesh=mesh, method="ring")
    q, k, v = _qkv(length=32, heads=6)
    with pytest.raises(ValueError, match="2 x 4 chunks: 36 does not divide by 8"):
        attention.context_parallel(*_qkv(length=36, heads=4), mesh=mesh, method="ring_zigzag")
    with pytest.raises(ValueError, match=r"6 head\(s\) do not divide by its 4 devices"):
        attention.context_parallel(q, k, v, mesh=mesh, method="ulysses")
    with pytest.raises(ValueError, match=r"has axes \('data', 'seq'\), not 'sequence'"):
        attention.context_parallel(q, k, v, mesh=mesh, axis="sequence", method="ring")
    with pytest.raises(
        ValueError, match="Unknown attention method 'flash': use one of 'allgather', 'ring', 'ring_zigzag', 'ulysses'"
    ):
        attention.context_parallel(q, k, v, mesh=mesh, method="flash")
    with pytest.raises(ValueError, match="Unknown attention method 'flash'"):
        attention.method("flash")
    with pytest.raises(ValueError, match="one shape"):
        attention.dense(q, k[:, :16], v)


@pytest.mark.parametrize("method", attention.METHODS)
def test_each_device_holds_a_share_of_the_scores(method):
    """Compiler's scratch per device for one forward pass at length 512: dense holds the T x T scores (and
    their exponentials); split four ways, each device holds at most about a quarter of that."""
    q, k, v = _qkv(length=512, heads=4, batch=1)
    scores = 1 * 4 * 512 * 512 * 4  # batch x heads x T x T float32
    one = pk.inspect.memory_per_device(jax.jit(attention.dense), q, k, v).temp
    mesh = _seq_mesh(4)
    split = jax.jit(lambda q, k, v: attention.context_parallel(q, k, v, mesh=mesh, method=method))
    each = pk.inspect.memory_per_device(split, q, k, v).temp
    assert one >= scores
    assert each <= 1.1 * one / 4
    if not method.startswith("ring"):  # a device's queries against every key: a quarter of the scores
        assert each >= scores / 4
