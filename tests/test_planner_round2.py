"""The planner, round 2: a search that answers fast for any cluster and batch, and keeps the first choices."""

from __future__ import annotations

import pytest

from parallelkit.measure.costmodel.links import axis_groups, shifted_round
from parallelkit.planner import MODELS, Cluster, Transformer, plan

H100 = Cluster.published("H100 SXM", per_node=8)
SMALL = Transformer(8, 1024, 16, 4096, 32000, 2048, kv_heads=4, dropout=False, name="small")
MOE = Transformer(4, 512, 8, 1024, 32000, 1024, experts=8, top_k=2, dropout=False, name="moe")


def every_message(cluster: Cluster, size: int, stride: int, shift: int) -> tuple[bool, int]:
    """:func:`shifted_round`'s answer by sending every message of every group, one by one."""
    inside, leaving, entering = False, {}, {}
    for group in axis_groups(cluster.devices, size, stride):
        for j, source in enumerate(group):
            a, b = cluster.machine(source), cluster.machine(group[(j + shift) % size])
            inside |= a == b
            if a != b:
                leaving[a], entering[b] = leaving.get(a, 0) + 1, entering.get(b, 0) + 1
    return inside, max([*leaving.values(), *entering.values()], default=0)


@pytest.mark.parametrize(("per_node", "nodes"), [(8, 12), (4, 6), (6, 4), (3, 10)])
def test_one_period_of_the_devices_counts_as_all_of_them(per_node, nodes):
    cluster = Cluster.published("H100 SXM", per_node=per_node, nodes=nodes)
    n = cluster.devices
    axes = [
        (size, stride) for size in range(2, n + 1) for stride in range(1, n // size + 1) if n % (size * stride) == 0
    ]
    for size, stride in axes:
        for shift in range(1, size):
            assert shifted_round(cluster, size, stride, shift) == every_message(cluster, size, stride, shift)


@pytest.mark.parametrize(
    ("model", "cluster", "tokens", "overlap"),
    [
        (SMALL, H100, 64 * 2048, "none"),
        (SMALL, Cluster.published("H100 SXM", per_node=8, nodes=2), 32 * 2048, "full"),
        (SMALL, Cluster.published("A100 SXM 80GB", per_node=4, nodes=4), 128 * 2048, "none"),
        (MOE, H100, 64 * 1024, "none"),
        (MODELS["gpt2-xl"], Cluster.published("H100 SXM", per_node=8, nodes=2), 2**20, "none"),
    ],
)
def test_the_pruned_search_ranks_first_what_the_whole_search_does(model, cluster, tokens, overlap):
    whole = plan(model, cluster, global_batch_tokens=tokens, overlap=overlap, exhaustive=True)
    pruned = plan(model, cluster, global_batch_tokens=tokens, overlap=overlap)
    assert whole.unweighed == 0 and pruned.unweighed > 0  # it left some: the comparison says something
    assert pruned.best == whole.best
    assert [c.layout for c in pruned.ranked[:10]] == [c.layout for c in whole.ranked[:10]]
    assert [c.mfu for c in pruned.ranked[:10]] == [c.mfu for c in whole.ranked[:10]]
    assert f"{pruned.unweighed} could not reach the first 10, not weighed" in pruned.table(1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tokens", [10**15, 10**15 + 8192 * 7919])  # the second's sequences have a large prime
def test_a_huge_batch_on_a_thousand_devices_answers(tokens):
    cluster = Cluster.published("H100 SXM", per_node=8, nodes=128)
    answer = plan(MODELS["llama3-70b"], cluster, global_batch_tokens=tokens)
    assert answer.batch == round(tokens / 8192) and answer.ranked[0].fits


@pytest.mark.timeout(120)
def test_a_hundred_thousand_devices_answer():
    cluster = Cluster.published("H100 SXM", per_node=8, nodes=12_500)
    answer = plan(MODELS["llama3-70b"], cluster, global_batch_tokens=2**26)
    assert answer.best.devices == 100_000 and answer.unweighed > 0


def test_exhaustive_that_is_not_a_bool_names_the_argument():
    with pytest.raises(ValueError, match=r"plan\(exhaustive='yes'\) is not a bool: give True to weigh every"):
        plan(SMALL, H100, global_batch_tokens=2**16, exhaustive="yes")
