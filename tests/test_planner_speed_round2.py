"""The planner's caches change no answer: each ranked layout's memory and step time are the uncached functions',
and a plan made with cold caches ranks as one made with warm ones."""

from __future__ import annotations

import pytest

from parallelkit.planner import MODELS, Cluster, kernels, memory_per_device, plan, search, step_time

CASES = [
    ("llama3-8b", "A100 SXM 80GB", 8, 4, 2**21, {}),
    ("gpt2-xl", "H100 SXM", 8, 2, 2**20, {"precision": "fp8", "overlap": ("gradients", "tensor")}),
]


def _ranking(answer) -> list[tuple[str, float, float]]:
    return [(c.layout.name, c.mfu, c.memory.total) for c in answer.ranked]


@pytest.mark.parametrize(("name", "chip", "per_node", "nodes", "tokens", "options"), CASES)
def test_cached_answers_are_the_uncached_functions(name, chip, per_node, nodes, tokens, options):
    model, cluster = MODELS[name], Cluster.published(chip, per_node=per_node, nodes=nodes)
    search.clear_caches()
    assert search._memory.cache_info().currsize == 0 and kernels._passes.cache_info().currsize == 0
    cold = plan(model, cluster, global_batch_tokens=tokens, **options)
    warm = plan(model, cluster, global_batch_tokens=tokens, **options)
    assert _ranking(cold) == _ranking(warm) and len(cold.ranked) > 10
    precision = options.get("precision", "bf16")
    for c in cold.ranked[:10]:
        assert c.memory == memory_per_device(model, c.layout, c.batch, precision=precision)
        timed = step_time(model, c.layout, cluster, c.batch, precision=precision,
                          overlap=options.get("overlap", "none"))  # fmt: skip
        assert c.time == timed
