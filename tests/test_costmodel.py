"""The cost model on cases computed by hand, its presets, and the 8-local-vs-16-distributed check."""

from __future__ import annotations

import pytest

from parallelkit import collectives as C
from parallelkit.measure.costmodel import (
    PATTERNS,
    PRESETS,
    Cluster,
    Link,
    Workload,
    allreduce_rounds,
    allreduce_seconds,
    alltoall_rounds,
    communication_seconds,
    fit_link,
    local_vs_distributed,
    predict,
    scaled,
)

FAST = Link("fast", GBps=100, latency_us=2, source="by hand")
SLOW = Link("slow", GBps=1, latency_us=20, source="by hand")
P = 64e6  # bytes


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_in_one_machine_is_the_textbook_formula(n):
    # 2(n-1)/n x P / B + 2(n-1) alpha
    expected = 2 * (n - 1) / n * P / 100e9 + 2 * (n - 1) * 2e-6
    assert allreduce_seconds(Cluster(1, n, FAST), P, "ring") == pytest.approx(expected)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "reduce_to_one"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_rounds_in_one_machine_agree_with_each_algorithms_cost(algorithm, n):
    # two derivations: the round-by-round simulation here, the closed form in pk.collectives
    formula = C.AllReduce(algorithm).cost(n, P)["inner"].seconds(FAST.alpha, FAST.beta)
    assert allreduce_seconds(Cluster(1, n, FAST), P, algorithm) == pytest.approx(formula)


def test_hierarchical_over_two_machines_by_hand():
    g, m = 4, 2
    inside = 2 * (g - 1) * (2e-6 + P / g / 100e9)  # reduce-scatter + all-gather in each machine
    # across: each of the g devices rings its P/g slice over m machines, P/(g m) a round; the g
    # rings share the machine's one network link, so g x P/(g m) = P/m crosses it per round
    across = 2 * (m - 1) * (20e-6 + P / m / 1e9)
    assert allreduce_seconds(Cluster(m, g, FAST, SLOW), P, "hierarchical") == pytest.approx(inside + across)
    assert across == pytest.approx(0.064040)


def test_flat_ring_over_machines_runs_at_the_network_hop():
    # 8 devices, 2 machines: every round one message leaves each machine, P/8 over the slow link
    n = 8
    expected = 2 * (n - 1) * (20e-6 + P / n / 1e9)
    assert allreduce_seconds(Cluster(2, 4, FAST, SLOW), P, "ring") == pytest.approx(expected)


def _bytes_across(rounds, g: int) -> tuple[float, float]:
    """(bytes leaving machine 0, bytes the busiest device sends to other machines) over all the rounds."""
    machine, device = 0.0, {}
    for messages in rounds:
        for source, target, nbytes in messages:
            if source // g != target // g:
                device[source] = device.get(source, 0.0) + nbytes
                machine += nbytes if source // g == 0 else 0.0
    return machine, max(device.values())


@pytest.mark.parametrize("m, g", [(2, 2), (2, 4), (2, 8), (4, 4), (8, 2), (16, 8)])
def test_hierarchical_saves_under_2x_on_a_shared_machine_link_and_about_g_on_a_link_per_device(m, g):
    n = m * g
    flat_machine, flat_device = _bytes_across(allreduce_rounds("ring", n, P), g)
    hier_machine, hier_device = _bytes_across(allreduce_rounds("hierarchical", n, P, group=g), g)
    # a machine's g devices share its link: 2(n-1)/n P against 2(m-1)/m P, under 2x, towards 1x as m grows
    assert flat_machine == pytest.approx(2 * (n - 1) / n * P)
    assert hier_machine == pytest.approx(2 * (m - 1) / m * P)
    shared = (n - 1) / (g * (m - 1))
    assert flat_machine / hier_machine == pytest.approx(shared) and 1 < shared < 2
    # a link per device: the flat ring's edge device sends 2(n-1)/n P, each device here 2(m-1)/m P/g
    assert flat_device / hier_device == pytest.approx((n - 1) / (m - 1)) and (n - 1) / (m - 1) >= g
    # the model's times, network-bound (no latency, a nearly free inside link): the shared-link ratio
    cluster = Cluster(m, g, Link("free", 1e9, 0, "by hand"), Link("network", 1, 0, "by hand"))
    ratio = allreduce_seconds(cluster, P, "ring") / allreduce_seconds(cluster, P, "hierarchical")
    assert ratio == pytest.approx(shared, rel=1e-6)


def test_hierarchical_beats_the_flat_ring_when_the_network_is_slow():
    cluster = Cluster(2, 8, PRESETS["nvlink2"], PRESETS["10gbe"])
    assert allreduce_seconds(cluster, P, "hierarchical") < allreduce_seconds(cluster, P, "ring")


def test_tree_crossing_machines_shares_the_network_link():
    # 4 devices on 2 machines; the first halving round pairs i with i^2: all 4 cross, 2 per machine
    rounds = allreduce_rounds("tree", 4, P)
    assert [(s, t) for s, t, _ in rounds[0]] == [(0, 2), (1, 3), (2, 0), (3, 1)]
    cluster = Cluster(2, 2, FAST, SLOW)
    assert cluster.round_seconds(rounds[0]) == pytest.approx(20e-6 + 2 * (P / 2) / 1e9)
    assert cluster.round_seconds(rounds[1]) == pytest.approx(2e-6 + (P / 4) / 100e9)  # partners 1 apart


def test_other_strategies_by_hand():
    work = Workload(param_bytes=P, seconds_per_sample=1e-3, batch_per_device=16)
    one = Cluster(1, 4, FAST)
    ring = allreduce_seconds(one, P)
    assert communication_seconds(work, one, "single") == 0
    assert communication_seconds(work, one, "fully_sharded") == pytest.approx(1.5 * ring)
    assert communication_seconds(work, one, "central_storage") == pytest.approx(2 * (2e-6 + P / 100e9))
    # 4 workers on 2 machines, 2 servers: each server sends P/2 to 4 workers = 2P; a worker machine takes 2P
    two = Cluster(2, 2, FAST, SLOW)
    assert communication_seconds(work, two, "parameter_server", shards=2) == pytest.approx(2 * (20e-6 + 2 * P / 1e9))
    with pytest.raises(ValueError, match="one machine"):
        communication_seconds(work, two, "central_storage")


def test_prediction_parts_and_efficiency():
    work = Workload(param_bytes=P, seconds_per_sample=1e-3, batch_per_device=16)
    single = predict(work, Cluster(1, 1, FAST), "mirrored")
    assert (single.communication_s, single.efficiency) == (0.0, 1.0)
    four = predict(work, Cluster(1, 4, FAST), "mirrored")
    comm = allreduce_seconds(Cluster(1, 4, FAST), P)
    assert four.step_s == pytest.approx(16e-3 + comm)
    assert four.samples_per_s == pytest.approx(64 / (16e-3 + comm))
    assert four.efficiency == pytest.approx(16e-3 / (16e-3 + comm))
    hidden = predict(Workload(P, 1e-3, 16, overlap=0.5), Cluster(2, 4, FAST, SLOW), "mirrored")
    exposed = allreduce_seconds(Cluster(2, 4, FAST, SLOW), P) - 0.5 * 16e-3
    assert hidden.communication_s == pytest.approx(exposed)


def test_local_vs_distributed_finds_the_fewest_matching_devices():
    work = Workload(param_bytes=100e6, seconds_per_sample=1 / 330, batch_per_device=32)
    result = local_vs_distributed(work, PRESETS["pcie3"], PRESETS["10gbe"])
    assert result.local.devices == 8 and result.distributed.devices == 16
    assert result.holds == (result.distributed.samples_per_s < result.local.samples_per_s)
    n = result.devices_to_match
    assert n is not None and n > 16  # the seed's claim, under these assumptions
    beyond = local_vs_distributed(work, PRESETS["pcie3"], PRESETS["10gbe"], distributed=n)
    short = local_vs_distributed(work, PRESETS["pcie3"], PRESETS["10gbe"], distributed=n - 1)
    assert beyond.distributed.samples_per_s >= result.local.samples_per_s > short.distributed.samples_per_s
    today = local_vs_distributed(work, PRESETS["nvlink4"], PRESETS["ib-ndr"])
    assert not today.holds and today.devices_to_match <= 16


def test_presets_name_a_source_and_scale():
    for link in PRESETS.values():
        assert link.source and link.GBps > 0
    assert PRESETS["pcie4"].GBps == 2 * PRESETS["pcie3"].GBps
    assert scaled(PRESETS["ib-ndr"], 8).GBps == 400


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match="network link"):
        Cluster(2, 4, FAST)
    with pytest.raises(ValueError, match="bandwidth"):
        Link("x", 0, 1, "")
    with pytest.raises(ValueError, match="overlap"):
        Workload(P, 1e-3, 8, overlap=2)
    with pytest.raises(ValueError, match="choose one of"):
        communication_seconds(Workload(P, 1e-3, 8), Cluster(1, 2, FAST), "mirrord")
    with pytest.raises(ValueError, match="power-of-two"):
        allreduce_rounds("tree", 6, P)
    with pytest.raises(ValueError, match="fill machines"):
        local_vs_distributed(Workload(P, 1e-3, 8), FAST, SLOW, per_machine=3)
    assert "mirrored" in PATTERNS


# Model-parallel entries: tensor, hybrid and pipeline, worked by hand.

ONE_GB = Link("1 GB/s", GBps=1, latency_us=0, source="by hand")


def test_tensor_parallel_all_reduces_each_activation_over_its_group():
    # 4 devices, 16 samples each: the group takes 64; each all-reduce is a ring of 64 x b bytes
    work = Workload(0, 1e-3, 16, activation_allreduces=(100.0, 40.0))
    rings = [2 * 3 * (2e-6 + 64 * b / 4 / 100e9) for b in (100.0, 40.0)]
    p = predict(work, Cluster(1, 4, FAST), "tensor")
    assert p.communication_s == pytest.approx(sum(rings))
    assert p.compute_s == pytest.approx(16e-3)  # a quarter of the group's 64 samples' work
    assert p.efficiency == pytest.approx(16e-3 / (16e-3 + sum(rings)))


def test_tensor_parallel_megatron_bytes_for_the_kits_mlp():
    from parallelkit.strategies.tensor import megatron_mlp_allreduces

    # 784-1024-1024-10: one block; forward all-reduce B x 1024 floats, no backward one (the data's gradient)
    per_sample = tuple(4.0 * e for e in megatron_mlp_allreduces(1, [784, 1024, 1024, 10]))
    assert per_sample == (4096.0,)
    work = Workload(0, 1e-4, 32, activation_allreduces=per_sample)
    expected = 2 * (2 - 1) * 64 * 4096 / 2 / 1e9  # ring over 2 of 64 samples x 4 kB
    assert communication_seconds(work, Cluster(1, 2, ONE_GB), "tensor") == pytest.approx(expected)


def test_overlap_never_hides_activation_all_reduces():
    work = Workload(0, 1e-3, 16, overlap=1.0, activation_allreduces=(100.0,))
    assert predict(work, Cluster(1, 4, FAST), "tensor").communication_s > 0


def test_hybrid_adds_the_gradient_slices_over_the_data_groups():
    # 2 machines x 2 devices, model groups of 2 inside a machine, data groups across
    work = Workload(P, 1e-3, 16, activation_allreduces=(100.0,))
    cluster = Cluster(2, 2, FAST, SLOW)
    activations = 2 * 1 * (2e-6 + 32 * 100.0 / 2 / 100e9)  # inside each machine, 32 samples a group
    # two rings (one per model position) of P/2 across the machines; both leave each machine at once
    gradients = 2 * 1 * (20e-6 + 2 * (P / 2 / 2) / 1e9)
    p = predict(work, cluster, "hybrid", model=2)
    assert p.communication_s == pytest.approx(activations + gradients)
    assert communication_seconds(work, cluster, "hybrid", model=2) == pytest.approx(activations + gradients)


def test_a_hybrid_group_across_machines_pays_the_network_for_activations():
    work = Workload(0, 1e-3, 16, activation_allreduces=(100.0,))
    inside = predict(work, Cluster(2, 2, FAST, SLOW), "hybrid", model=2)
    split = predict(work, Cluster(2, 2, FAST, SLOW), "tensor")  # one group of 4 over both machines
    # ring 0-1-2-3: in each of its 6 rounds one message of 64 x 100 / 4 bytes leaves each machine
    assert split.communication_s == pytest.approx(6 * (20e-6 + 1600 / 1e9))
    # hybrid: the activation ring stays inside (2 rounds on FAST); only the (empty) gradients cross
    assert inside.communication_s == pytest.approx(2 * (2e-6 + 1600 / 100e9) + 2 * 20e-6)


@pytest.mark.parametrize("stages, microbatches", [(2, 1), (4, 4), (4, 16), (8, 8)])
def test_pipeline_bubble_is_the_textbook_share(stages, microbatches):
    work = Workload(0, 1e-3, 8, boundary_bytes=1.0)
    p = predict(work, Cluster(1, stages, FAST), "pipeline", microbatches=microbatches)
    pipeline_time = p.compute_s + p.idle_s
    assert p.idle_s / pipeline_time == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_pipeline_sends_one_microbatch_per_slot_to_the_next_stage():
    # 2 stages x 2 data: 4 devices, 8 samples each; a microbatch is 32/4 = 8 samples, 4 per device
    work = Workload(P, 1e-3, 8, boundary_bytes=1000.0)
    cluster = Cluster(1, 4, ONE_GB)
    sends = 2 * (4 + 2 - 1) * (16 * 1000.0 / 4 / 1e9)  # each device: its stage's 16 samples / m
    gradients = 2 * 1 * (P / 2 / 2 / 1e9)  # each stage's P/2 over its 2 data devices
    p = predict(work, cluster, "pipeline", model=2, microbatches=4)
    assert p.communication_s == pytest.approx(sends + gradients)


def test_model_parallel_arguments_are_checked():
    work = Workload(P, 1e-3, 8)
    cluster = Cluster(1, 4, FAST)
    with pytest.raises(ValueError, match="activation_allreduces"):
        predict(work, cluster, "tensor")
    with pytest.raises(ValueError, match="boundary_bytes"):
        predict(work, cluster, "pipeline")
    with pytest.raises(ValueError, match="hybrid needs model"):
        predict(work, cluster, "hybrid")
    with pytest.raises(ValueError, match="divides"):
        predict(work, cluster, "pipeline", model=3)
    with pytest.raises(ValueError, match="does not split the model"):
        predict(work, cluster, "mirrored", model=2)
    with pytest.raises(ValueError, match="microbatches"):
        predict(work, cluster, "pipeline", model=2, microbatches=0)
    with pytest.raises(ValueError, match="byte counts"):
        Workload(P, 1e-3, 8, boundary_bytes=-1.0)


def test_fit_link_recovers_a_link_from_noisy_times():
    true = Link("true", GBps=0.5, latency_us=80.0, source="by hand")
    sizes = [4e3, 64e3, 1e6, 4e6, 16e6]
    times = [allreduce_seconds(Cluster(1, 2, true), s) for s in sizes]
    noisy = [t * f for t, f in zip(times, [1.02, 0.98, 1.01, 0.99, 1.0], strict=True)]
    fit = fit_link(2, sizes, noisy)
    assert fit.GBps == pytest.approx(0.5, rel=0.02)
    assert fit.latency_us == pytest.approx(80.0, rel=0.1)
    assert "2 devices" in fit.source


def test_fit_link_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two different sizes"):
        fit_link(4, [1e3, 1e3], [1e-3, 2e-3])
    with pytest.raises(ValueError, match="do not grow"):
        fit_link(4, [1e3, 1e6], [2e-3, 1e-3])
    with pytest.raises(ValueError, match="2 or more devices"):
        fit_link(1, [1e3, 1e6], [1e-3, 2e-3])


# Compute from FLOPs: a peak FLOP/s (measured or published) and the share of it a step reaches.


def test_compute_from_flops_by_hand():
    # 2 GFLOPs a sample x 32 samples at 40% of 100 TFLOP/s: 64e9 / 40e12 = 1.6 ms
    work = Workload(P, batch_per_device=32, flops_per_sample=2e9, peak_flops=100e12, efficiency=0.4)
    assert work.sample_seconds == pytest.approx(2e9 / 40e12) and work.compute_s == pytest.approx(1.6e-3)
    four = predict(work, Cluster(1, 4, FAST), "mirrored")
    assert four.compute_s == pytest.approx(1.6e-3)
    assert four.step_s == pytest.approx(1.6e-3 + allreduce_seconds(Cluster(1, 4, FAST), P))


def test_flops_and_seconds_per_sample_give_the_same_prediction():
    by_flops = Workload(P, batch_per_device=16, flops_per_sample=1e9, peak_flops=1e12)  # 1 ms a sample
    by_time = Workload(P, 1e-3, 16)
    cluster = Cluster(2, 4, FAST, SLOW)
    assert predict(by_flops, cluster, "mirrored") == predict(by_time, cluster, "mirrored")


def test_seconds_per_sample_overrides_the_flops():
    work = Workload(P, 2e-3, 8, flops_per_sample=1e9, peak_flops=1e12)  # the FLOPs alone would give 1 ms a sample
    assert work.sample_seconds == 2e-3 and predict(work, Cluster(1, 1, FAST), "single").step_s == pytest.approx(16e-3)


def test_workload_without_its_compute_or_batch_is_explained():
    with pytest.raises(ValueError, match="flops_per_sample and peak_flops"):
        Workload(P, batch_per_device=8, flops_per_sample=1e9)
    with pytest.raises(ValueError, match="batch_per_device=0"):
        Workload(P, 1e-3)
    with pytest.raises(ValueError, match="efficiency=0"):
        Workload(P, batch_per_device=8, flops_per_sample=1e9, peak_flops=1e12, efficiency=0)
    with pytest.raises(ValueError, match="a peak > 0"):
        Workload(P, batch_per_device=8, flops_per_sample=1e9, peak_flops=0.0)


def test_expert_parallel_by_hand():
    # 4 devices in expert groups of 2 ([0, 1], [2, 3]), 2 samples each, 1 GB/s, no latency
    work = Workload(8e3, 1e-3, 2, all_to_alls=(1e3,) * 4, expert_bytes=4e3)
    cluster = Cluster(1, 4, ONE_GB)
    dense = 2 * 3 * (4e3 / 4 / 1e9)  # the 4 kB that are not experts: a ring over all 4 devices
    experts = 2 * 1 * (4e3 / 2 / 2 / 1e9)  # each device's 2 kB of experts: a ring over its data group of 2
    exchanges = 4 * 1 * (2 * 1e3 / 2 / 1e9)  # 4 all-to-alls of 2 kB a device: 1 round of 1 kB to the other
    p = predict(work, cluster, "expert", model=2)
    assert p.communication_s == pytest.approx(dense + experts + exchanges)
    # one group of all 4: each device holds experts no other does (nothing to all-reduce), and each
    # all-to-all takes 3 rounds of 2 kB / 4
    everyone = predict(work, cluster, "expert")
    assert everyone.communication_s == pytest.approx(dense + 4 * 3 * (2 * 1e3 / 4 / 1e9))


def test_alltoall_rounds_send_all_but_each_devices_own_share():
    rounds = alltoall_rounds([[0, 1, 2, 3]], 400.0)
    assert len(rounds) == 3
    for device in range(4):
        assert sum(b for r in rounds for s, _, b in r if s == device) == 300.0  # (n-1)/n of 400 B
        assert {t for r in rounds for s, t, _ in r if s == device} == {0, 1, 2, 3} - {device}


def test_expert_parallel_arguments_are_checked():
    with pytest.raises(ValueError, match="all_to_alls"):
        predict(Workload(P, 1e-3, 8), Cluster(1, 4, FAST), "expert")
    with pytest.raises(ValueError, match="expert_bytes"):
        Workload(P, 1e-3, 8, expert_bytes=2 * P)
    with pytest.raises(ValueError, match="byte counts"):
        Workload(P, 1e-3, 8, all_to_alls=(-1.0,))
    with pytest.raises(ValueError, match="divides"):
        predict(Workload(P, 1e-3, 8, all_to_alls=(1.0,)), Cluster(1, 4, FAST), "expert", model=3)
