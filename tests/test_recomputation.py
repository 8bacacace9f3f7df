"""A layout's recomputation, pk.models.recomputation: the same gradients, fewer arrays kept, more work compiled.

Each test opens the block inside the loss, as a strategy opens it while it traces its step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import tree_allclose
from jax.ad_checkpoint import checkpoint_name

import parallelkit as pk
from parallelkit.measure import aot
from parallelkit.models.recompute import RECOMPUTE, active_recomputation, recomputation
from parallelkit.strategies.pipeline import sequential_loss

VOCAB, LENGTH, DIM, HEADS, MLP, DEPTH = 64, 32, 32, 4, 96, 2
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(4, LENGTH + 1))
BATCH = {"x": jnp.asarray(TOKENS[:, :-1], jnp.int32), "y": jnp.asarray(TOKENS[:, 1:], jnp.int32)}
SCORES = (BATCH["x"].shape[0], HEADS, LENGTH, LENGTH)  # attention's scores and probabilities: batch x heads x q x k


def gpt(experts: int = 0, **overrides) -> pk.models.GPT:
    """A small GPT, dense or with ``experts`` routed in 2 groups; dropout 0.1 on unless overridden."""
    config = dict(max_length=LENGTH, dim=DIM, heads=HEADS, depth=DEPTH, mlp_dim=MLP, dropout=0.1)
    routing = dict(experts=experts, groups=2) if experts else {}
    return pk.models.GPT(VOCAB, **(config | routing | overrides), rngs=nnx.Rngs(0))


def recomputed(loss_fn, name: str | None):
    """``loss_fn`` traced inside ``recomputation(name)`` (as it was, for None)."""
    if name is None:
        return loss_fn

    def loss(params, batch, **extras):
        with recomputation(name):
            return loss_fn(params, batch, **extras)

    return loss


def kept_shapes(loss_fn, params, batch, **extras) -> list[tuple[int, ...]]:
    """The shapes of the arrays the forward pass keeps for the backward pass (``jax.vjp``'s residuals)."""
    _, backward = jax.vjp(lambda p: loss_fn(p, batch, **extras)[0], params)
    return [tuple(r.shape) for r in jax.tree.leaves(backward)]


def value_and_grads(loss_fn, params, **extras):
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(p, BATCH, **extras), has_aux=True))(params)


# -- the same numbers ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECOMPUTE)
@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_the_gpt_gives_the_gradients_it_gives_without_recomputation(experts, name):
    """Loss, metrics (the MoE router's too) and every gradient, dropout on: the recomputed masks are the same."""
    apply, params = pk.models.functional(gpt(experts))
    loss_fn = pk.models.lm_loss(apply)
    extras = {"rng": jax.random.key(1)}
    expected = value_and_grads(loss_fn, params, **extras)
    tree_allclose(value_and_grads(recomputed(loss_fn, name), params, **extras), expected)


@pytest.mark.parametrize("name", RECOMPUTE)
def test_the_classifier_transformer_gives_the_gradients_it_gives_without_recomputation(name):
    """Dropout on the attention weights as well: recomputed under 'selective' from the same key."""
    model = pk.models.Transformer((8, 8, 1), 10, dim=DIM, heads=HEADS, depth=DEPTH, mlp_dim=MLP, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    loss_fn = pk.models.classifier_loss(apply)
    batch = {"x": jnp.asarray(np.random.default_rng(1).normal(size=(4, 8, 8, 1)), jnp.float32), "y": jnp.arange(4)}
    extras = {"rng": jax.random.key(2)}
    grads = jax.jit(jax.grad(lambda p, f: f(p, batch, **extras)[0], argnums=0), static_argnums=1)
    tree_allclose(grads(params, recomputed(loss_fn, name)), grads(params, loss_fn))


def test_the_gpt_as_layers_recomputes_its_blocks():
    """:meth:`GPT.as_layers`' blocks read the recomputation when traced: same gradients, fewer arrays kept."""
    layers, params = gpt(dropout=0.0).as_layers()
    loss_fn = sequential_loss(layers, lambda logits, batch: pk.models.cross_entropy(logits, batch)[0])
    expected = jax.jit(jax.grad(loss_fn))(params, BATCH)
    full = recomputed(lambda p, b: (loss_fn(p, b),), "full")
    tree_allclose(jax.jit(jax.grad(lambda p, b: full(p, b)[0]))(params, BATCH), expected)
    kept = kept_shapes(full, params, BATCH)
    assert (BATCH["x"].shape[0], LENGTH, MLP) not in kept  # no MLP hidden units: each block keeps its input
    assert (BATCH["x"].shape[0], LENGTH, MLP) in kept_shapes(lambda p, b: (loss_fn(p, b),), params, BATCH)


def assert_recomputes(step, state) -> None:
    """``step``'s program recomputes: ``jax.checkpoint`` fences what the backward pass computes again with
    optimization barriers (a step without recomputation has none)."""
    assert "optimization_barrier" in step.lower(state, BATCH).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["selective", "full"])
def test_expert_parallel_trains_the_recomputed_moe_gpt_as_one_device(name):
    """The MoE layer's all-to-alls (``jax.shard_map`` inside the block) are traced under ``jax.checkpoint``."""
    apply, params = pk.models.functional(gpt(4, dropout=0.0))
    loss_fn = pk.models.lm_loss(apply)
    batches = [BATCH, {"x": BATCH["y"], "y": BATCH["x"]}]
    reference = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches)
    strategy = pk.ExpertParallel(expert=2, devices=jax.devices()[:2])
    split = pk.fit(strategy, recomputed(loss_fn, name), params, optax.sgd(0.1), batches)
    tree_allclose(split.params, reference.params)
    assert_recomputes(strategy.step(recomputed(loss_fn, name)), split.state)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_context_parallel_attention_recomputes_its_scores_as_one_device(method):
    """'selective' inside ``jax.shard_map`` (and the ring's ``lax.cond``): the same parameters after two steps."""
    apply, params = pk.models.functional(gpt(dropout=0.0))
    loss_fn = pk.models.lm_loss(apply)
    batches = [BATCH, {"x": BATCH["y"], "y": BATCH["x"]}]
    reference = pk.fit(pk.SingleDevice(), loss_fn, params, optax.sgd(0.1), batches)
    strategy = pk.ContextParallel(seq=2, method=method, devices=jax.devices()[:2])
    split = pk.fit(strategy, recomputed(loss_fn, "selective"), params, optax.sgd(0.1), batches)
    tree_allclose(split.params, reference.params)
    assert_recomputes(strategy.step(recomputed(loss_fn, "selective")), split.state)


# -- fewer arrays kept --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_what_the_forward_pass_keeps_for_the_backward_pass(experts):
    """Read from ``jax.vjp``'s residuals, before any compiler: 'selective' keeps no ``batch x heads x length x
    length`` array but still the queries, keys and values; 'full' keeps neither, nor the MLP's hidden units."""
    apply, params = pk.models.functional(gpt(experts))
    loss_fn = pk.models.lm_loss(apply)
    kept = {name: kept_shapes(recomputed(loss_fn, name), params, BATCH, rng=jax.random.key(1)) for name in RECOMPUTE}
    heads = (BATCH["x"].shape[0], LENGTH, HEADS, DIM // HEADS)
    assert kept["none"].count(SCORES) >= DEPTH  # at least the probabilities of every block
    assert SCORES not in kept["selective"] and heads in kept["selective"]
    assert SCORES not in kept["full"] and heads not in kept["full"]
    if not experts:
        assert (BATCH["x"].shape[0], LENGTH, MLP) in kept["selective"]
        assert (BATCH["x"].shape[0], LENGTH, MLP) not in kept["full"]
    assert len(kept["full"]) < len(kept["selective"]) < len(kept["none"])


def test_the_classifier_transformer_keeps_no_scores_under_selective():
    model = pk.models.Transformer((LENGTH, 2), 10, dim=DIM, heads=HEADS, depth=DEPTH, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    loss_fn = pk.models.classifier_loss(apply)
    batch = {"x": jnp.ones((4, LENGTH, 2)), "y": jnp.arange(4)}
    assert SCORES in kept_shapes(loss_fn, params, batch, rng=jax.random.key(0))
    assert SCORES not in kept_shapes(recomputed(loss_fn, "selective"), params, batch, rng=jax.random.key(0))


def test_a_policy_that_refuses_only_the_named_scores_keeps_them_all_the_same():
    """Why 'selective' wraps the scores' arithmetic in ``jax.checkpoint`` rather than naming the scores: a block
    policy that saves everything but values named by ``checkpoint_name`` still keeps the arrays the names were
    applied to (the ``exp`` before its name), so the scores stay. (JAX's own ``save_anything_except_these_names``
    saves everything.)"""
    from jax._src.ad_checkpoint import name_p

    def everything_but_scores(prim, *_, **params) -> bool:
        return not (prim is name_p and params["name"] in ("scores", "probabilities"))

    def attention(q, k):
        s = checkpoint_name(jnp.einsum("bqhd,bkhd->bhqk", q, k), "scores")
        p = checkpoint_name(jnp.exp(s - s.max(axis=-1, keepdims=True)), "probabilities")
        return (p / p.sum(axis=-1, keepdims=True)).sum()

    q = jnp.ones((2, LENGTH, HEADS, 8))
    block = jax.checkpoint(attention, policy=everything_but_scores)
    _, backward = jax.vjp(block, q, q)
    assert SCORES[1:] in [tuple(r.shape)[1:] for r in jax.tree.leaves(backward)]


# -- more work and less memory in the compiled program ----------------------------------------------------------


def gpt_program_flops(name: str) -> float:
    apply, params = pk.models.functional(gpt(dropout=0.0))
    loss_fn = recomputed(pk.models.lm_loss(apply), name)
    step = jax.jit(jax.grad(lambda p, b: loss_fn(p, b)[0]))
    return step.lower(params, BATCH).compile().cost_analysis()["flops"]


def recomputed_products(tokens: int, length: int) -> int:
    """FLOPs of the products a block's backward pass needs again, over the blocks: the queries, keys and values,
    the scores, attention over the values and the MLP's first layer (not the two output projections)."""
    return DEPTH * 2 * (tokens * DIM * (3 * DIM + MLP) + 2 * tokens * length * DIM)


def test_full_recomputation_adds_the_blocks_products_to_the_cpu_program():
    """XLA's CPU backend keeps full recomputation: at least the products of :func:`recomputed_products`.

    Measured with JAX 0.10.2: 0.02247 GFLOP without recomputation, 0.02254 selective, 0.02773 full. The CPU
    program drops the selective recomputation's product (51 products compiled, as without; 65 under 'full'),
    and its temporaries do not fall: 1.02 MB under each name for this GPT; 27.5 MB without, 30.5 selective and
    30.6 full on sequences of 256 tokens. So only full recomputation's FLOPs are asserted here.
    """
    added = gpt_program_flops("full") - gpt_program_flops("none")
    assert added >= recomputed_products(BATCH["x"].size, LENGTH)


needs_libtpu = pytest.mark.skipif(not aot.available(), reason='libtpu is not installed: pip install "parallelkit[tpu]"')


@needs_libtpu
@pytest.mark.slow
def test_the_tpu_program_recomputes_more_and_holds_less_from_none_to_selective_to_full():
    """A GPT of depth 2 on sequences of 128 tokens, 2 a device, compiled for 4 TPU v5e chips (Mirrored).

    The FLOPs rise by at least the scores' product ``q k^T`` under 'selective' and by the blocks' recomputed
    products (:func:`recomputed_products`) under 'full'; the peak memory falls. libtpu 0.0.42 reports the
    temporaries as 0, so it is the peak that shows it. Measured with JAX 0.10.2 and libtpu 0.0.42: 0.0700,
    0.0750 and 0.0877 GFLOP a device; peaks of 2.92, 2.25 and 2.10 MB.
    """
    length, batch, per_device = 128, 8, 2
    model = gpt(dropout=0.0, max_length=length)
    apply, params = pk.models.functional(model)
    tokens = jnp.zeros((batch, length), jnp.int32)
    target = pk.aot.devices("v5e:2x2")
    programs = {
        name: pk.aot.compile(
            pk.Mirrored(target), recomputed(pk.models.lm_loss(apply), name), params, optax.sgd(0.1),
            {"x": tokens, "y": tokens},
        )
        for name in RECOMPUTE
    }  # fmt: skip
    scores = DEPTH * 2 * per_device * length * length * DIM  # q k^T, all heads, on one device
    flops = {name: program.flops for name, program in programs.items()}
    assert flops["selective"] - flops["none"] >= scores
    assert flops["full"] - flops["none"] >= recomputed_products(per_device * length, length)
    assert flops["full"] > flops["selective"]
    peak = {name: program.memory.peak for name, program in programs.items()}
    assert peak["none"] > peak["selective"] > peak["full"]


# -- the block and its errors -------------------------------------------------------------------------------------


def test_the_active_recomputation_is_none_outside_and_restored_after_a_block():
    assert active_recomputation() == "none"
    with recomputation("full"):
        with recomputation("selective"):
            assert active_recomputation() == "selective"
        assert active_recomputation() == "full"
    assert active_recomputation() == "none"
    with pytest.raises(RuntimeError, match="inside"), recomputation("full"):
        raise RuntimeError("inside")
    assert active_recomputation() == "none"


def test_an_unknown_recomputation_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown recomputation 'some'.*'none', 'selective', 'full'"):
        recomputation("some")
    with pytest.raises(ValueError, match="Unknown recomputation 'nothing_saveable'"):
        pk.models.block_policy("nothing_saveable")


def test_a_transformer_with_its_own_remat_refuses_the_layouts_recomputation():
    model = pk.models.Transformer((8, 8, 1), 10, remat=True, rngs=nnx.Rngs(0))
    apply, params = pk.models.functional(model)
    loss_fn = recomputed(pk.models.classifier_loss(apply), "selective")
    with pytest.raises(ValueError, match=r"Transformer\(remat='nothing_saveable'\) and recomputation 'selective'"):
        loss_fn(params, {"x": jnp.ones((2, 8, 8, 1)), "y": jnp.arange(2)})
