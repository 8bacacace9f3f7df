"""The circular pipeline in one program (``pk.pipeline.circular_pipeline``): equal to one device, its collectives.

The model: a Dense layer in, ``stages x virtual`` repeats of a Dense + ReLU block through the
pipeline, a Dense head; trained three SGD steps inside one ``jax.jit`` against the same model
with the blocks applied in turn on one device (float32: rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tree_allclose
from jax.sharding import Mesh

import parallelkit as pk
from parallelkit.strategies.pipeline import schedules
from parallelkit.strategies.pipeline.circular import bubble_fraction, circular_pipeline, sequential

WIDTH = 32


def dense(key, fan_in, fan_out):
    return {"kernel": jax.random.normal(key, (fan_in, fan_out)) / np.sqrt(fan_in), "bias": jnp.zeros(fan_out)}


def block(params, h):
    return jax.nn.relu(h @ params["kernel"] + params["bias"])


def model(repeats: int) -> dict:
    pre, blocks, head = jax.random.split(jax.random.key(0), 3)
    stacked = [dense(k, WIDTH, WIDTH) for k in jax.random.split(blocks, repeats)]
    return {"pre": dense(pre, 64, WIDTH), "blocks": jax.tree.map(lambda *a: jnp.stack(a), *stacked),
            "head": dense(head, WIDTH, 10)}  # fmt: skip


def loss_with(run):
    def loss(params, batch):
        h = jax.nn.relu(batch["x"].reshape(len(batch["x"]), -1) @ params["pre"]["kernel"] + params["pre"]["bias"])
        logits = run(params["blocks"], h) @ params["head"]["kernel"] + params["head"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss


def train(run, params, batches):
    tx = optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        updates, opt_state = tx.update(jax.grad(loss_with(run))(params, batch), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for batch in batches:
        params, opt_state = step(params, opt_state, batch)
    return params, step.lower(params, opt_state, batches[0]).compile().as_text()


@pytest.mark.parametrize(
    ("stages", "virtual", "microbatches", "data"),
    [(2, 1, 2, 1), (2, 2, 4, 1), (4, 1, 4, 1), (4, 2, 4, 1), (2, 2, 4, 2), (4, 1, 4, 2)],
)
def test_the_circular_pipeline_trains_as_one_device(stages, virtual, microbatches, data, digits):
    params, batches = model(stages * virtual), list(pk.data.batches(digits, 32, steps=3))
    mesh = Mesh(np.array(jax.devices()[: stages * data]).reshape(data, stages), ("data", "stage"))

    def piped(stacked, h):
        return circular_pipeline(block, stacked, h, mesh=mesh, microbatches=microbatches, data_axis="data")

    trained, hlo = train(piped, params, batches)
    expected, _ = train(lambda stacked, h: sequential(block, stacked, h), params, batches)
    tree_allclose(trained, expected)
    # one program: the hand-over is one permute in the loop's body, and one in its derivative's
    assert hlo.count("collective-permute(") == 2 and " while(" in hlo


def test_its_bubble_is_the_interleaved_schedules():
    for stages, microbatches, virtual in [(2, 4, 2), (4, 8, 2), (4, 4, 1), (3, 6, 3)]:
        planned = schedules.bubble_fraction(schedules.interleaved_schedule(stages, microbatches, virtual))
        assert bubble_fraction(stages, microbatches, virtual) == pytest.approx(planned)


def test_it_refuses_repeats_that_do_not_fill_the_stages_and_too_few_microbatches():
    mesh = Mesh(np.array(jax.devices()[:2]), ("stage",))
    x = jnp.ones((4, 3))
    with pytest.raises(ValueError, match="multiple of the 2 stages"):
        circular_pipeline(lambda w, h: h @ w, jnp.ones((3, 3, 3)), x, mesh=mesh, microbatches=2)
    with pytest.raises(ValueError, match="at least 2 microbatches"):
        circular_pipeline(lambda w, h: h @ w, jnp.ones((2, 3, 3)), x, mesh=mesh, microbatches=1)
