"""Bytes per step, measured, equal the textbook formulas for the MLP on 8 (and 2) simulated devices.

Every strategy reports its own traffic (``strategy.traffic``); collectives are their payload
read from the compiled program, which can differ from the formula (a test below makes it).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from helpers import tree_allclose

import parallelkit as pk
from parallelkit.core.reports import D2D, D2H, H2D
from parallelkit.measure.traffic import TopologyModel, bus_bytes, ring_factor

STRATEGIES = {
    "SingleDevice": lambda n: pk.SingleDevice(),
    "Mirrored(jit)": lambda n: pk.Mirrored(n, backend="jit"),
    "Mirrored(pmap)": lambda n: pk.Mirrored(n, backend="pmap"),
    "CentralStorage": lambda n: pk.CentralStorage(n),
    "PS(1 shard)": lambda n: pk.ParameterServer(1, devices=n),
    "PS(3 shards)": lambda n: pk.ParameterServer(3, devices=n),
    "TensorParallel": lambda n: pk.TensorParallel(n, devices=jax.devices()[:n]),
}
P = 19_240  # the MLP fixture: 64x64 + 64 + 64x10 + 10 float32
M = 8  # its metrics: the loss and the accuracy, two float32 scalars
B = 64 * (8 * 8 * 4 + 4)  # the batch: 64 images of 8x8 float32 and 64 int32 labels


@pytest.fixture(scope="module")
def traffic(mlp, digits):
    """name -> StepTraffic on 8 devices, measured once for the module (on the `batch` fixture's batch)."""
    loss_fn, params = mlp
    batch = next(pk.data.batches(digits, 64, steps=1))
    out = {}
    for name, make in STRATEGIES.items():
        strategy = make(8)
        out[name] = pk.traffic.step_traffic(strategy, loss_fn, strategy.init(params, optax.sgd(0.1)), batch)
    return out


def test_the_known_model_has_the_sizes_the_formulas_use(mlp, batch):
    _, params = mlp
    assert pk.models.param_bytes(params) == P
    assert sum(x.nbytes for x in batch.values()) == B


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_measured_flow_equals_its_formula(traffic, name):
    t = traffic[name]
    assert (t.param_bytes, t.metric_bytes) == (P, M)
    for flow in (*t.flows, *t.owner_flows):
        assert flow.measured == pytest.approx(flow.expected, abs=1e-9), f"{name}: {flow}"
    assert t.flow("batch").measured == B / t.replicas


def test_single_device_moves_only_its_batch(traffic):
    t = traffic["SingleDevice"]
    assert (t.replicas, t.pattern) == (1, "single")
    assert (t.host_to_device, t.device_to_host, t.between_devices) == (B, 0, 0)


@pytest.mark.parametrize("name", ["Mirrored(jit)", "Mirrored(pmap)"])
def test_mirrored_all_reduces_the_gradients_and_metrics(traffic, name):
    t = traffic[name]
    # the compiled program's all-reduce payload: every gradient and the two metric scalars, once
    assert t.flow("gradients and metrics (all-reduce)").measured == P + M
    assert t.flow("other collectives").measured == 0
    assert (t.host_to_device, t.device_to_host) == (B / 8, 0)  # the state never leaves the devices
    # derived, labelled so: a ring sends 2(n-1)/n of the payload per device (NCCL's bus bytes)
    assert t.bus_bytes == pytest.approx(2 * 7 / 8 * (P + M))


def test_tensor_parallel_all_reduces_activations_not_gradients(traffic):
    t = traffic["TensorParallel"]
    assert (t.replicas, t.pattern) == (1, "tensor")
    assert t.flow("batch").measured == B  # every device sees the whole batch
    # forward: the partial logits, 64 x 10 floats; backward: nothing (the first block's input is the data)
    assert t.flow("activations").measured == 64 * 10 * 4 < P


def test_a_collective_the_formula_does_not_expect_is_reported(digits, batch):
    """Synced BatchNorm adds all-reduces of batch statistics: measured payload > the formula's P + M."""
    from flax import nnx

    model = pk.models.from_nnx(pk.models.CNN((8, 8, 1), 10, batch_norm=True, rngs=nnx.Rngs(0)))
    loss_fn = pk.models.classifier_loss(model.apply)
    strategy = pk.Mirrored(4)
    state = strategy.init(model.params, optax.sgd(0.1), model_state=model.model_state)
    t = strategy.traffic(loss_fn, state, batch)
    flow = t.flow("gradients and metrics")
    assert flow.measured > flow.expected == pk.models.param_bytes(model.params) + M


def test_without_a_formula_the_payload_is_still_reported(batch, digits):
    apply, params = pk.models.build("transformer", digits.input_shape, digits.num_classes)
    strategy = pk.TensorParallel(2, devices=jax.devices()[:2])
    t = strategy.traffic(pk.models.classifier_loss(apply), strategy.init(params, optax.sgd(0.1)), batch)
    (flow,) = [f for f in t.flows if f.link == D2D]
    assert flow.expected is None and flow.measured > 0 and "n/a" in t.table()


def test_central_storage_pulls_and_pushes_p_per_replica(traffic):
    t = traffic["CentralStorage"]
    assert t.flow("parameters (pull)").measured == P
    assert t.flow("gradients (push").measured == P
    assert t.host_to_device == B / 8 + P and t.device_to_host == 0
    assert t.between_devices == P + M  # the push to the storage device; the workers' program has no collective
    assert t.flow("collectives").measured == 0
    assert t.owner_bytes == (8 * P,)  # the one storage receives every replica's gradient


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("make", [lambda: pk.CentralStorage(4), lambda: pk.ParameterServer(3, devices=4)])
def test_the_state_round_trip_at_the_owner_is_counted(mlp, batch, optimizer, make):
    """The update program reads the whole state from host memory and writes it back, every step.

    By hand: SGD's state is the parameters and the step counter; Adam's adds two moments of
    P bytes and its own counter. Each PS shard but the first also reads and writes a copy
    of the step counter. The measured figure is read from the compiled update programs.
    """
    loss_fn, params = mlp
    strategy = make()
    tx = {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-3)}[optimizer]
    t = strategy.traffic(loss_fn, strategy.init(params, tx), batch)
    state_bytes = {"sgd": P + 4, "adam": 3 * P + 4 + 4}[optimizer]
    shards = getattr(strategy, "num_shards", 1)
    if optimizer == "adam":
        state_bytes += (shards - 1) * 4  # each shard has its own Adam counter
    state_bytes += (shards - 1) * 4
    assert t.flow("state in").measured == t.flow("state out").measured == state_bytes
    assert t.flow("state in").link == H2D and t.flow("state out").link == D2H
    assert t.flow("state in").expected == state_bytes
    assert "at the owner(s), once per step" in t.table()


@pytest.mark.parametrize("shards", [1, 3])
def test_parameter_servers_split_the_push_and_pull_over_their_shards(traffic, shards):
    t = traffic[f"PS({shards} shard{'s' * (shards > 1)})"]
    assert t.flow("parameters").measured == P and t.flow("gradients").measured == P
    assert t.between_devices == P + M  # each gradient piece pushed to its shard's device, the metrics to shard 0
    assert len(t.owner_bytes) == shards and sum(t.owner_bytes) == 8 * P
    # balanced: each shard's slice differs by at most one float32, so its load by at most 8 of them
    assert max(t.owner_bytes) - min(t.owner_bytes) <= 8 * 4
    if shards == 3:
        assert t.owner_bytes == (8 * 6412, 8 * 6416, 8 * 6412)


def test_two_devices(mlp, batch):
    """With n = 2 a ring sends exactly the gradient once: 2(n-1)/n = 1."""
    loss_fn, params = mlp
    for strategy in (pk.Mirrored(2), pk.CentralStorage(2)):
        t = pk.traffic.step_traffic(strategy, loss_fn, strategy.init(params, optax.sgd(0.1)), batch)
        assert all(f.measured == pytest.approx(f.expected) for f in (*t.flows, *t.owner_flows))
        assert t.flow("batch").measured == B / 2
        if isinstance(strategy, pk.strategies.MirroredJit):
            assert t.between_devices == P + M and t.host_to_device == B / 2
            assert t.bus_bytes == P + M  # 2(n-1)/n = 1
        else:
            assert (t.host_to_device, t.device_to_host, t.between_devices) == (B / 2 + P, 0, P + M)


def test_totals_and_tables(traffic):
    t = traffic["CentralStorage"]
    assert t.total(H2D, expected=True) == B / 8 + P and t.total(D2H) == 0 and t.total(D2D) == P + M
    with pytest.raises(ValueError, match="Unknown link 'wire'"):
        t.total("wire")
    with pytest.raises(KeyError, match="no flow 'nothing'"):
        t.flow("nothing")
    text = t.table()
    assert "parameters (pull)" in text and "19,240" in text and "153,920" in text
    lines = pk.traffic.compare_table(list(traffic.values())).splitlines()
    assert len(lines) == 2 + len(STRATEGIES)
    assert "19,248 (19,248)" in lines[3]  # Mirrored(jit): gradients + metrics between replicas


def test_measuring_leaves_the_state_usable(mlp, batch):
    """step_traffic pulls and computes for real but never donates or changes the state."""
    loss_fn, params = mlp
    strategy = pk.ParameterServer(2, devices=4)
    state = strategy.init(params, optax.sgd(0.1))
    pk.traffic.step_traffic(strategy, loss_fn, state, batch)
    tree_allclose(strategy.unreplicate(state.params), params, rtol=0, atol=0)
    state, _ = strategy.step(loss_fn)(state, batch)
    assert int(jax.device_get(state.step)) == 1


def test_a_strategy_of_ones_own_reports_its_traffic(mlp, batch):
    """A new strategy gets the compiled-program measurement from the base class; no list of known classes."""

    class Custom(pk.Strategy):
        def init(self, params, tx, opt_state=None):
            return pk.TrainState(step=np.zeros((), np.int32), params=params, opt_state=tx.init(params), tx=tx)

        def step(self, loss_fn):
            return pk.SingleDevice(self.devices[0]).step(loss_fn)

        def place_batch(self, batch):
            return jax.device_put(batch, self.devices[0])

    loss_fn, params = mlp
    strategy = Custom(1)
    t = pk.traffic.step_traffic(strategy, loss_fn, strategy.init(params, optax.sgd(0.1)), batch)
    assert (t.host_to_device, t.between_devices, t.pattern) == (B, 0, "single")


def test_bus_bytes_follow_nccls_convention():
    from parallelkit.measure.inspect import Collective

    def one(op, nbytes, group):
        return Collective(op, ("f32[1]",), nbytes // 4, nbytes, group)

    assert bus_bytes([one("all-reduce", 800, 8)]) == 1400  # 2(n-1)/n x S
    assert bus_bytes([one("all-gather", 800, 8)]) == 700  # (n-1)/n x the gathered S
    assert bus_bytes([one("reduce-scatter", 100, 8)]) == 700  # (n-1) x the scattered shard


def test_ring_factor():
    assert [ring_factor(n) for n in (1, 2, 4, 8)] == [0, 1, 1.5, 1.75]


NVLINK = TopologyModel(device_link_GBps=300, host_link_GBps=25, host_total_GBps=50, latency_us=5)
NO_PEER_LINK = TopologyModel(device_link_GBps=None, host_link_GBps=25, host_total_GBps=50, latency_us=5)
SLOW_PEER_LINK = TopologyModel(device_link_GBps=5, host_link_GBps=25, host_total_GBps=None, latency_us=5)


def test_topology_model_formulas():
    alpha = 5e-6
    assert NVLINK.mirrored_seconds(8e6, 8) == pytest.approx(14 * (alpha + 1e6 / 300e9))
    assert NVLINK.mirrored_seconds(8e6, 1) == 0
    # without a peer link, each of the 14 rounds goes up to the host and down (two latencies), and the
    # 8 devices' 1 MB messages share the host's 50 GB/s
    assert NO_PEER_LINK.mirrored_seconds(8e6, 8) == pytest.approx(14 * (2 * alpha + 8e6 / 50e9))
    # 8 devices pull 8 MB each through a 50 GB/s host side, then push as much back
    assert NVLINK.central_seconds(8e6, 8) == pytest.approx(2 * (alpha + 64e6 / 50e9))
    # 4 shards share that load; each worker's own 25 GB/s link still carries all 8 MB
    assert NVLINK.parameter_server_seconds(8e6, 8, 4) == pytest.approx(2 * (alpha + max(8e6 / 25e9, 16e6 / 50e9)))
    with pytest.raises(ValueError, match="bandwidth must be a number > 0"):
        TopologyModel(device_link_GBps=0, host_link_GBps=25)
    with pytest.raises(ValueError, match="host_link_GBps=None.*bandwidth must be a number > 0"):
        TopologyModel(300, None)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        TopologyModel(300, 25, latency_us=-1)


@pytest.mark.parametrize("model", [NVLINK, NO_PEER_LINK], ids=["nvlink", "no-peer-link"])
def test_central_storage_wins_only_below_the_crossover(model):
    cross = model.crossover_bytes(8)
    assert 0 < cross < 10e6  # latency-bound small models only
    for p, central_wins in ((cross / 2, True), (cross * 2, False), (400e6, False)):
        assert (model.central_seconds(p, 8) < model.mirrored_seconds(p, 8)) is central_wins


def test_crossover_on_fast_links_is_smaller_and_slow_peer_links_favour_central_storage():
    assert NVLINK.crossover_bytes(8) < NO_PEER_LINK.crossover_bytes(8)
    assert SLOW_PEER_LINK.crossover_bytes(8) == float("inf")
    assert SLOW_PEER_LINK.central_seconds(400e6, 8) < SLOW_PEER_LINK.mirrored_seconds(400e6, 8)
    assert NVLINK.crossover_bytes(1) == 0


def test_topology_model_reads_measured_traffic(traffic):
    assert NVLINK.seconds(traffic["SingleDevice"]) == 0
    assert NVLINK.seconds(traffic["Mirrored(jit)"]) == NVLINK.mirrored_seconds(P, 8)
    assert NVLINK.seconds(traffic["CentralStorage"]) == NVLINK.central_seconds(P, 8)
    assert NVLINK.seconds(traffic["PS(3 shards)"]) == NVLINK.parameter_server_seconds(P, 8, 3)
    with pytest.raises(ValueError, match="no model for TensorParallel"):
        NVLINK.seconds(traffic["TensorParallel"])


def test_async_parameter_servers_say_what_to_measure_instead(mlp, batch):
    loss_fn, params = mlp
    strategy = pk.ParameterServer(2, mode="async", devices=2)
    with pytest.raises(ValueError, match=r"measured for a synchronous step.*ParameterServer\(2, devices=...\)"):
        strategy.traffic(loss_fn, strategy.init(params, optax.sgd(0.1)), batch)


def test_topology_model_speaks_the_cost_models_pattern_names_only():
    assert set(pk.traffic.TOPOLOGY) <= set(pk.costmodel.PATTERNS)
    with pytest.raises(ValueError, match=r"'all-reduce' is not one of the cost model's patterns"):
        pk.traffic.register_topology("all-reduce", lambda model, t: 0.0)
    with pytest.raises(ValueError, match="already models the pattern 'mirrored'"):
        pk.traffic.register_topology("mirrored", lambda model, t: 0.0)
